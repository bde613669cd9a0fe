"""State transfer: a newcomer downloads a live member's model before it trains.

A peer that joins or rejoins with its initial weights is far from where the
swarm has got to: it needs many exchanges to catch up, and each of them
pulls its partner back toward the start. Downloading the current state of a
live member first makes it useful from its first step.

Two sans-IO state machines, driven like the averaging and membership cores
(``handle(event, now) -> actions``; no sockets, no clock):

- ``Fetcher``, the newcomer: picks a donor at random among the live members
  of its view (untried ones first), opens a session and asks for the chunks
  of the donor's flattened state (parameters and buffers, in
  ``state_dict`` order, ``state.chunk_bytes`` each), ``state.window``
  requests in flight. The first answer of a session carries the snapshot's
  manifest: size, layout, the donor's step, the SHA-256 of every chunk and
  ``digest``, the SHA-256 over those chunk hashes (a hash list). Each chunk
  is checked against its donor's manifest before it is kept, and at the end
  the assembled bytes are hashed again, chunk by chunk, against the
  manifests. An opening the donor does not acknowledge (``Accepted``)
  within a few of the link's round trips, or whose first chunk is later
  than the donor's steps, the link and its bytes make due, is sent again,
  twice at most (the last waits ``state.request_timeout``). A
  donor that stops answering (``state.request_timeout``),
  refuses, or leaves the view is replaced and the download resumes from the
  chunks already verified; a donor whose data fails a check is not asked
  again; a state that fails the final check (or holds non-finite values) is
  discarded and fetched again from another donor. After ``state.max_donors``
  sessions or ``state.max_seconds`` the newcomer gives up and trains from its
  own initial weights.
- ``Donor``, every member: acknowledges a new session at once, and answers
  it from one snapshot taken at the
  trainer's next safe point (the only place the parameters may be read), so
  the newcomer gets a consistent model and the donor's training waits only
  for one copy of its state; everything else (hashing, answering) happens on
  the network side. It serves at most ``state.donor_sessions`` sessions at a
  time and refuses more at once, so that newcomers spread over donors, and
  drops a session's snapshot after ``state.session_timeout`` idle seconds.
  Only a member that is training (its trainer reached a safe point within
  ``state.request_timeout``, its own download over) opens sessions: any
  other has nothing better than the initial weights to give.

Chunk ``i`` covers the same bytes at every donor (the chunk size is part of
the run's configuration and the layout must match), which is what makes a
download resumable. A download resumed with another donor joins parts of two
snapshots, each verified against its own donor's manifest; gossip keeps the
members close to each other, so the joined state is as good a start as
either.

Optimizer state (``state.transfer_optimizer``): a newcomer that has its
optimizer at hand asks for it too (``optim`` in the request opening a
session). The donor then appends its optimizer's tensors (SGD momentum,
Adam's moments and step) to the same stream, named
``optimizer/<parameter>/<key>``, and sends any non-tensor state as scalars
in the manifest. The newcomer knows what to expect from a throwaway copy of
its own optimizer stepped once on zero gradients (``optimizer_template``):
a donor whose optimizer state differs in any name, shape or dtype (another
optimizer, or none) is named in an error and the download starts over for
the parameters alone. Nothing is unpickled: the state is raw tensor bytes
checked against that template, and scalars are checked ints or floats.
A newcomer whose optimizer is not known yet (``Peer`` finds it at its
first step, ``gossiptrain.runtime.optimizer_finder``) asks for whatever
optimizer state the first donor holds (``Fetcher(any_optimizer=True)``),
up to ``ANY_OPTIMIZER_SHARE`` times the model's bytes: that donor's table
becomes the one later donors must match, and the state waits, decoded, for
the optimizer to be found and checked against its template then.

The manifest lists the stream's tensors (name, dtype, shape) and the
donor's training samples seen, so that a tool that has no model of its own
(``gossiptrain export``, see ``gossiptrain.state.merged_model``) can download a
member's state, weight it and write it under its names.

Wire (all bodies checked; tensors are raw uint8 bytes, nothing executable):

- ``sreq`` {sid, index, manifest[, optim]}: newcomer -> donor, "send chunk
  ``index`` of session ``sid``" (a new sid opens a session and must ask for
  the manifest; ``optim`` asks for the optimizer state too); index -1 ends
  the session.
- ``srep`` {sid, index[, size, chunk_bytes, layout, step, hashes, digest,
  tensors, samples, scalars]} + tensor ``chunk``: the chunk, with the
  manifest when it was asked for.
- ``snak`` {sid, reason, retry}: refused; ``retry`` says the donor may take
  a session later (busy), otherwise it will not (not training, or a bad
  request).

The stream's format (bytes, tensor tables, manifests, snapshots) is
``gossiptrain.state.snapshot``; optimizer state, ``gossiptrain.state.optimizer_state``.

This module is sans-IO: events are built from plain values (``from_body``),
never from wire messages, so that it can be tested step by step and runs
the same in a real process and in the simulator. The driver that feeds it
(``StateEndpoint``, ``catch_up``, ``SnapshotHook``) is
``gossiptrain.runtime.state_endpoint``.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from gossiptrain.config import Limits, StateConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import SACK, SNAK, SREP
from gossiptrain.protocol.rtt import RttEstimator
from gossiptrain.protocol.step_timer import StepTimer
from gossiptrain.state.snapshot import (
    OPTIMIZER_PREFIX,
    Entry,
    Manifest,
    Snapshot,
    chunk_count,
    entry_nbytes,
    first_difference,
    hash_list_digest,
    sha256_hex,
    table_layout,
)

log = logging.getLogger(__name__)

CLOSE = -1  # the chunk index of an sreq that ends its session

_SID_LIMIT = 1 << 31
#: A donor whose chunks come at a measured pace is still given this long to answer (as TCP's minimum RTO: a
#: scheduling hiccup of a busy machine is not silence).
MIN_SILENCE_S = 0.2
#: A session's opening request not acknowledged within this many of the link's round trips is presumed lost and
#: sent again (the acknowledgement comes from the donor's network side at once, see ``Accepted``)...
OPEN_LATE_ROUND_TRIPS = 3.0
#: ...at most this many times in all; the last one waits ``state.request_timeout`` as any opening did before
#: (a donor whose network side is slow to answer on a loaded machine is not left for it).
OPEN_ATTEMPTS = 3
#: An acknowledged opening's first chunk is presumed lost after this many of the donor's steps (it comes at the
#: next safe point; the acknowledgement says how long they take), a few round trips, and the chunk's bytes at...
ANSWER_STEPS = 3.0
#: ...this rate (bytes/s): a slower link may get the chunk twice, a faster one waits no longer than it must.
FLOOR_RATE = 1e6
_REASON_CHARS = 200  # a refusal's reason is cut to this for logs
#: An optimizer state taken before our optimizer is known may have at most this many times the model's bytes
#: (Adam's is about 2, with amsgrad 3, plus its step counters): a bound on what an unknown donor may make us fetch.
ANY_OPTIMIZER_SHARE = 4


# -- the newcomer ------------------------------------------------------------------------


@dataclass(frozen=True)
class Wakeup:
    """Time passed; ``members`` are the live members of our view now (us included or not).

    ``latency``: the link's round trip of small messages lately (the node's
    probes), None if unknown: how soon a session's opening is acknowledged.
    """

    members: Sequence[str]
    latency: float | None = None


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
        sid, index = _sid(body), body.get("index")
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
        return cls(sender, _sid(body), reason[:_REASON_CHARS], retry)


@dataclass(frozen=True)
class Accepted:
    """An sack: the donor opened session ``sid``; its first chunk follows its next safe point.

    Sent by the donor's network side as the request arrives, so the
    newcomer learns within a round trip that its opening request was not
    lost, where the first chunk waits for a step of the donor's training.
    ``every``, the donor's time between steps lately, says when that chunk
    is due (``ANSWER_STEPS``); without it ``state.request_timeout`` bounds
    the wait. Before, a request or first chunk lost on a lossy link held a
    newcomer for the whole timeout (5 s by default).
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
        return cls(sender, _sid(body), None if every is None else float(every))


