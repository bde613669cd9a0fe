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
  manifests. A donor that stops answering (``state.request_timeout``),
  refuses, or leaves the view is replaced and the download resumes from the
  chunks already verified; a donor whose data fails a check is not asked
  again; a state that fails the final check (or holds non-finite values) is
  discarded and fetched again from another donor. After ``state.max_donors``
  sessions or ``state.max_seconds`` the newcomer gives up and trains from its
  own initial weights.
- ``Donor``, every member: answers a session from one snapshot taken at the
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

Wire (all bodies checked; tensors are raw uint8 bytes, nothing executable):

- ``sreq`` {sid, index, manifest}: newcomer -> donor, "send chunk ``index`` of
  session ``sid``" (a new sid opens a session and must ask for the
  manifest); index -1 ends the session.
- ``srep`` {sid, index[, size, chunk_bytes, layout, step, hashes, digest]} +
  tensor ``chunk``: the chunk, with the manifest when it was asked for.
- ``snak`` {sid, reason, retry}: refused; ``retry`` says the donor may take
  a session later (busy), otherwise it will not (not training, or a bad
  request).

``StateEndpoint`` is the glue ``PeerNode`` uses, in a real process and in the
simulator: it answers ``sreq`` as a donor, routes ``srep``/``snak`` to a
running download, and ``download`` drives a ``Fetcher`` on the node's loop.
``SnapshotHook`` runs at the trainer's safe point and hands the node a copy
of the state when a session waits for one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from .clock import Clock
from .config import Limits, RunConfig, StateConfig
from .errors import GossipError, ProtocolError
from .wire import Message

log = logging.getLogger(__name__)

SREQ, SREP, SNAK = "sreq", "srep", "snak"
KINDS = (SREQ, SREP, SNAK)
CLOSE = -1  # the chunk index of an sreq that ends its session

_SID_LIMIT = 1 << 31
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MANIFEST_KEYS = ("size", "chunk_bytes", "layout", "step", "hashes", "digest")
_HASH_WIRE_BYTES = 67  # one hex SHA-256 in a msgpack header (str8 marker, length, 64 characters), rounded up
_REASON_CHARS = 200  # a refusal's reason is cut to this for logs


# -- the state as bytes ------------------------------------------------------------------


def state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a newcomer downloads: the model's parameters and persistent buffers, in ``state_dict`` order.

    Buffers too (e.g. batch-norm statistics): a model with a trained body but
    initial statistics evaluates badly.
    """
    return list(model.state_dict(keep_vars=True).values())


def layout_of(model: torch.nn.Module) -> str:
    """A short hash of the state's names, dtypes and shapes: donor and newcomer must agree on it."""
    entries = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in model.state_dict(keep_vars=True).items()]
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()[:16]


def state_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of ``tensors``' bytes, (total bytes,) uint8: the snapshot a donor serves."""
    parts = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors if t.numel()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def decode_state(like: Sequence[torch.Tensor], data: torch.Tensor) -> list[torch.Tensor] | str:
    """``data`` cut into tensors shaped as ``like``, or why it cannot be used (wrong size, non-finite values)."""
    if data.numel() != state_nbytes(like):
        return f"the state has {data.numel()} bytes, the model {state_nbytes(like)}"
    out: list[torch.Tensor] = []
    offset = 0
    for t in like:
        n = t.numel() * t.element_size()
        value = data[offset : offset + n].clone().view(t.dtype).reshape(t.shape)  # clone: aligned for the dtype
        if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
            return "the state holds non-finite values"
        if value.dtype == torch.bool and bool((value.view(torch.uint8) > 1).any()):
            return "the state holds bool bytes other than 0 and 1"  # undefined behaviour in torch kernels
        out.append(value)
        offset += n
    return out


