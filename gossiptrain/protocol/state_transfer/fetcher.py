"""The newcomer: downloads its state, chunk by chunk, from live members of its view.

It picks a donor at random among the live members of its view (untried
ones first), opens a session and asks for the chunks of the donor's
flattened state (parameters and buffers, in ``state_dict`` order,
``state.chunk_bytes`` each), ``state.window`` requests in flight; a
newcomer that has its optimizer at hand asks for its state too (``optim``
in the request opening a session). An opening the donor does not
acknowledge (``Accepted``) within a few of the link's round trips, or whose
first chunk is later than the donor's steps, the link and its bytes make
due, is sent again, twice at most (the last waits
``state.request_timeout``). A donor that stops answering
(``state.request_timeout``), refuses, or leaves the view is replaced and
the download resumes from the chunks already verified; a donor whose data
fails a check is not asked again; a state that fails the final check (or
holds non-finite values: the driver's ``Fetcher.reject``) is discarded and
fetched again from another donor. After ``state.max_donors`` sessions or
``state.max_seconds`` the newcomer gives up and trains from its own initial
weights.

The ``Fetcher`` owns the sessions: whom to ask, when, how many requests in
flight, and when silence means a lost message or a donor gone. What it
downloads, and whether a manifest, a chunk or the assembled state will do,
is its ``Assembly``'s (``assembly``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from gossiptrain.config import StateConfig
from gossiptrain.protocol.rtt import RttEstimator
from gossiptrain.protocol.state_transfer import TransferResult
from gossiptrain.protocol.state_transfer.assembly import Assembly
from gossiptrain.protocol.state_transfer.messages import (
    CLOSE,
    NOT_TRAINING,
    SID_LIMIT,
    Accepted,
    Chunk,
    Refusal,
    RequestChunk,
)
from gossiptrain.state.snapshot import Entry, Manifest

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Wakeup:
    """Time passed; ``members`` are the live members of our view now (us included or not).

    ``latency``: the link's round trip of small messages lately (the node's
    probes), None if unknown: how soon a session's opening is acknowledged.
    """

    members: Sequence[str]
    latency: float | None = None


@dataclass(frozen=True)
class Unreachable:
    """A request to ``member`` could not be sent (no address, or the transport refused it)."""

    member: str
    sid: int


FetchEvent = Wakeup | Chunk | Refusal | Accepted | Unreachable


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
    turns the download into one of the parameters alone (the result's
    ``optimizer_problem`` says why). ``any_optimizer`` (with ``tensors`` and
    no ``optimizer``): we have no optimizer yet, so ask for the donors'
    anyway and take the first one's table, up to
    ``assembly.ANY_OPTIMIZER_SHARE`` times the model's bytes (a donor without
    one makes it a download of the parameters alone). ``size=None`` (and no
    ``layout``) takes whatever state the first donor describes, up to
    ``max_bytes``: a tool without a model of its own.
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
        # What we download and the chunks of it verified so far (with optimizer_problem: why not the optimizer's)
        self.assembly = Assembly(
            config.chunk_bytes, size=size, layout=layout, tensors=tensors, optimizer=optimizer, max_bytes=max_bytes,
            any_optimizer=any_optimizer,
        )
        self.started = now
        self.stats = TransferStats()
        self._idle_donors = 0  # donors that refused because they are not training (see nothing_to_fetch)
        self.result: TransferResult | None = None
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
        return self.assembly.missing

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
        self.assembly.restart()
        self.result = None

    def abandon(self, now: float, reason: str) -> list[RequestChunk]:
        """Stop the download here (the newcomer is leaving): what frees the current donor's session, if any."""
        out: list[RequestChunk] = []
        if self.result is None:
            self._give_up(now, out, reason)
        return out

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
        target = self.assembly
        if s.manifest is None:
            misfit = target.take_manifest(s.donor, ev.manifest)
            if misfit is not None:
                if misfit.corrupt:
                    self.stats.state_checksum_failures += 1
                self._leave(now, out, misfit.why, ban=misfit.ban)
                return
            assert ev.manifest is not None  # take_manifest said so otherwise
            s.manifest = ev.manifest
            self.stats.state_donor_step = s.manifest.step
            s.todo = target.to_ask(s.inflight)
            log.info(
                "state transfer: receiving state from %s (step %d, %d of %d chunks to go)",
                s.donor, s.manifest.step, target.missing, target.count,
            )
        elif ev.manifest is not None and ev.manifest != s.manifest:
            self._leave(now, out, "changed its manifest within a session", ban=True)
            return
        if not target.keep(ev.index, ev.data, s.sid, s.donor, s.manifest):
            self.stats.state_checksum_failures += 1
            self._leave(now, out, f"chunk {ev.index} failed its SHA-256 check", ban=True)
            return
        s.inflight.discard(ev.index)
        asked = s.asked_at.pop(ev.index, None)
        if asked is not None and ev.manifest is None:  # not the first answer: no safe point of the donor's in it
            self.rtt.observe(now - asked)
        s.last_progress = now
        self.stats.state_chunks_received += 1
        self.stats.state_bytes_received += ev.data.numel()  # the chunk's expected size: keep checked it
        if target.missing == 0:
            self._finish(now, out)

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
        log.info(
            "state transfer: leaving donor %s: %s (%d of %d chunks still missing)",
            s.donor, why, self.assembly.missing, self.assembly.count,
        )
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
                late += ANSWER_STEPS * s.every + min(self.chunk_bytes, self.assembly.size or self.chunk_bytes) / FLOOR_RATE
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
        out.append(RequestChunk(s.donor, s.sid, first, manifest=True, optim=self.assembly.with_optimizer))
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
        first = self.assembly.first_missing()
        sid = self.rng.randrange(SID_LIMIT)
        self._session = _FetchSession(donor, sid, now, inflight={first})
        log.info("state transfer: asking %s for our state, from chunk %d of %d", donor, first, self.assembly.count)
        out.append(RequestChunk(donor, sid, first, manifest=True, optim=self.assembly.with_optimizer))
        if cfg.max_bytes_per_second:
            self._next_send = max(self._next_send, now) + self.chunk_bytes / cfg.max_bytes_per_second
        return True

    def _finish(self, now: float, out: list[RequestChunk]) -> None:
        """All chunks kept: hash the assembled bytes again against their manifests, then done."""
        s = self._session
        assert s is not None
        out.append(RequestChunk(s.donor, s.sid, CLOSE))
        self._session = None
        target = self.assembly
        digest, bad = target.verify()
        if bad:
            self.stats.state_checksum_failures += 1
            log.warning("state transfer: the assembled state failed its SHA-256 check; fetching it again")
            self._banned.update(bad)
            target.restart()
            return
        seconds = now - self.started
        self.stats.state_transfer_seconds = seconds
        last = s.manifest
        assert last is not None
        self.result = TransferResult(
            True, "", target.data, target.donors(), digest, self.stats.state_donor_step, seconds,
            target.tensors or last.tensors, last.samples, last.scalars, target.with_optimizer, target.optimizer_problem,
        )

    def _give_up(self, now: float, out: list[RequestChunk], reason: str) -> None:
        if self._session is not None:
            out.append(RequestChunk(self._session.donor, self._session.sid, CLOSE))
            self._session = None
        self.stats.state_transfer_seconds = now - self.started
        idle = 0 < self.stats.state_donors_tried == self._idle_donors  # nobody had anything to give: a fresh swarm
        self.result = TransferResult(
            False, reason, seconds=now - self.started, optimizer_problem=self.assembly.optimizer_problem,
            nothing_to_fetch=idle,
        )