@dataclass(frozen=True)
class Unreachable:
    """A request to ``member`` could not be sent (no address, or the transport refused it)."""

    member: str
    sid: int


FetchEvent = Wakeup | Chunk | Refusal | Accepted | Unreachable


@dataclass(frozen=True)
class RequestChunk:
    """Send an sreq to member ``to`` (index ``CLOSE`` ends the session)."""

    to: str
    sid: int
    index: int
    manifest: bool = False
    optim: bool = False  # with the manifest: ask for the optimizer state too


@dataclass
class TransferStats:
    """The newcomer's counters (named for ``Peer.stats()``)."""

    state_bytes_received: int = 0  # chunk bytes verified and kept (again after a restart)
    state_chunks_received: int = 0
    state_donors_tried: int = 0  # sessions opened
    state_refusals: int = 0  # snak answers
    state_timeouts: int = 0  # sessions left after state.request_timeout without an answer
    state_opens_resent: int = 0  # opening requests sent again, not acknowledged within a few round trips
    state_checksum_failures: int = 0  # chunks or whole states that failed their SHA-256 check
    state_stale: int = 0  # answers for a session already left, or unasked for
    state_transfer_seconds: float = 0.0
    state_donor_step: int = 0  # the step of the (last) donor's snapshot

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TransferResult:
    """How a download ended: ``data`` is the verified state when ``ok``."""

    ok: bool
    reason: str  # why it failed, or "" when ok
    data: torch.Tensor | None = None
    donors: tuple[str, ...] = ()  # who supplied the chunks kept, in chunk order
    digest: str = ""  # hash list digest of the assembled chunks (the donor's digest when one donor served all)
    step: int = 0  # the last donor's step
    seconds: float = 0.0
    tensors: tuple[Entry, ...] | None = None  # what ``data`` holds (the model's state, then any optimizer state)
    samples: int = 0  # the last donor's training samples seen
    scalars: tuple[tuple[str, int | float], ...] = ()  # the last donor's non-tensor optimizer state
    optimizer: bool = False  # ``data`` holds the optimizer state after the model's
    optimizer_problem: str = ""  # why the optimizer state asked for was not downloaded
    optimizer_state: dict[str, Any] | None = None  # decoded for ``Optimizer.load_state_dict`` (catch_up fills it in)
    # The optimizer state as named tensors, downloaded while no optimizer was known (``Fetcher(any_optimizer=True)``;
    # catch_up fills it in, its scalars are ``scalars``): for the optimizer found at its first step.
    optimizer_aside: tuple[tuple[str, torch.Tensor], ...] = ()
    nothing_to_fetch: bool = False  # every donor asked said it is not training yet (a fresh swarm): nothing was needed