def install(live: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """Write decoded values into the live tensors in place (an optimizer keeps its references)."""
    with torch.no_grad():
        for t, v in zip(live, values, strict=True):
            t.copy_(v)


def chunk_count(size: int, chunk_bytes: int) -> int:
    return max(1, -(-size // chunk_bytes))


def _sha256(data: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(data.numpy())).hexdigest()


def hash_list_digest(hashes: Sequence[str]) -> str:
    """The SHA-256 over the chunk hashes in order: identifies the whole snapshot."""
    return hashlib.sha256("".join(hashes).encode("ascii")).hexdigest()


# -- manifest and snapshot ---------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What a donor says about the snapshot a session is served from."""

    size: int  # bytes
    chunk_bytes: int
    layout: str  # layout_of(model)
    step: int  # the donor's step when it took the snapshot
    hashes: tuple[str, ...]  # SHA-256 of each chunk, hex
    digest: str  # hash_list_digest(hashes)

    def to_body(self) -> dict[str, Any]:
        return {
            "size": self.size, "chunk_bytes": self.chunk_bytes, "layout": self.layout, "step": self.step,
            "hashes": list(self.hashes), "digest": self.digest,
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "Manifest":
        """The manifest in an srep body; ProtocolError if any field is malformed."""
        size, chunk, layout, step, hashes, digest = (body.get(k) for k in _MANIFEST_KEYS)
        if type(size) is not int or size < 0 or type(chunk) is not int or chunk < 1:
            raise ProtocolError("state manifest size and chunk_bytes must be ints >= 0 and >= 1")
        if not isinstance(layout, str) or len(layout) > 64 or type(step) is not int or step < 0:
            raise ProtocolError("state manifest layout must be a short str and step an int >= 0")
        if not isinstance(hashes, list) or len(hashes) != chunk_count(size, chunk):
            raise ProtocolError("state manifest must list one hash per chunk")
        if not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in hashes):
            raise ProtocolError("state manifest hashes must be hex SHA-256 digests")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ProtocolError("state manifest digest must be a hex SHA-256 digest")
        return cls(size, chunk, layout, step, tuple(hashes), digest)


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A donor's state at one safe point, never written after it was taken, with its manifest."""

    data: torch.Tensor  # (size,) uint8
    manifest: Manifest

    @classmethod
    def build(cls, data: torch.Tensor, *, step: int, layout: str, chunk_bytes: int) -> "Snapshot":
        """Hash ``data`` chunk by chunk (one pass; hashlib releases the GIL, so this may run in a worker thread)."""
        view = memoryview(data.numpy())
        size = data.numel()
        hashes = tuple(
            hashlib.sha256(view[i * chunk_bytes : (i + 1) * chunk_bytes]).hexdigest()
            for i in range(chunk_count(size, chunk_bytes))
        )
        return cls(data, Manifest(size, chunk_bytes, layout, step, hashes, hash_list_digest(hashes)))

    def chunk(self, index: int) -> torch.Tensor:
        c = self.manifest.chunk_bytes
        return self.data[index * c : (index + 1) * c]


# -- the newcomer ------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """Time passed; ``members`` are the live members of our view now (us included or not)."""

    members: Sequence[str]


@dataclass(frozen=True)
class Chunk:
    """An srep: chunk ``index`` of session ``sid``, with the manifest if it was asked for."""

    sender: str
    sid: int
    index: int
    data: torch.Tensor  # (n,) uint8
    manifest: Manifest | None = None

    @classmethod
    def from_message(cls, msg: Message) -> "Chunk":
        sid, index = _sid(msg.body), msg.body.get("index")
        if type(index) is not int or index < 0:
            raise ProtocolError("srep index must be an int >= 0")
        data = msg.tensors.get("chunk")
        if len(msg.tensors) != 1 or data is None or data.dtype != torch.uint8 or data.dim() != 1:
            raise ProtocolError("srep must carry exactly one 1-d uint8 tensor named chunk")
        manifest = Manifest.from_body(msg.body) if "hashes" in msg.body else None
        return cls(msg.sender, sid, index, data, manifest)


@dataclass(frozen=True)
class Refusal:
    """An snak: the donor will not serve session ``sid``; ``retry``: it may later (busy, not ready)."""

    sender: str
    sid: int
    reason: str
    retry: bool

    @classmethod
    def from_message(cls, msg: Message) -> "Refusal":
        reason, retry = msg.body.get("reason"), msg.body.get("retry")
        if not isinstance(reason, str) or type(retry) is not bool:
            raise ProtocolError("snak needs a str reason and a bool retry")
        return cls(msg.sender, _sid(msg.body), reason[:_REASON_CHARS], retry)


@dataclass(frozen=True)
class Unreachable:
    """A request to ``member`` could not be sent (no address, or the transport refused it)."""

    member: str
    sid: int


FetchEvent = Tick | Chunk | Refusal | Unreachable


@dataclass(frozen=True)
class RequestChunk:
    """Send an sreq to member ``to`` (index ``CLOSE`` ends the session)."""

    to: str
    sid: int
    index: int
    manifest: bool = False


@dataclass
class TransferStats:
    """The newcomer's counters (named for ``Peer.stats()``)."""

    state_bytes_received: int = 0  # chunk bytes verified and kept (again after a restart)
    state_chunks_received: int = 0
    state_donors_tried: int = 0  # sessions opened
    state_refusals: int = 0  # snak answers
    state_timeouts: int = 0  # sessions left after state.request_timeout without an answer
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


@dataclass
class _FetchSession:
    donor: str
    sid: int
    last_progress: float  # when we last sent it a request or it last delivered a chunk
    manifest: Manifest | None = None
    inflight: set[int] = field(default_factory=set)
    todo: list[int] = field(default_factory=list)  # chunks still to ask for, in order


class Fetcher:
    """The newcomer's side: download a state of ``size`` bytes and ``layout`` from live members."""

    def __init__(
        self, config: StateConfig, *, me: str, size: int, layout: str, rng: random.Random, now: float
    ) -> None:
        self.config = config
        self.me = me
        self.size = size
        self.layout = layout
        self.rng = rng
        self.chunk_bytes = config.chunk_bytes
        self.count = chunk_count(size, config.chunk_bytes)
        self.data = torch.empty(size, dtype=torch.uint8)  # (size,) the assembled state
        self.started = now
        self.stats = TransferStats()
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
        if isinstance(event, Tick):
            self._members = sorted({m for m in event.members if m != self.me})
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
        """The driver found the assembled state unusable: drop it and ban its donors; the next Tick fetches it again."""
        if self.result is None or not self.result.ok:
            return
        log.warning("state transfer: discarding the state from %s: %s", ", ".join(self.result.donors), reason)
        self._banned.update(self.result.donors)
        self._restart()
        self.result = None

    def wakeup(self, now: float) -> float:
        """The latest time the driver should feed a ``Tick``."""
        cfg = self.config
        times = [self.started + cfg.max_seconds, now + cfg.request_timeout / 4]  # notice view changes too
        s = self._session
        if s is not None:
            if s.inflight:
                times.append(s.last_progress + cfg.request_timeout)
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
            problem = self._manifest_problem(ev.manifest)
            if problem:
                self._leave(now, out, problem, ban=True)
                return
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
        lo = ev.index * self.chunk_bytes
        expected = min(self.size, lo + self.chunk_bytes) - lo
        if ev.data.numel() != expected or _sha256(ev.data) != s.manifest.hashes[ev.index]:
            self.stats.state_checksum_failures += 1
            self._leave(now, out, f"chunk {ev.index} failed its SHA-256 check", ban=True)
            return
        s.inflight.discard(ev.index)
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
        if m.size != self.size or m.layout != self.layout:
            return f"its state ({m.size} bytes, layout {m.layout}) is not our model's ({self.size} bytes, layout {self.layout})"
        if m.chunk_bytes != self.chunk_bytes:
            return f"it chunks by {m.chunk_bytes} bytes, we by state.chunk_bytes={self.chunk_bytes}"
        if hash_list_digest(m.hashes) != m.digest:
            self.stats.state_checksum_failures += 1
            return "its manifest does not match its digest"
        return None

    def _on_refusal(self, ev: Refusal, now: float) -> None:
        s = self._session
        if s is None or (ev.sender, ev.sid) != (s.donor, s.sid):
            self.stats.state_stale += 1
            return
        self.stats.state_refusals += 1
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
        if s is not None and s.inflight and now >= s.last_progress + cfg.request_timeout:  # a paced pause is not silence
            self.stats.state_timeouts += 1
            self._leave(now, out, f"no answer within state.request_timeout={cfg.request_timeout:g} s", cool=True)
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
            s.last_progress = max(s.last_progress, now)
            out.append(RequestChunk(s.donor, s.sid, index))
            if rate:
                self._next_send = max(self._next_send, now) + self.chunk_bytes / rate

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
        out.append(RequestChunk(donor, sid, first, manifest=True))
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
            h = _sha256(self.data[i * self.chunk_bytes : (i + 1) * self.chunk_bytes])
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
        self.result = TransferResult(True, "", self.data, donors, digest, self.stats.state_donor_step, seconds)

    def _restart(self) -> None:
        self._kept = [None] * self.count
        self._missing = self.count
        self._manifests.clear()

    def _give_up(self, now: float, out: list[RequestChunk], reason: str) -> None:
        if self._session is not None:
            out.append(RequestChunk(self._session.donor, self._session.sid, CLOSE))
            self._session = None
        self.stats.state_transfer_seconds = now - self.started
        self.result = TransferResult(False, reason, seconds=now - self.started)


# -- the donor ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkRequest:
    """An sreq from ``sender``, answered at ``addr``."""

    sender: str
    addr: str
    sid: int
    index: int
    manifest: bool

    @classmethod
    def from_message(cls, msg: Message) -> "ChunkRequest":
        index, manifest = msg.body.get("index"), msg.body.get("manifest")
        if type(index) is not int or index < CLOSE or type(manifest) is not bool:
            raise ProtocolError("sreq needs an int index >= -1 and a bool manifest")
        return cls(msg.sender, msg.addr, _sid(msg.body), index, manifest)


@dataclass(frozen=True)
class SnapshotTaken:
    """The trainer copied its state for the sessions waiting since request ``serial`` (see ``Donor.wanted``)."""

    snapshot: Snapshot
    serial: int


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


class Donor:
    """Every member's side: serve sessions from snapshots taken at the trainer's safe points."""

    def __init__(self, config: StateConfig, limits: Limits) -> None:
        self.config = config
        self.limits = limits
        self.ready = False  # our own download is over (or there was none)
        self.stepped_at: float | None = None  # our trainer's latest safe point (written by the trainer thread)
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
                    s.snapshot = event.snapshot
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
                out.append(_refuse(req, "not training: no state worth giving", retry=False))
            elif len(self.sessions) >= self.config.donor_sessions:
                self.stats.state_sessions_refused += 1
                out.append(_refuse(req, f"busy: serving {len(self.sessions)} sessions (state.donor_sessions)", retry=True))
            else:
                self.wanted += 1
                self.sessions[key] = _DonorSession(self.wanted, now, waiting=[req])
                self.stats.state_sessions_served += 1
            return
        s.last_used = now
        if s.snapshot is not None:
            out.append(self._answer(s, req))
        elif len(s.waiting) < self.config.window:
            s.waiting.append(req)
        else:
            out.append(_refuse(req, "more requests in flight than state.window", retry=False))

    def training(self, now: float) -> bool:
        """Whether a session would get a snapshot soon: our trainer reached a safe point lately."""
        return self.ready and self.stepped_at is not None and now - self.stepped_at <= self.config.request_timeout

    def _answer(self, s: _DonorSession, req: ChunkRequest) -> Reply:
        snap = s.snapshot
        assert snap is not None
        m = snap.manifest
        if not 0 <= req.index < len(m.hashes):
            return _refuse(req, f"no chunk {req.index}: the state has {len(m.hashes)}", retry=False)
        body: dict[str, Any] = {"sid": req.sid, "index": req.index}
        if req.manifest:
            header = len(m.hashes) * _HASH_WIRE_BYTES + 4096  # the hashes and the rest of the header, generously
            if len(m.hashes) > self.limits.max_container_len or header > self.limits.max_header_bytes:
                return _refuse(req, f"{len(m.hashes)} chunks do not fit one manifest: raise state.chunk_bytes", retry=False)
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


def _refuse(req: ChunkRequest, reason: str, *, retry: bool) -> Reply:
    return Reply(req.addr, SNAK, {"sid": req.sid, "reason": reason, "retry": retry})


def _sid(body: Mapping[str, Any]) -> int:
    sid = body.get("sid")
    if type(sid) is not int or not 0 <= sid < _SID_LIMIT:
        raise ProtocolError("state transfer sid must be an int in [0, 2**31)")
    return sid


# -- drivers -----------------------------------------------------------------------------


class StateEndpoint:
    """``PeerNode``'s side of state transfer, on the node's event loop.

    ``send(addr, kind, body, tensors) -> bool`` and ``address_of(member)`` are
    the node's. ``offload`` hashes snapshots in a worker thread (a real peer:
    neither its training nor its network side waits for the hashing); the
    simulator hashes inline, which keeps its runs deterministic.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        send: Callable[[str, str, dict[str, Any], dict[str, torch.Tensor]], bool],
        address_of: Callable[[str], str | None],
        clock: Clock,
    ) -> None:
        self.config = config.state
        self.donor = Donor(config.state, config.limits)
        self.transfer = TransferStats()
        self.offload = False
        self.fetcher: Fetcher | None = None  # the download running now, if any
        self._send = send
        self._address_of = address_of
        self._clock = clock
        self._inbox: asyncio.Queue[FetchEvent] | None = None
        self._snapshots: asyncio.Queue[tuple[torch.Tensor, int, str, int]] = asyncio.Queue(maxsize=1)

    def stats(self) -> dict[str, Any]:
        return {**self.transfer.to_dict(), **self.donor.stats.to_dict()}

    def mark_ready(self) -> None:
        """Our state is worth giving from now on (after our own download, or when there was none)."""
        self.donor.ready = True

    # -- messages (the node's receive loop) --------------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Handle an sreq, srep or snak; ProtocolError if it is malformed."""
        if msg.kind == SREQ:
            req = ChunkRequest.from_message(msg)
            # Answer a member at the address our membership knows (as exchanges do), a stranger where it says.
            req = replace(req, addr=self._address_of(req.sender) or req.addr)
            self._execute(self.donor.handle(req, self._clock.now()))
            return
        inbox = self._inbox
        if inbox is None:  # no download running: not even worth parsing (a manifest may list 65,536 hashes)
            self.transfer.state_stale += 1
            return
        event: FetchEvent = Chunk.from_message(msg) if msg.kind == SREP else Refusal.from_message(msg)
        try:
            inbox.put_nowait(event)
        except asyncio.QueueFull:  # the download is behind: it asks again or moves on after its timeout
            self.transfer.state_stale += 1

    def tick(self, now: float) -> None:
        """Expire idle donor sessions (the node's heartbeat calls this)."""
        self._execute(self.donor.handle(Expire(), now))

    def _execute(self, replies: list[Reply]) -> None:
        for r in replies:
            self._send(r.addr, r.kind, r.body, r.tensors)

    # -- snapshots (taken on the trainer thread, see SnapshotHook) ---------------------------

    def offer_snapshot(self, data: torch.Tensor, step: int, layout: str, serial: int) -> None:
        """A copy of the state for sessions waiting since ``serial`` (call on the node's loop)."""
        if not self.offload:
            self._snapshot_taken(Snapshot.build(data, step=step, layout=layout, chunk_bytes=self.config.chunk_bytes), serial)
            return
        if self._snapshots.full():  # a newer copy replaces one not yet hashed: it serves the same sessions and more
            self._snapshots.get_nowait()
        self._snapshots.put_nowait((data, step, layout, serial))

    async def run(self) -> None:
        """Hash offloaded snapshots in a worker thread (a background task of the node)."""
        while True:
            data, step, layout, serial = await self._snapshots.get()
            snap = await asyncio.to_thread(Snapshot.build, data, step=step, layout=layout, chunk_bytes=self.config.chunk_bytes)
            self._snapshot_taken(snap, serial)

    def _snapshot_taken(self, snap: Snapshot, serial: int) -> None:
        self._execute(self.donor.handle(SnapshotTaken(snap, serial), self._clock.now()))

    # -- downloading -------------------------------------------------------------------------

    async def download(self, fetcher: Fetcher, members: Callable[[], Sequence[str]]) -> TransferResult:
        """Drive ``fetcher`` until it has the state or gives up; one download at a time."""
        if self._inbox is not None:
            raise GossipError("a state download is already running")
        inbox = self._inbox = asyncio.Queue(maxsize=4 * self.config.window + 4)
        self.transfer = fetcher.stats
        self.fetcher = fetcher
        clock = self._clock
        try:
            events: list[FetchEvent] = [Tick(members())]
            while True:
                while events:
                    for req in fetcher.handle(events.pop(0), clock.now()):
                        if not self._request(req) and req.index != CLOSE:
                            events.append(Unreachable(req.to, req.sid))
                if fetcher.result is not None:
                    return fetcher.result
                now = clock.now()
                if not inbox.empty():
                    events.append(inbox.get_nowait())
                    continue
                try:
                    events.append(await asyncio.wait_for(inbox.get(), timeout=max(0.0, fetcher.wakeup(now) - now)))
                except TimeoutError:
                    events.append(Tick(members()))
        finally:
            self._inbox = None
            self.fetcher = None

    def _request(self, req: RequestChunk) -> bool:
        addr = self._address_of(req.to)
        body = {"sid": req.sid, "index": req.index, "manifest": req.manifest}
        return addr is not None and self._send(addr, SREQ, body, {})


async def catch_up(
    endpoint: StateEndpoint,
    model: torch.nn.Module,
    *,
    me: str,
    members: Callable[[], Sequence[str]],
    rng: random.Random,
    clock: Clock,
) -> tuple[TransferResult, list[torch.Tensor] | None]:
    """Download a live member's state for ``model``: the result and the decoded tensors (None if it failed).

    Runs on the node's loop; the caller installs the tensors (``install``) on
    its training thread. A state that cannot be used (non-finite values) is
    fetched again from other donors, within the same bounds.
    """
    live = state_tensors(model)
    fetcher = Fetcher(endpoint.config, me=me, size=state_nbytes(live), layout=layout_of(model), rng=rng, now=clock.now())
    while True:
        result = await endpoint.download(fetcher, members)
        if not result.ok:
            s = fetcher.stats
            # Refused by everyone (a swarm starting: nobody trains yet) is normal; losing donors is worth a warning.
            only_refused = s.state_chunks_received == s.state_timeouts == s.state_checksum_failures == 0
            level = logging.INFO if only_refused else logging.WARNING
            log.log(level, "no state downloaded (%s): training from our own initial weights", result.reason)
            return result, None
        assert result.data is not None
        decoded = decode_state(live, result.data)
        if isinstance(decoded, list):
            log.info(
                "state transfer: %d bytes from %s in %.3f s (donor step %d, digest %s)",
                result.data.numel(), ", ".join(result.donors), result.seconds, result.step, result.digest[:16],
            )
            return result, decoded
        fetcher.reject(decoded)  # the next download() picks up with other donors


class SnapshotHook:
    """Runs at the trainer's safe point: copies the state when a donor session waits for a snapshot.

    The copy (one memcpy of the state) is all the trainer pays; ``submit``
    hands it to the node's loop (``StateEndpoint.offer_snapshot``), where it
    is hashed and served. ``Donor.wanted`` is written by the loop and read
    here; ``_served`` only here, so no lock is needed.
    """

    def __init__(
        self,
        endpoint: StateEndpoint,
        model: torch.nn.Module,
        submit: Callable[[torch.Tensor, int, str, int], None],
        clock: Clock,
    ) -> None:
        self.endpoint = endpoint
        self.clock = clock
        self.tensors = state_tensors(model)
        self.layout = layout_of(model)
        self.submit = submit
        self._served = 0

    def __call__(self, step: int) -> None:
        donor = self.endpoint.donor
        donor.stepped_at = self.clock.now()
        wanted = donor.wanted
        if wanted == self._served:
            return
        self._served = wanted
        self.submit(flatten(self.tensors), step, self.layout, wanted)
