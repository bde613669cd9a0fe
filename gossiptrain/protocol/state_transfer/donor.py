"""The donor: every member serves newcomers' downloads from snapshots of its state.

A member acknowledges a new session at once, and answers it from one
snapshot taken at the trainer's next safe point (the only place the
parameters may be read), so the newcomer gets a consistent model and the
donor's training waits only for one copy of its state; everything else
(hashing, answering) happens on the network side. It serves at most
``state.donor_sessions`` sessions at a time and refuses more at once, so
that newcomers spread over donors, and drops a session's snapshot after
``state.session_timeout`` idle seconds. Only a member that is training (its
trainer reached a safe point within ``state.request_timeout``, its own
download over) opens sessions: any other has nothing better than the
initial weights to give.

A session that asks for the optimizer state too (``optim`` in its opening
request) is answered from a snapshot that appends the optimizer's tensors
(SGD momentum, Adam's moments and step) to the same stream, named
``optimizer/<parameter>/<key>``, with any non-tensor state as scalars in
the manifest; the driver takes that copy only while such a session waits
(``Donor.needs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gossiptrain.config import Limits, StateConfig
from gossiptrain.net.kinds import SACK, SNAK, SREP
from gossiptrain.protocol.state_transfer.messages import CLOSE, NOT_TRAINING, ChunkRequest, Reply
from gossiptrain.protocol.step_timer import StepTimer
from gossiptrain.state.snapshot import Snapshot


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


def _accept(req: ChunkRequest, every: float | None) -> Reply:
    """The sack for ``req``: with our time between steps, so the newcomer knows when our first chunk is due."""
    body: dict[str, Any] = {"sid": req.sid}
    if every is not None:
        body["every"] = round(every, 6)
    return Reply(req.addr, SACK, body)


def _refuse(req: ChunkRequest, reason: str, *, retry: bool) -> Reply:
    """The snak for ``req``; ``retry`` tells a busy refusal (ask again later) from a final one."""
    return Reply(req.addr, SNAK, {"sid": req.sid, "reason": reason, "retry": retry})