@dataclass
class _FetchSession:
    donor: str
    sid: int
    last_progress: float  # when we last sent it a request or it last delivered a chunk
    manifest: Manifest | None = None
    inflight: set[int] = field(default_factory=set)
    todo: list[int] = field(default_factory=list)  # chunks still to ask for, in order
    asked_at: dict[int, float] = field(default_factory=dict)  # chunk -> when we asked for it
    accepted: bool = False  # the donor acknowledged the opening request (an sack)
    every: float | None = None  # ...and said how long its steps take (its first chunk follows the next one)
    opens: int = 1  # times the opening request was sent


class Fetcher:
    """The newcomer's side: download a state of ``size`` bytes and ``layout`` from live members.

    ``optimizer``, the table of the optimizer tensors we expect (see
    ``optimizer_template``; ``tensors`` must then be the model's table), asks
    donors for their optimizer state too; a donor whose state does not fit
    turns the download into one of the parameters alone (``optimizer_problem``
    says why). ``any_optimizer`` (with ``tensors`` and no ``optimizer``): we
    have no optimizer yet, so ask for the donors' anyway and take the first
    one's table, up to ``ANY_OPTIMIZER_SHARE`` times the model's bytes (a
    donor without one makes it a download of the parameters alone).
    ``size=None`` (and no ``layout``) takes whatever state the first
    donor describes, up to ``max_bytes``: a tool without a model of its own.
    """

    def __init__(
        self,
        config: StateConfig,
        *,
        me: str,
        size: int | None,
        layout: str | None,
        rng: random.Random,
        now: float,
        tensors: tuple[Entry, ...] | None = None,
        optimizer: tuple[Entry, ...] | None = None,
        max_bytes: int = 0,
        any_optimizer: bool = False,
    ) -> None:
        if (size is None) != (layout is None) or (size is None and max_bytes <= 0) or (optimizer is not None and tensors is None):
            raise ValueError("Fetcher: size and layout go together; without them max_bytes bounds; optimizer needs tensors")
        if any_optimizer and (optimizer is not None or tensors is None or size is None):
            raise ValueError("Fetcher: any_optimizer needs our model's table and size, and no optimizer table")
        self.config = config
        self.me = me
        self.rng = rng
        self.chunk_bytes = config.chunk_bytes
        self.max_bytes = max_bytes
        self._plain = (size, layout, tensors)  # the parameters-only download (our model's state)
        self.with_optimizer = (optimizer is not None or any_optimizer) and size is not None
        self._any_optimizer = any_optimizer  # until the first manifest: its optimizer table becomes ours
        self.optimizer_problem = ""
        if self.with_optimizer and optimizer is not None:  # any_optimizer: the first donor's table, once it comes
            assert tensors is not None and size is not None
            full = tensors + optimizer
            size, layout, tensors = size + sum(entry_nbytes(e) for e in optimizer), table_layout(full), full
        self.size: int | None = size
        self.layout: str | None = layout
        self.tensors: tuple[Entry, ...] | None = tensors
        self.count = chunk_count(size or 0, config.chunk_bytes)
        self.data = torch.empty(size or 0, dtype=torch.uint8)  # (size,) the assembled state
        self.started = now
        self.stats = TransferStats()
        self._idle_donors = 0  # donors that refused because they are not training (see nothing_to_fetch)
        self.result: TransferResult | None = None
        self._kept: list[int | None] = [None] * self.count  # chunk -> sid of the session it was verified against
        self._missing = self.count
        self._manifests: dict[int, tuple[str, Manifest]] = {}  # sid -> (donor, manifest) of chunks kept
        self._session: _FetchSession | None = None
        self._members: list[str] = []
        self._tried: set[str] = set()
        self._banned: set[str] = set()  # sent bad data, or refused for good: not asked again in this download
        self._cooling: dict[str, float] = {}  # donor -> when it may be asked again
        self._next_send = now  # pacing (state.max_bytes_per_second)
        self._latency: float | None = None  # the link's round trip of small messages (Wakeup.latency)
        # Round trips of chunk answers after a session's first (which waits for the donor's safe point): a donor
        # silent for several of them is left before state.request_timeout (see _silence)
        self.rtt = RttEstimator(0.0, config.request_timeout)

    @property
    def missing(self) -> int:
        """Chunks not yet verified and kept."""
        return self._missing

    @property
    def donor(self) -> str | None:
        """The member we are downloading from now, if any."""
        return self._session.donor if self._session is not None else None

    def handle(self, event: FetchEvent, now: float) -> list[RequestChunk]:
        if self.result is not None:
            return []
        out: list[RequestChunk] = []
        if isinstance(event, Wakeup):
            self._members = sorted({m for m in event.members if m != self.me})
            self._latency = event.latency if event.latency is not None else self._latency
        elif isinstance(event, Accepted):
            self._on_accepted(event, now)
        elif isinstance(event, Chunk):
            self._on_chunk(event, now, out)
        elif isinstance(event, Refusal):
            self._on_refusal(event, now)
        elif isinstance(event, Unreachable):
            s = self._session
            if s is not None and (s.donor, s.sid) == (event.member, event.sid):
                self._leave(now, out, f"cannot reach {s.donor}", cool=True, close=False)
        if self.result is None:
            self._pump(now, out)
        return out

    def reject(self, reason: str) -> None:
        """The driver found the assembled state unusable: drop it and ban its donors; the next Wakeup fetches it again."""
        if self.result is None or not self.result.ok:
            return
        log.warning("state transfer: discarding the state from %s: %s", ", ".join(self.result.donors), reason)
        self._banned.update(self.result.donors)
        self._restart()
        self.result = None

    def wakeup(self, now: float) -> float:
        """The latest time the driver should feed a ``Wakeup``."""
        cfg = self.config
        times = [self.started + cfg.max_seconds, now + cfg.request_timeout / 4]  # notice view changes too
        s = self._session
        if s is not None:
            if s.inflight:
                times.append(s.last_progress + self._silence(s))
            if self._next_send > now:
                times.append(self._next_send)
        else:
            times += [t for t in self._cooling.values() if t > now]
        return min(times)

    # -- internals -------------------------------------------------------------------------

    def _on_chunk(self, ev: Chunk, now: float, out: list[RequestChunk]) -> None:
        s = self._session
        if s is None or (ev.sender, ev.sid) != (s.donor, s.sid) or ev.index not in s.inflight:
            self.stats.state_stale += 1
            return
        if s.manifest is None:
            if self._any_optimizer and ev.manifest is not None and (why := self._take_optimizer_table(ev.manifest)):
                self._drop_optimizer(s.donor, why)
                self._leave(now, out, "its optimizer state is not one we take")  # not banned: its parameters will do
                return
            if self.with_optimizer and ev.manifest is not None and (why := self._optimizer_misfit(ev.manifest)):
                self._drop_optimizer(s.donor, why)
                self._leave(now, out, "its optimizer state does not fit ours")  # not banned: its parameters will do
                return
            problem = self._manifest_problem(ev.manifest)
            if problem:
                self._leave(now, out, problem, ban=True)
                return
            assert ev.manifest is not None  # _manifest_problem said so otherwise
            if self.size is None:
                self._adopt(ev.manifest)
            s.manifest = ev.manifest
            self.stats.state_donor_step = s.manifest.step
            s.todo = [i for i in range(self.count) if self._kept[i] is None and i not in s.inflight]
            log.info(
                "state transfer: receiving state from %s (step %d, %d of %d chunks to go)",
                s.donor, s.manifest.step, self._missing, self.count,
            )
        elif ev.manifest is not None and ev.manifest != s.manifest:
            self._leave(now, out, "changed its manifest within a session", ban=True)
            return
        assert self.size is not None  # known, or adopted from the manifest above
        lo = ev.index * self.chunk_bytes
        expected = min(self.size, lo + self.chunk_bytes) - lo
        if ev.data.numel() != expected or sha256_hex(ev.data) != s.manifest.hashes[ev.index]:
            self.stats.state_checksum_failures += 1
            self._leave(now, out, f"chunk {ev.index} failed its SHA-256 check", ban=True)
            return
        s.inflight.discard(ev.index)
        asked = s.asked_at.pop(ev.index, None)
        if asked is not None and ev.manifest is None:  # not the first answer: no safe point of the donor's in it
            self.rtt.observe(now - asked)
        s.last_progress = now
        self.data[lo : lo + expected] = ev.data
        self._kept[ev.index] = s.sid
        self._manifests[s.sid] = (s.donor, s.manifest)
        self._missing -= 1
        self.stats.state_chunks_received += 1
        self.stats.state_bytes_received += expected
        if self._missing == 0:
            self._finish(now, out)

    def _manifest_problem(self, m: Manifest | None) -> str | None:
        if m is None:
            return "answered without the manifest it was asked for"
        if self.size is None:
            if m.tensors is None:
                return "its manifest does not list its tensors"
            if m.size > self.max_bytes:
                return f"its state has {m.size} bytes, more than the {self.max_bytes} we take"
        elif m.size != self.size or m.layout != self.layout:
            return f"its state ({m.size} bytes, layout {m.layout}) is not our model's ({self.size} bytes, layout {self.layout})"
        if m.chunk_bytes != self.chunk_bytes:
            return f"it chunks by {m.chunk_bytes} bytes, we by state.chunk_bytes={self.chunk_bytes}"
        if hash_list_digest(m.hashes) != m.digest:
            self.stats.state_checksum_failures += 1
            return "its manifest does not match its digest"
        return None

    def _optimizer_misfit(self, m: Manifest) -> str | None:
        """Why ``m`` (of a donor whose parameters fit ours) has no optimizer state we can use; None if it has."""
        if m.layout == self.layout and m.size == self.size:
            return None
        size, layout, tensors = self._plain
        if m.tensors is None:
            return "no optimizer state" if (m.size, m.layout) == (size, layout) else None
        model = tuple(e for e in m.tensors if not e[0].startswith(OPTIMIZER_PREFIX))
        if table_layout(model) != layout:
            return None  # another model altogether: _manifest_problem names it
        assert self.tensors is not None and tensors is not None
        theirs = m.tensors[len(model):]
        if not theirs:
            return "no optimizer state"
        return first_difference(self.tensors[len(tensors):], theirs)

    def _take_optimizer_table(self, m: Manifest) -> str | None:
        """``any_optimizer``'s first manifest of our model: its optimizer table becomes ours (none: the parameters
        alone); why not, when it is too large or unlisted. Another model's leaves it to ``_manifest_problem``."""
        size, layout, tensors = self._plain
        assert size is not None and tensors is not None  # any_optimizer needs them
        if (m.size, m.layout) == (size, layout):  # it has no optimizer state: the parameters alone, from here on
            self._any_optimizer = self.with_optimizer = False
            return None
        if m.tensors is None:
            self._any_optimizer = False
            return "its manifest does not list its tensors"
        model = m.tensors[: len(tensors)]
        theirs = m.tensors[len(tensors):]
        if table_layout(model) != layout or not theirs or not all(e[0].startswith(OPTIMIZER_PREFIX) for e in theirs):
            return None  # another model altogether: _manifest_problem names it (and we wait for one of ours)
        self._any_optimizer = False
        if m.size - size > ANY_OPTIMIZER_SHARE * size:
            return f"its {m.size - size} bytes are more than ANY_OPTIMIZER_SHARE={ANY_OPTIMIZER_SHARE} times the model's"
        assert self.count == chunk_count(size, self.chunk_bytes) and self._missing == self.count  # nothing kept yet
        self.size, self.layout, self.tensors = m.size, m.layout, tensors + theirs
        self.count = chunk_count(m.size, self.chunk_bytes)
        self.data = torch.empty(m.size, dtype=torch.uint8)
        self._restart()
        return None

    def _drop_optimizer(self, donor: str, why: str) -> None:
        """Download the parameters alone from now on: the optimizer state offered does not fit ours."""
        self.optimizer_problem = f"{donor}: {why}"
        log.error(
            "state transfer: the optimizer state of %s does not fit our optimizer (%s): downloading the parameters only",
            donor, why,
        )
        self.with_optimizer = False
        self.size, self.layout, self.tensors = self._plain
        self.count = chunk_count(self.size or 0, self.chunk_bytes)
        self.data = torch.empty(self.size or 0, dtype=torch.uint8)
        self._restart()

    def _adopt(self, m: Manifest) -> None:
        """Take the first donor's description of the state (a tool without a model of its own)."""
        self.size, self.layout, self.tensors = m.size, m.layout, m.tensors
        self.count = chunk_count(m.size, self.chunk_bytes)
        self.data = torch.empty(m.size, dtype=torch.uint8)
        self._restart()

    def _on_accepted(self, ev: Accepted, now: float) -> None:
        s = self._session
        if s is None or (ev.sender, ev.sid) != (s.donor, s.sid):
            self.stats.state_stale += 1
            return
        if not s.accepted:
            s.accepted, s.every = True, ev.every
            s.last_progress = now  # from here the donor's safe point is what we wait for

    def _on_refusal(self, ev: Refusal, now: float) -> None:
        s = self._session
        if s is None or (ev.sender, ev.sid) != (s.donor, s.sid):
            self.stats.state_stale += 1
            return
        self.stats.state_refusals += 1
        if ev.reason == NOT_TRAINING:
            self._idle_donors += 1
        # A busy donor is asked again after a pause; one that refused for good (not training), never.
        self._leave(now, [], f"refused: {ev.reason}", cool=ev.retry, ban=not ev.retry, close=False)

    def _leave(
        self, now: float, out: list[RequestChunk], why: str, *, cool: bool = False, ban: bool = False, close: bool = True
    ) -> None:
        """Stop using the current session's donor; the next ``_pump`` picks another."""
        s = self._session
        assert s is not None
        log.info("state transfer: leaving donor %s: %s (%d of %d chunks still missing)", s.donor, why, self._missing, self.count)
        if close:
            out.append(RequestChunk(s.donor, s.sid, CLOSE))  # frees the donor's slot if it is alive
        if ban:
            self._banned.add(s.donor)
        elif cool:
            self._cooling[s.donor] = now + self.config.busy_backoff
        self._session = None

    def _pump(self, now: float, out: list[RequestChunk]) -> None:
        cfg = self.config
        if now - self.started >= cfg.max_seconds:
            self._give_up(now, out, f"no complete state after state.max_seconds={cfg.max_seconds:g}")
            return
        s = self._session
        if s is not None and s.inflight and now >= s.last_progress + self._silence(s):  # a paced pause is not silence
            if not self._open_again(s, now, out):  # an opening presumed lost is asked again first
                self.stats.state_timeouts += 1
                self._leave(now, out, f"no answer within {self._silence(s):.3g} s (state.request_timeout="
                                      f"{cfg.request_timeout:g} s, less once its chunks come at a measured pace or "
                                      "while its opening is not acknowledged)", cool=True)
        elif s is not None and s.donor not in self._members:
            self._leave(now, out, "it left our view", cool=True)
        if self._session is None and not self._open(now, out):
            return
        s = self._session
        assert s is not None
        if s.manifest is None:
            return  # the first answer brings the manifest; then the window opens
        rate = cfg.max_bytes_per_second
        while s.todo and len(s.inflight) < cfg.window and (rate == 0 or self._next_send <= now):
            index = s.todo.pop(0)
            s.inflight.add(index)
            s.asked_at[index] = now
            s.last_progress = max(s.last_progress, now)
            out.append(RequestChunk(s.donor, s.sid, index))
            if rate:
                self._next_send = max(self._next_send, now) + self.chunk_bytes / rate

    def _silence(self, s: _FetchSession) -> float:
        """How long the donor of ``s`` may stay silent before we leave it (or, its opening, ask again).

        Until the donor acknowledges the session (``Accepted``), a few round
        trips of the link (``OPEN_LATE_ROUND_TRIPS``), where we know them,
        for all but the last of ``OPEN_ATTEMPTS`` openings. Then until its
        first answer (which waits for the donor's next safe point, a step of
        its training) that and ``ANSWER_STEPS`` of the donor's steps and the
        chunk's bytes at ``FLOOR_RATE``, where the donor said how long its
        steps take; else, and for the last opening, ``state.request_timeout``. After it,
        chunks come from the donor's network side at the link's pace, and
        silence for several of their round trips (``RttEstimator.late_after``)
        means a lost message or a donor gone: a newcomer should not sit out
        seconds of ``request_timeout`` for it.
        """
        timeout = self.config.request_timeout
        if s.manifest is None:
            if not self._may_open_again(s):
                return timeout
            assert self._latency is not None  # _may_open_again says so
            late = OPEN_LATE_ROUND_TRIPS * self._latency
            if s.accepted and s.every is not None:  # its first chunk: the donor's next step, the link, the bytes
                late += ANSWER_STEPS * s.every + min(self.chunk_bytes, self.size or self.chunk_bytes) / FLOOR_RATE
            return min(timeout, max(late, MIN_SILENCE_S))
        late = self.rtt.late_after()
        return timeout if late is None else min(timeout, max(late, MIN_SILENCE_S))

    def _open_again(self, s: _FetchSession, now: float, out: list[RequestChunk]) -> bool:
        """Send the opening request of ``s`` again (unanswered past its due), if it has tries left; whether it did.

        The same session and chunk: a donor that did get the first one
        acknowledges again, or answers again if it has the snapshot (its
        answer was lost, or is slower than ``FLOOR_RATE``: the newcomer then
        counts the second one stale).
        """
        if not self._may_open_again(s):
            return False
        s.opens += 1
        s.last_progress = now
        self.stats.state_opens_resent += 1
        first = min(s.inflight)
        log.info("state transfer: %s from %s yet: asking again (%d of %d)",
                 "no first chunk" if s.accepted else "no acknowledgement", s.donor, s.opens, OPEN_ATTEMPTS)
        out.append(RequestChunk(s.donor, s.sid, first, manifest=True, optim=self.with_optimizer))
        return True

    def _may_open_again(self, s: _FetchSession) -> bool:
        """Whether the opening of ``s`` is still unanswered and may be sent again: unacknowledged, or acknowledged
        by a donor that said how long its steps take (its first chunk may have been lost)."""
        known = not s.accepted or s.every is not None
        return s.manifest is None and known and self._latency is not None and s.opens < OPEN_ATTEMPTS

    def _open(self, now: float, out: list[RequestChunk]) -> bool:
        """Open a session with a new donor; False if we wait (donors cooling) or gave up."""
        cfg = self.config
        candidates = [m for m in self._members if m not in self._banned and self._cooling.get(m, 0.0) <= now]
        if not candidates:
            if not any(m not in self._banned for m in self._members):
                self._give_up(now, out, "no live member left to download from")
            return False  # the others are cooling down
        if self.stats.state_donors_tried >= cfg.max_donors:
            self._give_up(now, out, f"state.max_donors={cfg.max_donors} donors tried")
            return False
        fresh = [m for m in candidates if m not in self._tried]
        donor = self.rng.choice(fresh or candidates)
        self._tried.add(donor)
        self.stats.state_donors_tried += 1
        first = next(i for i, sid in enumerate(self._kept) if sid is None)
        sid = self.rng.randrange(_SID_LIMIT)
        self._session = _FetchSession(donor, sid, now, inflight={first})
        log.info("state transfer: asking %s for our state, from chunk %d of %d", donor, first, self.count)
        out.append(RequestChunk(donor, sid, first, manifest=True, optim=self.with_optimizer))
        if cfg.max_bytes_per_second:
            self._next_send = max(self._next_send, now) + self.chunk_bytes / cfg.max_bytes_per_second
        return True

    def _finish(self, now: float, out: list[RequestChunk]) -> None:
        """All chunks kept: hash the assembled bytes again against their manifests, then done."""
        s = self._session
        assert s is not None
        out.append(RequestChunk(s.donor, s.sid, CLOSE))
        self._session = None
        hashes: list[str] = []
        bad: set[str] = set()
        for i, sid in enumerate(self._kept):
            assert sid is not None
            donor, manifest = self._manifests[sid]
            h = sha256_hex(self.data[i * self.chunk_bytes : (i + 1) * self.chunk_bytes])
            if h != manifest.hashes[i]:
                bad.add(donor)
            hashes.append(h)
        sids = set(self._kept)
        digest = hash_list_digest(hashes)
        if len(sids) == 1 and digest != self._manifests[next(iter(sids))][1].digest:
            bad.add(self._manifests[next(iter(sids))][0])
        if bad:
            self.stats.state_checksum_failures += 1
            log.warning("state transfer: the assembled state failed its SHA-256 check; fetching it again")
            self._banned.update(bad)
            self._restart()
            return
        donors = tuple(dict.fromkeys(self._manifests[sid][0] for sid in self._kept))
        seconds = now - self.started
        self.stats.state_transfer_seconds = seconds
        last = s.manifest
        assert last is not None
        self.result = TransferResult(
            True, "", self.data, donors, digest, self.stats.state_donor_step, seconds, self.tensors or last.tensors,
            last.samples, last.scalars, self.with_optimizer, self.optimizer_problem,
        )

    def _restart(self) -> None:
        self._kept = [None] * self.count
        self._missing = self.count
        self._manifests.clear()

    def _give_up(self, now: float, out: list[RequestChunk], reason: str) -> None:
        if self._session is not None:
            out.append(RequestChunk(self._session.donor, self._session.sid, CLOSE))
            self._session = None
        self.stats.state_transfer_seconds = now - self.started
        idle = 0 < self.stats.state_donors_tried == self._idle_donors  # nobody had anything to give: a fresh swarm
        self.result = TransferResult(
            False, reason, seconds=now - self.started, optimizer_problem=self.optimizer_problem, nothing_to_fetch=idle
        )


