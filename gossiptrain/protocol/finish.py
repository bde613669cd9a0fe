"""The end of a run: stop requests, final-phase notices, and read-only queries from tools outside the swarm.

A run ends for a peer when its budget is spent (``train.max_steps``,
``train.max_seconds``) or when the swarm is asked to stop (``gossiptrain
stop``). The peer then runs a final phase (``FinalPhase``) on its training
thread, taking no more local steps but still averaging at its safe points:

1. it tells its view it is done (and whether it will write the merged
   model), then waits until every live member is done too, at most
   ``final.wait_seconds``: peers finishing their budgets a little apart
   keep averaging with the ones still training;
2. ``final.consensus_seconds`` of averaging, everyone together, so the
   members end close to one another;
3. a writer (``gossiptrain peer --final-model PATH``) downloads every live
   member's state and writes their average weighted by samples seen
   (``gossiptrain.state.merged_model``), then says so; everyone stays until the
   writers they know of have written or left, at most ``final.merge_seconds``;
4. the peer leaves (announced), and its process exits.

Messages (bodies checked; nothing but small msgpack values):

- ``query`` {}: anyone, no fingerprint needed -> ``roster`` {fingerprint,
  config, members, stopping}: who is alive, as the answerer sees it. Rate
  limited per source like joins. The asker never becomes a member: this is
  how ``gossiptrain export`` and ``gossiptrain stop`` find the swarm.
- ``stop`` {id, reason}: with the run's fingerprint; the swarm finishes. A
  member forwards a stop id it has not seen to every member of its view (a
  flood: every live member hears it within a hop or two); the coordinator
  relays it to the members it knows. A sender outside the view (the tool)
  gets a ``roster`` back as its acknowledgement.
- ``fin`` {phase, writer}: the sender is ``done`` (its final phase began;
  ``writer``: it will write the merged model) or has ``written`` it.
  Sent to every member of the view, and again every heartbeat interval of
  the final phase, so that a lost message costs one interval.

``FinishEndpoint`` keeps this state for a ``PeerNode`` (or the coordinator)
on the network thread; the training thread only reads it.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gossiptrain.runtime.clock import Clock
from gossiptrain.config import FinalConfig, RunConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.membership import ALIVE, Member
from gossiptrain.protocol.admission import JoinLimiter, join_source
from gossiptrain.net.wire import Message
from gossiptrain.net.kinds import FIN, QUERY, ROSTER, STOP

log = logging.getLogger(__name__)

DONE, WRITTEN = "done", "written"

_ID_LIMIT = 1 << 63
_REASON_CHARS = 200
_REMEMBERED = 4096  # stop ids and member notices kept (bounded state)
_ROSTER_ENTRY_BYTES = 128  # a generous bound on one member's entry in a roster, for the header limit


def new_stop_id(rng: random.Random | None = None) -> int:
    return (rng or random.SystemRandom()).randrange(1, _ID_LIMIT)


@dataclass(frozen=True)
class StopRequest:
    """The swarm was asked to finish: by whom first (a member id, "coordinator", or a tool's name) and why."""

    id: int
    reason: str
    origin: str


@dataclass
class FinishStats:
    queries_answered: int = 0
    queries_throttled: int = 0
    stops_received: int = 0  # stop messages, repeats included
    notices_received: int = 0  # fin messages

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def roster_body(config: RunConfig, members: Sequence[Member], stopping: bool) -> dict[str, Any]:
    """The answer to a query: the run and the live members (as many as one message takes)."""
    cap = max(1, min(config.limits.max_container_len, (config.limits.max_header_bytes - 64 * 1024) // _ROSTER_ENTRY_BYTES))
    alive = [m for m in members if m.state == ALIVE][:cap]
    return {
        "fingerprint": config.fingerprint(), "config": config.to_dict(), "members": [m.to_wire() for m in alive],
        "stopping": stopping,
    }


class FinishEndpoint:
    """Stop requests, fin notices and queries for one member, or for the coordinator.

    ``send(addr, kind, body) -> bool`` puts a message on the wire with our
    fingerprint; ``members()`` are the members we know (our membership's
    alive ones, or the coordinator's registry).
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        me: str,
        send: Callable[[str, str, dict[str, Any]], bool],
        members: Callable[[], Sequence[Member]],
        clock: Clock,
    ) -> None:
        self.config = config
        self.fingerprint = config.fingerprint()
        self.me = me
        self._send = send
        self._members = members
        self._clock = clock
        self.stop: StopRequest | None = None  # written on the network thread, read by the training thread
        self.done: dict[str, bool] = {}  # member -> whether it will write the merged model; those in a final phase
        self.written: set[str] = set()  # members that wrote the merged model
        self.stats = FinishStats()
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._limiter = JoinLimiter.from_limits(config.limits)

    # -- messages (the network thread) ---------------------------------------------------------

    def on_message(self, msg: Message, frames: Sequence[object] = ()) -> None:
        """Handle a query, stop or fin; ProtocolError if malformed. A roster is not for us: dropped."""
        if msg.kind == QUERY:
            if not self._limiter.allow(join_source(frames, msg.addr), self._clock.now()):
                self.stats.queries_throttled += 1
                return
            self.stats.queries_answered += 1
            self._send(msg.addr, ROSTER, roster_body(self.config, self._members(), self.stop is not None))
            return
        if msg.kind == ROSTER:
            raise ProtocolError("a roster answers a query; members send none")
        if msg.fingerprint != self.fingerprint:
            raise ProtocolError("a stop or fin of another run")
        if msg.kind == STOP:
            self._on_stop(msg)
        elif msg.kind == FIN:
            self._on_fin(msg)

    def _on_stop(self, msg: Message) -> None:
        body = msg.body
        sid, reason = body.get("id"), body.get("reason")
        if type(sid) is not int or not 0 < sid < _ID_LIMIT or not isinstance(reason, str):
            raise ProtocolError("stop needs an int id in [1, 2**63) and a str reason")
        self.stats.stops_received += 1
        members = list(self._members())
        if not any(m.id == msg.sender for m in members):
            # A tool (or a member we do not know yet): acknowledge with what we know, so it can report it.
            self._send(msg.addr, ROSTER, roster_body(self.config, members, True))
        self.request_stop(reason[:_REASON_CHARS], origin=msg.sender or msg.addr, stop_id=sid, came_from=msg.sender)

    def _on_fin(self, msg: Message) -> None:
        phase, writer = msg.body.get("phase"), msg.body.get("writer")
        if phase not in (DONE, WRITTEN) or type(writer) is not bool or not msg.sender:
            raise ProtocolError("fin needs phase done or written and a bool writer")
        self.stats.notices_received += 1
        self._note(msg.sender, phase, writer)

    def _note(self, member: str, phase: str, writer: bool) -> None:
        self.done[member] = self.done.get(member, False) or writer
        if phase == WRITTEN:
            self.written.add(member)
        while len(self.done) > _REMEMBERED:  # bounded: the oldest notices go first
            oldest = next(iter(self.done))
            del self.done[oldest]
            self.written.discard(oldest)

    # -- local actions (the network thread) ------------------------------------------------------

    def request_stop(self, reason: str, *, origin: str = "", stop_id: int | None = None, came_from: str = "") -> bool:
        """Mark the swarm as stopping and pass the request on to everyone we know; False if we had it already."""
        sid = stop_id if stop_id is not None else new_stop_id()
        if sid in self._seen:
            return False
        self._seen[sid] = None
        while len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)
        if self.stop is None:
            self.stop = StopRequest(sid, reason, origin or self.me)
            log.warning("stop requested by %s (%s): finishing the run", self.stop.origin, reason)
        body = {"id": sid, "reason": reason}
        for m in self._members():
            if m.state == ALIVE and m.id not in (self.me, came_from):
                self._send(m.addr, STOP, body)
        return True

    def announce(self, phase: str, writer: bool, everyone: bool = True) -> None:
        """Tell the live members of our view that we are done, or wrote the merged model.

        ``everyone=False`` (a reminder) tells only those that have not said
        they are done themselves: a newcomer, or one that missed a message;
        once all are done a reminder costs nothing, however big the swarm.
        """
        self._note(self.me, phase, writer)
        targets = [m for m in self._members() if m.state == ALIVE and m.id != self.me and (everyone or m.id not in self.done)]
        for m in targets:
            self._send(m.addr, FIN, {"phase": phase, "writer": writer})
            if self.stop is not None:  # the stop again, for members that joined since or missed it
                self._send(m.addr, STOP, {"id": self.stop.id, "reason": self.stop.reason})


# -- the final phase (the training thread) -----------------------------------------------------


@dataclass
class FinalReport:
    """How a peer's final phase went, for its summary."""

    reason: str  # budget, stop
    waited_seconds: float = 0.0  # in the wait for the others
    all_done: bool = False  # every live member was done when the wait ended
    consensus_seconds: float = 0.0
    rounds: int = 0  # safe points run without a local step
    final_model: str | None = None  # where this peer wrote the merged model
    merged_members: list[str] = field(default_factory=list)
    skipped_members: list[str] = field(default_factory=list)
    merge_error: str = ""
    seconds: float = 0.0
    aborted: bool = False  # interrupted (a signal): left at once

    def to_record(self) -> dict[str, Any]:
        return {
            "finish": self.reason, "final_waited_s": round(self.waited_seconds, 3), "final_all_done": self.all_done,
            "final_rounds": self.rounds, "final_seconds": round(self.seconds, 3), "final_model": self.final_model,
            "final_merged": self.merged_members, "final_skipped": self.skipped_members,
            **({"final_error": self.merge_error} if self.merge_error else {}),
        }


class FinalPhase:
    """One peer's final phase (see the module docstring), driven from its training thread.

    ``idle()`` runs one safe point without a local step and paces itself;
    ``notify(phase, writer, everyone)`` runs ``FinishEndpoint.announce`` on
    the network thread; ``view()`` is the live member ids (us included); ``abort()`` says
    to leave at once (a signal). ``merge()``, for a writer, starts writing the
    merged model and returns a ``concurrent.futures.Future``-like object whose
    result is a ``(merged, skipped)`` pair of member id lists.
    """

    def __init__(
        self,
        config: FinalConfig,
        *,
        me: str,
        endpoint: FinishEndpoint,
        view: Callable[[], Sequence[str]],
        idle: Callable[[], None],
        notify: Callable[[str, bool, bool], None],
        abort: Callable[[], bool] = lambda: False,
        renotify_every: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.me = me
        self.endpoint = endpoint
        self.view = view
        self.idle = idle
        self.notify = notify
        self.abort = abort
        self.renotify_every = renotify_every
        self.clock = clock

    def run(self, reason: str, merge: Callable[[], Any] | None = None, final_model: str | None = None) -> FinalReport:
        report = FinalReport(reason)
        began = self.clock()
        writer = merge is not None
        self._last_notice = -1e18
        self._notice(DONE, writer, force=True)
        log.info("final phase (%s): waiting for the others to finish", reason)
        # 1. Everyone done (the barrier), averaging meanwhile with those still training.
        report.all_done = self._until(lambda: not self._others_training(), self.config.wait_seconds, report, DONE, writer)
        report.waited_seconds = self.clock() - began
        if not report.all_done and not report.aborted:
            log.warning("final phase: %s still training after final.wait_seconds", ", ".join(self._others_training()))
        # 2. Consensus: averaging only, everyone together.
        if not report.aborted and len(self.view()) > 1 and self.config.consensus_seconds > 0:
            t = self.clock()
            self._until(lambda: False, self.config.consensus_seconds, report, DONE, writer)
            report.consensus_seconds = self.clock() - t
        # 3. The merged model, then 4. stay for the writers we know of.
        lingering_since = self.clock()
        if merge is not None and not report.aborted:
            future = merge()
            self._until(future.done, self.config.merge_seconds, report, DONE, writer)
            if future.done():
                try:
                    report.merged_members, report.skipped_members = future.result()
                    report.final_model = final_model
                except Exception as e:  # a failed write must not stop the leave; the summary names it
                    report.merge_error = f"{type(e).__name__}: {e}"
                    log.error("final phase: could not write the merged model: %s", report.merge_error)
            else:
                future.cancel()
                report.merge_error = f"not written within final.merge_seconds={self.config.merge_seconds:g}"
                log.error("final phase: the merged model was %s", report.merge_error)
            self._notice(WRITTEN, True, force=True)
        if not report.aborted:
            left = self.config.merge_seconds - (self.clock() - lingering_since)
            self._until(lambda: not self._writers_pending(), max(0.0, left), report, WRITTEN if writer else DONE, writer)
        report.seconds = self.clock() - began
        return report

    def _others_training(self) -> list[str]:
        done = self.endpoint.done
        return [m for m in self.view() if m != self.me and m not in done]

    def _writers_pending(self) -> list[str]:
        e = self.endpoint
        view = set(self.view())
        return [m for m, writer in list(e.done.items()) if writer and m != self.me and m in view and m not in e.written]

    def _until(self, condition: Callable[[], Any], seconds: float, report: FinalReport, phase: str, writer: bool) -> bool:
        """Idle at safe points until ``condition()`` holds (True) or ``seconds`` pass (False); renotify meanwhile."""
        deadline = self.clock() + seconds
        while True:
            if condition():
                return True
            if self.abort():
                report.aborted = True
                return False
            if self.clock() >= deadline:
                return False
            self.idle()
            report.rounds += 1
            self._notice(phase, writer)

    def _notice(self, phase: str, writer: bool, force: bool = False) -> None:
        now = self.clock()
        if force or now - self._last_notice >= self.renotify_every:
            self._last_notice = now
            self.notify(phase, writer, force)  # a reminder goes only to members not done yet
