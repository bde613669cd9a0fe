"""The final phase of a peer's run, driven in real time, and the end-of-run messages turned into events.

The schedule (wait for the others, consensus, the merged model, linger for
the writers) and the messages it relies on are described in
``gossiptrain.protocol.finish``, whose ``FinishEndpoint`` keeps the state on
the network thread. ``FinalPhase`` runs on the training thread: it blocks,
idling at safe points, so it belongs to the runtime, not to the sans-IO
protocol. ``finish_event`` is the one place a wire message becomes a
``FinishEndpoint`` event, for ``PeerNode`` and the coordinator alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gossiptrain.config import FinalConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import FIN, QUERY, ROSTER, STOP
from gossiptrain.net.wire import Message
from gossiptrain.protocol.admission import join_source
from gossiptrain.protocol.finish import DONE, WRITTEN, Event, FinishEndpoint, FinNotice, Query, RosterNotice, StopNotice

log = logging.getLogger(__name__)


def finish_event(msg: Message, ip: str | None = None) -> Event:
    """The ``FinishEndpoint`` event a query, roster, stop or fin message carries.

    ``ip`` is where the transport saw it come from (``Transport.source_of``;
    None where it cannot tell): a query is rate limited by it, as joins are.
    """
    if msg.kind == QUERY:
        return Query(msg.addr, join_source(ip, msg.addr))
    if msg.kind == ROSTER:
        return RosterNotice(msg.sender, msg.addr)
    if msg.kind == STOP:
        return StopNotice(msg.sender, msg.addr, msg.fingerprint, msg.body)
    if msg.kind == FIN:
        return FinNotice(msg.sender, msg.addr, msg.fingerprint, msg.body)
    raise ProtocolError(f"{msg.kind!r} is not a message of the end of a run")


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
    ``notify(phase, writer, everyone)`` has the network thread feed
    ``FinishEndpoint`` an ``Announce`` and send what it returns; ``view()`` is the live member ids (us included),
    read at every safe point, so that a member the membership declares dead is not waited for a moment longer
    (how soon a death is known is the membership's business: seconds in a small swarm); ``abort()`` says
    to leave at once (a signal). ``merge()``, for a writer, starts writing the
    merged model and returns a ``concurrent.futures.Future``-like object whose
    result is a ``(merged, skipped)`` pair of member id lists. ``clock()``
    is the caller's (a ``Clock``'s ``now``), so a test can run the schedule
    in fake time.
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
        clock: Callable[[], float],
        renotify_every: float = 0.5,
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