# -- the donor ---------------------------------------------------------------------------


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
        return cls(sender, addr, _sid(body), index, manifest, optim)


@dataclass(frozen=True)
class SnapshotTaken:
    """The trainer copied its state for the sessions waiting since request ``serial`` (see ``Donor.wanted``).

    ``snapshot`` is the model's state; ``with_optimizer``, when the trainer
    had optimizer state to give, the model's and the optimizer's, for
    sessions that asked for it (the others get ``snapshot``).
    """

    snapshot: Snapshot
    serial: int
    with_optimizer: Snapshot | None = None


@dataclass(frozen=True)
class Expire:
    """Time passed: drop idle sessions."""


DonorEvent = ChunkRequest | SnapshotTaken | Expire


@dataclass(frozen=True)
class Reply:
    """Send an srep or snak to ``addr``."""

    addr: str
    kind: str
    body: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class DonorStats:
    """The donor's counters (named for ``Peer.stats()``)."""

    state_sessions_served: int = 0  # sessions opened for newcomers
    state_sessions_refused: int = 0
    state_sessions_expired: int = 0  # dropped after state.session_timeout idle
    state_snapshots: int = 0  # copies the trainer made for sessions
    state_chunks_sent: int = 0
    state_bytes_sent: int = 0  # chunk bytes

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _DonorSession:
    serial: int  # the snapshot request it waits for
    last_used: float
    snapshot: Snapshot | None = None
    waiting: list[ChunkRequest] = field(default_factory=list)  # requests until the snapshot is taken
    optim: bool = False  # it asked for the optimizer state too


