"""The trainer's safe point: where averaging reads and writes the model.

Between two optimizer steps nothing else touches the parameters, so that is
where exchange messages the network side queued are applied and the next
exchange is started. The kinds an algorithm takes on the network side
(``Averaging.network_kinds``: pairwise requests and replies) do not wait for
it: the node hands them to ``on_network`` as they arrive, so a training loop
that pauses (evaluation, a checkpoint, slow data) never keeps a partner
waiting; the algorithm merges them into its view and the next safe point
adds them to the model. One lock serialises the two sides' calls into the
algorithm. Members in quarantine (see ``gossiptrain.protocol.quarantine``) are
refused on either side, before their messages cost a decode or a merge, and
are not picked as partners. Both drivers call this once per local step:
``Peer`` (a real process, network on another thread) and the simulator
(everything on one virtual-time loop); they differ only in how an outgoing
message from the training side reaches the node (``submit``).
"""

from __future__ import annotations

import logging
import queue
import threading
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from gossiptrain.net import kinds
from gossiptrain.protocol import averaging_events, push_sum
from gossiptrain.protocol.averaging import Averaging
from gossiptrain.protocol.averaging_events import Rejected, SendExchange
from gossiptrain.protocol.drift import DriftCorrection
from gossiptrain.protocol.quarantine import Quarantine
from gossiptrain.protocol.stability import StabilityGuard
from gossiptrain.runtime.clock import Clock
from gossiptrain.runtime.peer_network import PeerNode

log = logging.getLogger(__name__)

#: Weight of one safe point in ``SafePoint.wait_share``.
WAIT_SMOOTHING = 0.05


class WaitShare:
    """The share of time lately spent waiting for the link (flow control), smoothed over time, not safe points."""

    def __init__(self) -> None:
        self.share = 0.0
        self._last: tuple[float, float] | None = None  # (when, seconds waited in all) at the last observation
        self._waited_sum = self._time_sum = 0.0

    def observe(self, now: float, waited: float) -> float:
        """At a safe point, ``now``, having waited ``waited`` seconds in all so far: the share, updated."""
        last, self._last = self._last, (now, waited)
        if last is not None and now > last[0]:
            self._waited_sum = (1 - WAIT_SMOOTHING) * self._waited_sum + (waited - last[1])
            self._time_sum = (1 - WAIT_SMOOTHING) * self._time_sum + (now - last[0])
            self.share = min(1.0, self._waited_sum / self._time_sum)
        return self.share


