"""Rank-matched, all-or-none exchanges between peers whose models are split across their workers (issue 48).

A peer whose model is split (``gossiptrain.protocol.pieces``: FSDP shards,
pipeline stages) is R ranks, rank r owning piece r. Two such peers average
rank by rank: rank r of each sends its piece to rank r of the other, over
its own link, so no rank carries another's bytes. What makes the R
transfers one exchange is that it is **applied on every rank of both peers
or on none**: the pieces of a model always come from the same mix, and a
gathered model is what unsplit peers with the same exchanges hold (bit for
bit: tests/test_piece_exchange.py).

One exchange, requester P, server Q, id ``xid``, weight ``a``:

1. At a group safe point P's leader picks Q, the xid and ``a`` and tells its
   ranks (the driver's collective). Each rank ``start``s: it keeps a
   snapshot of its piece and sends it to Q's rank r (``XPREQ``).
2. Q's rank r ``receive``s the request (a malformed one is refused at once)
   and keeps it for Q's next safe point, where the requests every rank of Q
   holds are served (``serve_waiting``), all from the pieces that safe point
   took, so that P gets one model's pieces whenever each copy arrived: it
   answers with its own piece (``XPREP``) and keeps the merge it would make,
   ``a (s_P - s_Q)``, as *held*, not applied; or refuses (``XPNAK``: busy, or
   P's word on the last exchange it held for P has not come yet; the outcome
   of that one is settled at the same safe point, before, when it came).
3. Each of P's ranks learns its outcome (``reply``, ``refused``, or its
   deadline passes) and reports ``status(xid)``. At a safe point the driver
   gathers the R statuses and ``decide`` answers for all ranks at once:
   every rank has its reply: commit; any refused or late: abort; else wait.
   P's ranks ``commit`` (move by ``a (s_Q - s_P)``, keeping the local steps
   taken meanwhile, as pairwise averaging does) or ``abort``; P's leader
   tells Q's leader the outcome (``XPEND``).
4. Q's leader hands the outcome to its ranks at Q's next safe point (the
   driver's broadcast), and each ``settle``s the held merge: applied on
   commit, dropped on abort. A held merge with no outcome by its deadline
   is dropped: the requester is most likely dead (``expired``, the union
   over the group's ranks, so that every rank drops it).

Neither side applies anything before every rank of the requester has the
reply, so a refusal, a timeout or a dead rank on either side leaves both
models as they were. The one fault this cannot absorb is the one pairwise
averaging cannot either: an outcome lost on the network after the
requester committed (in practice the requester died, and its model left
the swarm with it).

**Compressed pieces.** With a codec (``gossip.compression``: fp16, bf16,
int8) a rank encodes its piece for the wire and both sides average the
values that travelled, decoded (its own piece as the partner reads it), so
what one side's merge adds the other's removes: nothing is made or lost. A
piece that does not encode (non-finite) fails its exchange on every rank;
one that arrives non-finite is refused.
Downloads (``snapshot``, ``install``) travel as they are. With ``auto``
(``AutoCodec``) the group's leader sets the level every rank encodes at
(``level``); a reply is at least as lossy as its request, as a whole-model
peer's is, so that a requester's measure is of its own level.

**Staleness weights** (``gossip.staleness_weighting``, ``staleness_bound``),
as a whole-model peer's pairwise averaging runs them: a request carries
the requester's step, the server scales the weight it serves at by the
policy's factor for the two peers' step difference (or refuses a request
past the bound), and the reply carries that weight, which the requester
applies. Every rank of a peer is at the same step (the group's), so every
rank serves and applies one exchange at the same weight.

**Norms far apart** (the stability guard's rule for partners, ``gossip.guard``):
a request carries the requester's whole model's norm (the group's guard
judges the sum of its ranks' squares: the same number on every rank), and
a server whose own is ``NORM_RATIO`` times from it refuses, on every rank
alike: one of the two blew up, and averaging would hand it on.

Sans-IO: tensors in, actions out; the driver sends the messages and runs
the group's collective (a few hundred bytes: ``Status``, ``Outcome``;
``gossiptrain.runtime.split_group``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import Tensor

from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import XPEND, XPHELLO, XPNAK, XPREP, XPREQ, XPWELCOME
from gossiptrain.protocol.compression import AutoCodec, Codec, first_non_finite
from gossiptrain.protocol.merges import PendingMerges
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout
from gossiptrain.protocol.stability import NORM_RATIO
from gossiptrain.protocol.staleness import StalenessPolicy
from gossiptrain.state.host_buffers import BufferPool

#: A held merge is dropped this many exchange timeouts after it was served without an outcome. The requester
#: decides at its first safe point past its own timeout and tells us at once; its word coming later than this
#: after a commit is the one fault the protocol cannot absorb (module docstring), so the margin is wide.
HOLD_TIMEOUTS = 4
#: Requests a rank keeps waiting for the group's next safe point, at most (more are refused at once).
MAX_WAITING = 8

__all__ = [
    "XPEND", "XPHELLO", "XPNAK", "XPREP", "XPREQ", "XPWELCOME", "Outcome", "PieceStats", "RankExchanges", "Send", "Status",
    "decide", "hello_answer", "welcome_addresses",
]


#: Longest address a hello may name for a rank (as membership's entries).
MAX_ADDRESS = 256


def hello_answer(mine: PieceLayout, addresses: Sequence[str], body: Mapping[str, object]) -> dict[str, object]:
    """A split peer's leader's answer to a hello (``XPHELLO``: the asker's layout): our layout and every rank's
    address where the asker's layout is ours, else a refusal that names both, as the asker will read it."""
    try:
        theirs = PieceLayout.from_wire(body.get("layout"))
    except ProtocolError as e:
        return {"refused": f"a hello without a readable layout: {e}"}
    problem = theirs.mismatch(mine)  # the asker's words: "this peer's model is split as <theirs>; the swarm's as <ours>"
    if problem is not None:
        return {"refused": problem}
    return {"layout": mine.to_wire(), "addresses": list(addresses)}


def welcome_addresses(mine: PieceLayout, body: Mapping[str, object]) -> tuple[str, ...]:
    """The partner's ranks' addresses from its answer to our hello (``XPWELCOME``); ProtocolError with its words
    where it refused us (another layout), or where the answer is malformed or holds another layout after all."""
    refused = body.get("refused")
    if refused is not None:
        raise ProtocolError(str(refused)[:1000])
    theirs = PieceLayout.from_wire(body.get("layout"))
    problem = mine.mismatch(theirs)
    if problem is not None:
        raise ProtocolError(problem)
    addresses = body.get("addresses")
    if not (isinstance(addresses, list) and len(addresses) == mine.ranks
            and all(type(a) is str and 0 < len(a) <= MAX_ADDRESS for a in addresses)):
        raise ProtocolError(f"a welcome names one address (a string) for each of the {mine.ranks} ranks")
    return tuple(addresses)


class Status(enum.IntEnum):
    """A requester rank's state of one exchange, gathered over the group to ``decide``."""

    WAITING = 0
    READY = 1  # the partner rank's reply is here
    FAILED = 2  # refused, unreadable, or past its deadline


class Outcome(enum.IntEnum):
    """What every rank of both peers does with one exchange."""

    WAIT = 0
    COMMIT = 1
    ABORT = 2


def decide(statuses: Sequence[int]) -> Outcome:
    """The outcome for all ranks from each rank's ``Status``: all ready: commit; any failed: abort; else wait."""
    if not statuses:
        raise ValueError("an exchange is decided over at least one rank's status")
    if any(s == Status.FAILED for s in statuses):
        return Outcome.ABORT
    if all(s == Status.READY for s in statuses):
        return Outcome.COMMIT
    return Outcome.WAIT


@dataclass(frozen=True)
class Send:
    """A message for the driver to send to ``to``'s rank of the same index (``to`` is the partner peer)."""

    to: str
    kind: str
    xid: int
    tensors: Mapping[str, Tensor] = field(default_factory=dict)
    meta: Mapping[str, float] = field(default_factory=dict)


@dataclass
class _Asked:
    """An exchange this rank started: the piece sent, and what came back."""

    partner: str
    share: float
    snapshot: list[Tensor]
    deadline: float
    remote: list[Tensor] | None = None
    failed: bool = False


@dataclass
class _Held:
    """A request this rank served: the merge it makes once the requester commits."""

    requester: str
    delta: list[Tensor]  # s_requester - s_ours, at the time we answered
    share: float
    deadline: float


@dataclass
class _Waiting:
    """A request received and checked, to be served at a safe point of the whole group (``serve_waiting``)."""

    requester: str
    addr: str  # the requester rank's address, where the answer goes
    remote: list[Tensor]
    share: float
    deadline: float
    level: int = 0  # the request's compression level (``auto``): the answer is at least as lossy
    step: int | None = None  # the requester's step when it asked (None: not said, no staleness weight)
    norm: float | None = None  # the requester's whole model's norm (None: not said)


@dataclass
class PieceStats:
    """One rank's counts (a group's ranks decide alike, so any rank's ``committed`` and ``aborted`` are the group's)."""

    started: int = 0
    committed: int = 0  # exchanges we asked for and applied
    aborted: int = 0  # ...and dropped (a rank refused, failed or was late)
    served: int = 0  # requests answered and held
    applied: int = 0  # held merges applied (the requester committed)
    dropped: int = 0  # held merges dropped (the requester aborted, or no outcome by the deadline)
    refused: int = 0  # requests refused (busy, malformed, past the staleness bound, or a norm far from ours)
    stale_dropped: int = 0  # ...of which past the staleness bound (``gossip.staleness_bound``)
    norms_apart: int = 0  # ...of which from a requester whose model's norm is NORM_RATIO times from ours


class RankExchanges:
    """One rank's side of its peer's piece exchanges (see the module docstring).

    ``piece`` is this rank's piece as views of its local tensors (writing
    them writes the model); ``entries`` its layout entry, which every piece
    received is checked against before it is held or merged.
    """

    def __init__(self, piece: Mapping[str, Tensor], entries: Sequence[PieceEntry], *, timeout: float,
                 codec: Codec | None = None, staleness: StalenessPolicy | None = None) -> None:
        if [e.name for e in entries] != list(piece):
            raise ValueError("a rank's piece and its layout entries name the same tensors in the same order")
        if not timeout > 0:
            raise ValueError(f"an exchange's timeout is a positive number of seconds, not {timeout}")
        self.names = list(piece)
        self.params = list(piece.values())
        self.entries = tuple(entries)
        self.timeout = timeout
        # Pieces travel encoded so (None: as they are). Both sides then average the values that travelled (our own as
        # the partner decodes it), so what one side's merge adds the other's removes.
        self.codec = codec
        # The weight of a served request by how many steps apart the two peers are (constant: 1, the default)
        self.staleness = staleness or StalenessPolicy()
        self.step = 0  # the group's step, set by the driver at each safe point (the same on every rank)
        self.norm: float | None = None  # the whole model's norm as the group's guard last judged it (None: no guard)
        self.stats = PieceStats()
        self._pool = BufferPool()
        self._pending = PendingMerges(self.params, self._pool)
        # The piece as of the last safe point, never written: what requests are answered with, from the network
        # side, while the training side steps the live tensors (merges land only at safe points: see apply).
        self._base = self._pool.copies(self.params)
        self._asked: dict[int, _Asked] = {}
        self._held: dict[int, _Held] = {}
        self._waiting: dict[int, _Waiting] = {}  # requests received, for the group's next safe point

    # -- requester -----------------------------------------------------------------------------

    def start(self, xid: int, partner: str, share: float, now: float) -> Send | None:
        """Ask ``partner``'s rank of our index to average (every rank of the group, with the same xid and share).
        None where the piece does not encode (non-finite): the exchange is failed on this rank, so every rank's
        group aborts it (``decide``), and nothing is sent."""
        if not 0 < share <= 0.5:
            raise ValueError(f"an exchange's weight is in (0, 1/2], not {share}")
        if xid in self._asked:
            raise ValueError(f"exchange {xid} is already in flight")
        self.stats.started += 1
        try:
            sent = self._sent(self._base)  # started at a safe point: the piece as it took it (frozen until the next)
        except ProtocolError:
            self._asked[xid] = _Asked(partner, share, [], now + self.timeout, failed=True)
            return None
        snapshot = self._as_received(sent)  # what the partner will average with
        self._asked[xid] = _Asked(partner, share, snapshot, now + self.timeout)
        meta: dict[str, float] = {"a": share, "step": self.step}
        if self.norm is not None and self.norm > 0:  # (a model of zeros has no norm to compare)
            meta["norm"] = self.norm
        return Send(partner, XPREQ, xid, sent, meta)

    def reply(self, sender: str, xid: int, tensors: Mapping[str, Tensor], a: float | None = None) -> None:
        """The partner rank answered, at weight ``a`` (None: the one we asked for; a staleness weight makes it less):
        kept until the group decides (one to an exchange we do not know is ignored; a malformed one, or one at a
        weight above what we asked for, makes the exchange fail, and nothing of it is ever applied)."""
        asked = self._asked.get(xid)
        if asked is None or asked.partner != sender or asked.remote is not None or asked.failed:
            return
        if a is not None:
            if not 0 < a <= asked.share:
                asked.failed = True
                return
            asked.share = a
        try:
            asked.remote = self._checked(tensors, coded=True)
        except ProtocolError:
            asked.failed = True

    def refused(self, sender: str, xid: int) -> None:
        asked = self._asked.get(xid)
        if asked is not None and asked.partner == sender:
            asked.failed = True

    def status(self, xid: int, now: float) -> Status:
        """This rank's state of exchange ``xid`` for the group's ``decide`` (past its deadline without a reply: failed)."""
        asked = self._asked.get(xid)
        if asked is None or asked.failed:
            return Status.FAILED
        if asked.remote is not None:
            return Status.READY
        return Status.FAILED if now >= asked.deadline else Status.WAITING

    def commit(self, xid: int) -> None:
        """Every rank has its reply: move by ``a (s_partner - s_sent)`` at the next ``apply`` (local steps since kept)."""
        asked = self._asked.pop(xid)
        if asked.remote is None:
            raise ValueError(f"exchange {xid} committed on a rank without its reply: decide() says when")
        self._pending.add_difference(asked.remote, asked.snapshot, asked.share)
        self.stats.committed += 1

    def abort(self, xid: int) -> None:
        """Some rank's half failed: this rank's half is dropped too."""
        if self._asked.pop(xid, None) is not None:
            self.stats.aborted += 1

    @property
    def in_flight(self) -> tuple[int, ...]:
        """The exchanges this rank asked for and has not settled, oldest first."""
        return tuple(self._asked)

    # -- server --------------------------------------------------------------------------------

    def receive(self, sender: str, xid: int, tensors: Mapping[str, Tensor], meta: Mapping[str, float], now: float,
                addr: str) -> Send | None:
        """A request, on arrival: checked and kept for the group's next safe point (``waiting``, ``serve_waiting``),
        so that every rank answers it from the same safe point's piece; a refusal to send at once where it is
        malformed, or too many wait."""
        share = float(meta.get("a", 0.5))
        try:
            remote = self._checked(tensors, coded=True)
        except ProtocolError:
            remote = None
        if remote is None or not 0 < share <= 0.5 or xid in self._waiting or len(self._waiting) >= MAX_WAITING:
            self.stats.refused += 1
            return Send(sender, XPNAK, xid)
        step, norm = meta.get("step"), meta.get("norm")
        self._waiting[xid] = _Waiting(sender, addr, remote, share, now + self.timeout, self._level_of(tensors),
                                      int(step) if step is not None else None, float(norm) if norm is not None else None)
        return None

    def waiting(self, now: float) -> list[tuple[int, str]]:
        """(xid, requester) of the requests kept for a safe point (those past the requester's deadline dropped:
        it has given up on them); the group serves those every rank holds."""
        for xid in [x for x, w in self._waiting.items() if now >= w.deadline]:
            del self._waiting[xid]
        return [(xid, w.requester) for xid, w in self._waiting.items()]

    def serve_waiting(self, xid: int, now: float) -> tuple[Send, str]:
        """At a safe point, after ``apply``: answer a kept request (``serve``'s rules, from the piece just taken),
        and the address the answer goes to. Every rank of the group calls it for the same xids."""
        w = self._waiting.pop(xid)
        return self._serve(w.requester, xid, w.remote, w.share, now, w.level, w.step, w.norm), w.addr

    def serve(self, sender: str, xid: int, tensors: Mapping[str, Tensor], meta: Mapping[str, float], now: float) -> Send:
        """Answer a request with our piece and hold its merge until the requester's outcome; refuse when busy
        (our own exchanges and held merges would take back more than the whole piece) or malformed."""
        try:
            remote = self._checked(tensors, coded=True)
        except ProtocolError:
            self.stats.refused += 1
            return Send(sender, XPNAK, xid)
        step, norm = meta.get("step"), meta.get("norm")
        return self._serve(sender, xid, remote, float(meta.get("a", 0.5)), now, self._level_of(tensors),
                           int(step) if step is not None else None, float(norm) if norm is not None else None)

    def _serve(self, sender: str, xid: int, remote: list[Tensor], share: float, now: float, level: int = 0,
               step: int | None = None, norm: float | None = None) -> Send:
        if self._norms_apart(norm):
            self.stats.refused += 1
            self.stats.norms_apart += 1
            return Send(sender, XPNAK, xid)
        if step is not None:  # the staleness weight: both ends must agree, so the step difference either way
            weight = self.staleness.weight(abs(self.step - step))
            if weight is None:
                self.stats.refused += 1
                self.stats.stale_dropped += 1
                return Send(sender, XPNAK, xid)
            share *= weight
        committed = sum(x.share for x in self._asked.values()) + sum(h.share for h in self._held.values())
        # One held exchange per requester: its next request already carries what our answer to the last one did
        # to it, while our piece does not yet (a held merge is applied only on the requester's word), so the two
        # would be averaged from views one exchange apart. The requester asks again once we settled.
        again = any(h.requester == sender for h in self._held.values())
        sent = None
        if 0 < share <= 0.5 and committed + share <= 1.0 and xid not in self._held and not again:
            try:
                sent = self._sent(self._base, at_least=level)
            except ProtocolError:  # our piece does not encode (non-finite): nothing to answer with, refused
                pass
        if sent is None:
            self.stats.refused += 1
            return Send(sender, XPNAK, xid)
        delta = self._pending.difference(remote, self._as_received(sent))
        self._held[xid] = _Held(sender, delta, share, now + HOLD_TIMEOUTS * self.timeout)
        self.stats.served += 1
        return Send(sender, XPREP, xid, sent, {"a": share})

    def _norms_apart(self, theirs: float | None) -> bool:
        """Whether the requester's model's norm and ours are ``NORM_RATIO`` apart (either unknown: not)."""
        ours = self.norm
        if ours is None or theirs is None or not math.isfinite(theirs) or theirs <= 0 or ours <= 0:
            return False
        return max(theirs, ours) > NORM_RATIO * min(theirs, ours)

    def settle(self, xid: int, outcome: Outcome, requester: str) -> None:
        """``requester``'s outcome, as the leader handed it to every rank: the held merge applied or dropped. The
        word of any other member about it changes nothing (an outcome is the requester's to give)."""
        held = self._held.get(xid)
        if held is None or held.requester != requester:
            return
        del self._held[xid]
        if outcome == Outcome.COMMIT:
            self._pending.add(held.delta, held.share)
            self.stats.applied += 1
        else:
            self.stats.dropped += 1

    def expired(self, now: float) -> list[tuple[int, str]]:
        """(xid, requester) of held merges past their deadline without an outcome: the group drops them on every
        rank (the union of its ranks' lists: a rank whose request was lost holds nothing to time out)."""
        return [(xid, h.requester) for xid, h in self._held.items() if now >= h.deadline]

    @property
    def held(self) -> tuple[int, ...]:
        return tuple(self._held)

    # -- the stability guard ---------------------------------------------------------------------

    def put_back(self) -> tuple[list[int], list[tuple[Send, str]]]:
        """The piece was put back (the group's stability guard: a blow-up), on every rank at the same safe point,
        before anything of it was decided: every merge computed from the piece it replaced is forgotten. Our
        exchanges in flight are aborted (their xids returned: the leader tells the partners), held merges dropped,
        pending ones cleared, and the requests waiting refused (the refusals returned, with where they go). The sum
        of the swarm's models is not kept across a put-back: the blow-up had broken it already."""
        aborted = list(self._asked)
        for xid in aborted:
            self.abort(xid)
        self.stats.dropped += len(self._held)
        self._held.clear()
        self._pending.clear()
        return aborted, self.refuse_waiting()

    def refuse_waiting(self) -> list[tuple[Send, str]]:
        """Refuse every request kept for a safe point (a group settling after a blow-up neither asks nor serves)."""
        out = [(Send(w.requester, XPNAK, xid), w.addr) for xid, w in self._waiting.items()]
        self.stats.refused += len(out)
        self._waiting.clear()
        return out

    @property
    def copy_bytes(self) -> int:
        """Bytes of the frozen copy of the piece that partners are answered from (the memory this adds to a rank)."""
        return sum(t.untyped_storage().nbytes() for t in self._base)

    # -- the safe point ------------------------------------------------------------------------

    def apply(self) -> None:
        """At a safe point (between two optimizer steps), after the outcomes were handed out: add the merges
        settled to the piece, and take the piece as it now is as what partners are answered with."""
        self._pending.add_to(self.params)
        self._pending.clear()
        self._base = self._pool.copies(self.params)  # a free pooled buffer (one no reply or snapshot still holds)

    def snapshot(self) -> dict[str, Tensor]:
        """The piece as of the last safe point (never written): what a newcomer downloads, as partners get it."""
        return dict(zip(self.names, self._base))

    def fits(self, tensors: Mapping[str, Tensor]) -> bool:
        """Whether a donor's piece can go in: it matches this rank's layout entry and is finite (ProtocolError, saying
        why, if not), and no exchange is under way (ValueError)."""
        if self._asked or self._held:
            raise ValueError("a downloaded piece goes in before any exchange")
        self._checked(tensors)
        return True

    def install(self, tensors: Mapping[str, Tensor]) -> None:
        """A donor's piece (a state download, before any exchange): into the live tensors and the base; ProtocolError
        (nothing written) unless it matches this rank's layout entry and is finite."""
        if self._asked or self._held:
            raise ValueError("a downloaded piece goes in before any exchange")
        checked = self._checked(tensors)
        with torch.no_grad():
            torch._foreach_copy_(self.params, checked)
        self.apply()

    def _sent(self, tensors: list[Tensor], at_least: int = 0) -> dict[str, Tensor]:
        """What goes on the wire of ``tensors``: themselves by name, or encoded (ProtocolError: non-finite);
        ``at_least``: with ``auto``, a level at least that lossy."""
        named = dict(zip(self.names, tensors))
        codec = self.codec
        if isinstance(codec, AutoCodec):
            return codec.codecs[max(codec.level, at_least)].encode(named)
        return named if codec is None else codec.encode(named)

    def _level_of(self, tensors: Mapping[str, Tensor]) -> int:
        """The ``auto`` level a request came at (0 for any other codec)."""
        return AutoCodec.level_of(tensors) if isinstance(self.codec, AutoCodec) else 0

    @property
    def level(self) -> int:
        """The ``auto`` level pieces are encoded at (0 for any other codec); the group's leader sets it for all."""
        return self.codec.level if isinstance(self.codec, AutoCodec) else 0

    @level.setter
    def level(self, value: int) -> None:
        if isinstance(self.codec, AutoCodec):
            self.codec.level = int(value)

    def _as_received(self, sent: Mapping[str, Tensor]) -> list[Tensor]:
        """``sent`` as the partner reads it: decoded into our own dtypes (the codec's rounding kept)."""
        if self.codec is None:
            return list(sent.values())
        return list(self.codec.decode(sent, dict(zip(self.names, self.params))).values())

    def _checked(self, tensors: Mapping[str, Tensor], coded: bool = False) -> list[Tensor]:
        """The received piece in our order and dtypes; ProtocolError unless it matches our layout entry exactly and is
        finite (refused, never averaged). ``coded``: an exchange's,
        in our codec's wire form (a download's comes as it is)."""
        if coded and self.codec is not None:
            return self._as_received(tensors)  # names, shapes, dtypes and finiteness checked by the codec's decode
        if list(tensors) != self.names:
            raise ProtocolError(f"a piece of {len(tensors)} tensors where this rank holds {len(self.names)}")
        for e, t in zip(self.entries, tensors.values()):
            if str(t.dtype).removeprefix("torch.") != e.dtype or tuple(t.shape) != e.shape:
                raise ProtocolError(f"{e.name!r} is {t.dtype} {list(t.shape)}, this rank holds {e.dtype} {list(e.shape)}")
        bad = first_non_finite(tensors)  # (one pass for all, as the averaging's own check)
        if bad is not None:
            raise ProtocolError(f"{bad!r} has non-finite values")
        return list(tensors.values())
