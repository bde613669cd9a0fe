"""What a newcomer and a donor send each other: the state-transfer wire bodies, as events and actions.

Both ends speak this vocabulary, so it lives apart from either state
machine: the newcomer's ``RequestChunk`` arrives at the donor as a
``ChunkRequest``, the donor's ``Reply`` at the newcomer as a ``Chunk``,
``Accepted`` or ``Refusal``.

Wire (all bodies checked; tensors are raw uint8 bytes, nothing executable):

- ``sreq`` {sid, index, manifest[, optim]}: newcomer -> donor, "send chunk
  ``index`` of session ``sid``" (a new sid opens a session and must ask for
  the manifest; ``optim`` asks for the optimizer state too); index -1 ends
  the session.
- ``srep`` {sid, index[, size, chunk_bytes, layout, step, hashes, digest,
  tensors, samples, scalars]} + tensor ``chunk``: the chunk, with the
  manifest when it was asked for.
- ``sack`` {sid[, every]}: the donor opened the session; its first chunk
  follows its next safe point (see ``Accepted``).
- ``snak`` {sid, reason, retry}: refused; ``retry`` says the donor may take
  a session later (busy), otherwise it will not (not training, or a bad
  request).

Events are built from plain values (``from_body``: a checked body and its
tensors), never from wire messages, so that the protocol stays sans-IO: the
driver (``gossiptrain.runtime.state_endpoint``) decodes the message and
hands its parts over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from gossiptrain.errors import ProtocolError
from gossiptrain.state.snapshot import Manifest

CLOSE = -1  # the chunk index of an sreq that ends its session

#: Session ids are drawn below this (an int the wire carries as is), and a body's sid outside it is malformed.
SID_LIMIT = 1 << 31
#: A donor's refusal when it has not trained yet (or not lately): nothing worth downloading from it. The
#: newcomer tells it from other refusals by this text: donors that all say it mean a fresh swarm, not a failure.
NOT_TRAINING = "not training: no state worth giving"
_REASON_CHARS = 200  # a refusal's reason is cut to this for logs


def parse_sid(body: Mapping[str, Any]) -> int:
    """The session id of a state-transfer body; ProtocolError if it is not one we could have drawn."""
    sid = body.get("sid")
    if type(sid) is not int or not 0 <= sid < SID_LIMIT:
        raise ProtocolError("state transfer sid must be an int in [0, 2**31)")
    return sid


# -- newcomer -> donor ---------------------------------------------------------------------


@dataclass(frozen=True)
class RequestChunk:
    """Send an sreq to member ``to`` (index ``CLOSE`` ends the session)."""

    to: str
    sid: int
    index: int
    manifest: bool = False
    optim: bool = False  # with the manifest: ask for the optimizer state too


@dataclass(frozen=True)
class ChunkRequest:
    """An sreq from ``sender``, answered at ``addr``."""

    sender: str
    addr: str
    sid: int
    index: int
    manifest: bool
    optim: bool = False  # opening a session: the optimizer state too, if we have one

    @classmethod
    def from_body(cls, sender: str, addr: str, body: Mapping[str, Any]) -> "ChunkRequest":
        """The sreq ``sender`` sent (to be answered at ``addr``), from its body; ProtocolError if malformed."""
        index, manifest, optim = body.get("index"), body.get("manifest"), body.get("optim", False)
        if type(index) is not int or index < CLOSE or type(manifest) is not bool or type(optim) is not bool:
            raise ProtocolError("sreq needs an int index >= -1, a bool manifest and optionally a bool optim")
        return cls(sender, addr, parse_sid(body), index, manifest, optim)


# -- donor -> newcomer ---------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """Send an srep, sack or snak to ``addr``."""

    addr: str
    kind: str
    body: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Chunk:
    """An srep: chunk ``index`` of session ``sid``, with the manifest if it was asked for."""

    sender: str
    sid: int
    index: int
    data: torch.Tensor  # (n,) uint8
    manifest: Manifest | None = None

    @classmethod
    def from_body(cls, sender: str, body: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> "Chunk":
        """The srep ``sender`` sent, from its checked body and tensors; ProtocolError if malformed."""
        sid, index = parse_sid(body), body.get("index")
        if type(index) is not int or index < 0:
            raise ProtocolError("srep index must be an int >= 0")
        data = tensors.get("chunk")
        if len(tensors) != 1 or data is None or data.dtype != torch.uint8 or data.dim() != 1:
            raise ProtocolError("srep must carry exactly one 1-d uint8 tensor named chunk")
        manifest = Manifest.from_body(body) if "hashes" in body else None
        return cls(sender, sid, index, data, manifest)


@dataclass(frozen=True)
class Refusal:
    """An snak: the donor will not serve session ``sid``; ``retry``: it may later (busy, not ready)."""

    sender: str
    sid: int
    reason: str
    retry: bool

    @classmethod
    def from_body(cls, sender: str, body: Mapping[str, Any]) -> "Refusal":
        """The snak ``sender`` sent, from its body; ProtocolError if malformed."""
        reason, retry = body.get("reason"), body.get("retry")
        if not isinstance(reason, str) or type(retry) is not bool:
            raise ProtocolError("snak needs a str reason and a bool retry")
        return cls(sender, parse_sid(body), reason[:_REASON_CHARS], retry)


@dataclass(frozen=True)
class Accepted:
    """An sack: the donor opened session ``sid``; its first chunk follows its next safe point.

    Sent by the donor's network side as the request arrives, so the
    newcomer learns within a round trip that its opening request was not
    lost, where the first chunk waits for a step of the donor's training.
    ``every``, the donor's time between steps lately, says when that chunk
    is due (``fetcher.ANSWER_STEPS``); without it ``state.request_timeout``
    bounds the wait. Before, a request or first chunk lost on a lossy link
    held a newcomer for the whole timeout (5 s by default).
    """

    sender: str
    sid: int
    every: float | None = None  # the donor's seconds between safe points lately (None: not known yet)

    @classmethod
    def from_body(cls, sender: str, body: Mapping[str, Any]) -> "Accepted":
        """The sack ``sender`` sent, from its body; ProtocolError if malformed."""
        every = body.get("every")
        if every is not None and (type(every) not in (int, float) or not 0 <= every < math.inf):
            raise ProtocolError("sack every must be a finite number of seconds >= 0")
        return cls(sender, parse_sid(body), None if every is None else float(every))