class SafePoint:
    """Feeds one peer's averaging state machine at each local step."""

    def __init__(
        self,
        node: PeerNode,
        averaging: Averaging,
        clock: Clock,
        submit: Callable[[SendExchange], None],
    ) -> None:
        self.node = node
        self.averaging = averaging
        self.clock = clock
        self.submit = submit
        self._lock = threading.RLock()  # the training side and the network side both call into averaging
        self._progress = threading.Event()  # set whenever the network side handled an event (flow control waits on it)
        gossip = node.config.gossip
        self.quarantine = Quarantine(gossip.quarantine_after, gossip.quarantine_seconds)
        # Gossip rounds this peer has started (ticks that sent a request or a push, or found no partner it
        # may use in this round's graph). A time-varying topology advances by these, not by local steps: a
        # peer that starts an exchange every k steps would otherwise see the same phase of a period-k graph
        # every time (one-peer-exponential at 8 peers, where a round trip takes about 3 steps, split the
        # swarm into two halves that never met).
        self.rounds = 0
        # Called at the end of each safe point on the training side, the merges applied (quasi-global momentum).
        self.after: Callable[[], None] | None = None
        # Reads the parameters as a safe point starts and adds its correction once the merges are in and
        # ``after`` ran (gossiptrain.protocol.drift); None: off.
        self.drift: DriftCorrection | None = None
        # Watches the model at the end of each safe point and backs the added methods off before a blow-up
        # (gossiptrain.protocol.stability); None: off (``gossip.guard = false``).
        self.guard: StabilityGuard | None = None
        # The share of time spent waiting for the link (flow control) lately, smoothed over about 20 safe points.
        self._waits = WaitShare()
        node.take_on_network(averaging.network_kinds, self.on_network)
        averaging.receipts.enabled = True  # our node acknowledges every push it takes, so pushers may wait for receipts

    def __call__(self, step: int) -> None:
        """Run the safe point after local step ``step``."""
        node = self.node
        node.step = step
        now = self.clock.now()
        quarantine = self.quarantine
        actions: list[averaging_events.Action] = []
        self._measure_waits(now)
        if self.drift is not None:
            self.drift.before()
        with self._lock:
            if self.averaging.hold_until(now) is not None:  # the step just taken began when it should have waited
                self.averaging.stats.overran += 1
            for event in _drained(node):
                actions += self._handle(event, now)
            partners = [p for p in node.partners(self.rounds) if not quarantine.blocks(p, now)]
            latency = node.latency()
            started = self.averaging.handle(averaging_events.AtSafePoint(step, partners, latency), now)
            if not partners or any(isinstance(a, SendExchange) and a.kind in (kinds.XREQ, kinds.XPUSH) for a in started):
                self.rounds += 1
            actions += started
            self._note_rejections(actions, now)
            # Of this safe point's merges, for the drift correction (gossiptrain.protocol.drift).
            drift_inputs = self._drift_inputs(latency) if self.drift is not None else None
        for action in actions:
            if isinstance(action, SendExchange):
                self.submit(action)
        if self.after is not None:
            self.after()
        if self.drift is not None and drift_inputs is not None:
            self.drift.after(*drift_inputs)
        if self.guard is not None:
            # Last: it judges the model the local step, the merges and every method made. A model it puts back
            # replaces the one this safe point gave partners to average with: averaging forgets what it computed
            # from that one, under the lock, before a partner is served from it again.
            with self._lock:
                if self.guard(step):
                    self.averaging.model_put_back()
                self.averaging.settling = self.guard.settling
                self.averaging.norm = self.guard.norm

    def _drift_inputs(self, latency: float | None) -> tuple[float, float | None, tuple[list[torch.Tensor], float] | None]:
        """What the drift correction measures by: the share of the model stale merges replaced, the link's
        round trip in local steps (None: not measured yet), and what the safe point added where the algorithm
        says (``Averaging.take_moved``; None: the correction measures it)."""
        moved = self.averaging.take_moved() if self.averaging.reports_moves else None
        return self.averaging.take_stale_share(), self.averaging.round_trip_steps(latency), moved

    def locked(self) -> AbstractContextManager[Any]:
        """The lock both sides take to call into the algorithm: ``with safepoint.locked(): ...`` (checkpoints)."""
        return self._lock

    def serve_as_is(self) -> None:
        """Before training: answer partners from the model as it is now (``Averaging.serve_as_is``)."""
        with self._lock:
            self.averaging.serve_as_is()

    def on_network(self, event: averaging_events.Event) -> None:
        """An event the algorithm takes as it arrives (on the node's thread): answer it now, send at once."""
        now = self.clock.now()
        with self._lock:
            actions = self._handle(event, now) if isinstance(event, averaging_events.Received) else self.averaging.handle(event, now)
            self._note_rejections(actions, now)
        for action in actions:
            if isinstance(action, SendExchange):
                self.node.send_exchange(action)
        with self._lock:  # what could wait until the reply was out (pairwise: the server's own merge)
            self.averaging.after_send()
        self._progress.set()

    # -- flow control ----------------------------------------------------------------------------

    @property
    def wait_share(self) -> float:
        """The share of time lately spent waiting for the link (``WaitShare``)."""
        return self._waits.share

    def _measure_waits(self, now: float) -> None:
        self._waits.observe(now, self.averaging.stats.waited_s)

    def hold(self) -> float:
        """Seconds the training loop should wait now for the exchange in flight (0: go on); see ``Averaging.hold_until``."""
        now = self.clock.now()
        with self._lock:
            until = self.averaging.hold_until(now)
        return 0.0 if until is None else max(0.0, until - now)

    def wait(self) -> None:
        """Block this (training) thread while ``hold`` says so, waking as the network side makes progress."""
        started = self.clock.now()
        waited = False
        while True:
            self._progress.clear()
            seconds = self.hold()
            if seconds <= 0:
                break
            waited = True
            self._progress.wait(seconds)
        if waited:
            self.waited(self.clock.now() - started)

    def waited(self, seconds: float) -> None:
        """Count a wait (the simulator waits in virtual time itself, then reports it here)."""
        with self._lock:
            self.averaging.stats.waits += 1
            self.averaging.stats.waited_s += seconds
            self.averaging.stats.longest_wait_s = max(self.averaging.stats.longest_wait_s, seconds)

    def _handle(self, event: averaging_events.Received, now: float) -> list[averaging_events.Action]:
        quarantine = self.quarantine
        if quarantine.blocks(event.sender, now):
            quarantine.refused()
            if event.kind == kinds.XPUSH:  # it takes its mass back
                return [push_sum.refusal(event)]
            if event.kind == kinds.XREQ:  # it moves on at once
                return [SendExchange(event.sender, kinds.XNAK, event.xid, {})]
            return []
        return self.averaging.handle(event, now)

    def _note_rejections(self, actions: list[averaging_events.Action], now: float) -> None:
        for action in actions:
            if isinstance(action, Rejected):
                log.warning("rejected an update from %s: %s", action.sender, action.reason)
                self.quarantine.offence(action.sender, now)


def _drained(node: PeerNode) -> list[averaging_events.Received]:
    """What the network side queued for this safe point: returned pushes first (they never wait), then the rest."""
    out: list[averaging_events.Received] = []
    while node.returns:
        out.append(node.returns.popleft())
    while True:
        try:
            out.append(node.exchanges.get_nowait())
        except queue.Empty:
            return out