class Donor:
    """Every member's side: serve sessions from snapshots taken at the trainer's safe points."""

    def __init__(self, config: StateConfig, limits: Limits) -> None:
        self.config = config
        self.limits = limits
        self.ready = False  # our own download is over (or there was none)
        self.stepped_at: float | None = None  # our trainer's latest safe point (written by the trainer thread)
        # ...and the time between them lately, waits included (a snapshot waits for the next one), for acknowledgements
        self.steps = StepTimer()
        self.wanted = 0  # serial of the newest snapshot a session waits for; read by the trainer thread
        self.sessions: dict[tuple[str, int], _DonorSession] = {}
        self.stats = DonorStats()

    def handle(self, event: DonorEvent, now: float) -> list[Reply]:
        out: list[Reply] = []
        self._expire(now)
        if isinstance(event, ChunkRequest):
            self._on_request(event, now, out)
        elif isinstance(event, SnapshotTaken):
            self.stats.state_snapshots += 1
            for s in self.sessions.values():
                if s.snapshot is None and s.serial <= event.serial:
                    s.snapshot = (event.with_optimizer if s.optim else None) or event.snapshot
                    for req in s.waiting:
                        out.append(self._answer(s, req))
                    s.waiting.clear()
        return out

    def _on_request(self, req: ChunkRequest, now: float, out: list[Reply]) -> None:
        key = (req.sender, req.sid)
        s = self.sessions.get(key)
        if req.index == CLOSE:
            self.sessions.pop(key, None)
            return
        if s is None:
            if not req.manifest:
                out.append(_refuse(req, "no such session (expired?)", retry=False))
            elif not self.training(now):
                # Still fetching its own state, or not stepping (no snapshot would come): nothing better than
                # the initial weights to give; the newcomer asks another member, or starts from those itself.
                out.append(_refuse(req, NOT_TRAINING, retry=False))
            elif len(self.sessions) >= self.config.donor_sessions:
                self.stats.state_sessions_refused += 1
                out.append(_refuse(req, f"busy: serving {len(self.sessions)} sessions (state.donor_sessions)", retry=True))
            else:
                self.wanted += 1
                self.sessions[key] = _DonorSession(self.wanted, now, waiting=[req], optim=req.optim)
                self.stats.state_sessions_served += 1
                out.append(_accept(req, self.steps.step_time))
            return
        s.last_used = now
        if s.snapshot is not None:
            out.append(self._answer(s, req))
        elif req.manifest and any(w.index == req.index for w in s.waiting):  # an opening asked again: ours was lost
            out.append(_accept(req, self.steps.step_time))
        elif len(s.waiting) < self.config.window:
            s.waiting.append(req)
        else:
            out.append(_refuse(req, "more requests in flight than state.window", retry=False))

    def stepped(self, step: int, now: float) -> None:
        """Our trainer reached the safe point after ``step`` (called on the trainer thread; plain floats, no lock needed)."""
        self.steps.at_step(step, now, 0.0)
        self.stepped_at = now

    def training(self, now: float) -> bool:
        """Whether a session would get a snapshot soon: our trainer reached a safe point lately."""
        return self.ready and self.stepped_at is not None and now - self.stepped_at <= self.config.request_timeout

    def needs(self, serial: int) -> tuple[bool, bool]:
        """Which snapshots the sessions a copy for ``serial`` serves want: (the model's state, with the optimizer's)."""
        waiting = [s.optim for s in self.sessions.values() if s.snapshot is None and s.serial <= serial]
        return (not all(waiting), any(waiting))

    def _answer(self, s: _DonorSession, req: ChunkRequest) -> Reply:
        snap = s.snapshot
        assert snap is not None
        m = snap.manifest
        if not 0 <= req.index < len(m.hashes):
            return _refuse(req, f"no chunk {req.index}: the state has {len(m.hashes)}", retry=False)
        body: dict[str, Any] = {"sid": req.sid, "index": req.index}
        if req.manifest:
            if m.entries() > self.limits.max_container_len or m.header_bytes() > self.limits.max_header_bytes:
                return _refuse(
                    req, f"{len(m.hashes)} chunks and {len(m.tensors or ())} tensors do not fit one manifest: "
                    "raise state.chunk_bytes", retry=False,
                )
            body.update(m.to_body())
        data = snap.chunk(req.index)
        self.stats.state_chunks_sent += 1
        self.stats.state_bytes_sent += data.numel()
        return Reply(req.addr, SREP, body, {"chunk": data})

    def _expire(self, now: float) -> None:
        timeout = self.config.session_timeout
        for key in [k for k, s in self.sessions.items() if now - s.last_used > timeout]:
            del self.sessions[key]
            self.stats.state_sessions_expired += 1


#: A donor's refusal when it has not trained yet (or not lately): nothing worth downloading from it.
NOT_TRAINING = "not training: no state worth giving"


def _accept(req: ChunkRequest, every: float | None) -> Reply:
    body: dict[str, Any] = {"sid": req.sid}
    if every is not None:
        body["every"] = round(every, 6)
    return Reply(req.addr, SACK, body)


def _refuse(req: ChunkRequest, reason: str, *, retry: bool) -> Reply:
    return Reply(req.addr, SNAK, {"sid": req.sid, "reason": reason, "retry": retry})


def _sid(body: Mapping[str, Any]) -> int:
    sid = body.get("sid")
    if type(sid) is not int or not 0 <= sid < _SID_LIMIT:
        raise ProtocolError("state transfer sid must be an int in [0, 2**31)")
    return sid
