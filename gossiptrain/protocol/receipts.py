"""Receipts for pushes: flow control for the algorithms that push (push-sum, neighbour, local SGD).

A push needs no reply, so nothing told a pusher that its link was slower than
its steps: it queued a push every round, the link's backlog grew, and every
model arrived hundreds of steps old while each peer drifted toward its own
shard (4 simulated peers, label-skewed digits, a 1.7 Mbit/s link: push-sum,
neighbour and local SGD at 0.38-0.42 test accuracy after 20 s, where pairwise,
which waits for its reply, was at 0.74). Now the receiving node acknowledges
every push it takes (``XACK``, no tensors, sent by ``PeerNode`` as the push is
queued, so a receiver's paused training loop does not delay it), and a pusher

- keeps at most one round of pushes unacknowledged: a new round starts only
  once every push of the last one was acknowledged, refused, or timed out, so
  a link carries one model at a time, and each arrives as fresh as the link
  allows;
- stops its training loop once the oldest unacknowledged push is ``bound``
  local steps old (``hold_until``), as pairwise does for its reply, and never
  past that push's timeout: a dead, paused or slow receiver costs one timeout.
- presumes a receipt lost once it is several typical round trips late
  (``RttEstimator.late_after``, as pairwise presumes a reply lost): it then
  holds neither the loop nor the next round; its timeout is still counted.

The timeout follows the measured push-to-receipt time (``RttEstimator``,
between ``gossip.exchange_timeout_min`` and ``_max``). Receipts change no
mass: push-sum's refusal and conservation rules are untouched, and a receipt
that never comes (lost, or a receiver that does not send them) only means
the pusher waits out one timeout before its next round. Drivers whose node
sends receipts switch them on (``enabled``); machines driven by hand (lockstep
rounds, unit tests) push every round as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gossiptrain.config import GossipConfig
from gossiptrain.protocol.averaging_events import AveragingStats
from gossiptrain.protocol.rtt import RttEstimator


@dataclass
class _Unacked:
    xid: int
    step: int  # our local step when we pushed it
    sent_at: float
    deadline: float
    expected_by: float  # past this the receipt is presumed lost: it holds no one (the deadline still times it out)
    nbytes: int  # of the push's tensors
    presumed_lost: bool = False


class Receipts:
    """The pushes of our last round still on their way, per receiver (one each)."""

    def __init__(self, config: GossipConfig, stats: AveragingStats) -> None:
        self.enabled = False
        self.rtt = RttEstimator(config.exchange_timeout_min, config.exchange_timeout_max)
        self.stats = stats  # the algorithm's: timeouts (receipts that did not come in time) and rtt_ms
        self.on_round_trip: Callable[[float, int], None] | None = None  # (seconds, bytes pushed): compression "auto"
        self._out: dict[str, _Unacked] = {}

    def pushed(self, to: str, xid: int, step: int, now: float, nbytes: int = 0) -> None:
        if self.enabled:
            deadline = now + self.rtt.timeout()
            self._out[to] = _Unacked(xid, step, now, deadline, self.rtt.presumed_lost_at(now, deadline), nbytes)

    def settled(self, sender: str, xid: int, now: float, *, receipt: bool) -> bool:
        """``sender`` took (``receipt``) or refused our push ``xid``: its link is free. False if it was not ours."""
        out = self._out.get(sender)
        if out is None or out.xid != xid:
            return False
        del self._out[sender]
        if receipt:
            self.rtt.observe(now - out.sent_at)
            self.stats.round_trip(now - out.sent_at, self.rtt.srtt)
            if self.on_round_trip is not None:
                self.on_round_trip(now - out.sent_at, out.nbytes)
        return True

    def forget(self, member: str) -> None:
        """A member that is gone sends no receipt: do not wait for it."""
        self._out.pop(member, None)

    def in_flight(self, now: float) -> bool:
        """Whether a push of our last round may still be acknowledged (then no new round starts)."""
        expired = [to for to, out in self._out.items() if now >= out.deadline]
        for to in expired:
            out = self._out.pop(to)
            self.stats.timeouts += 1
            self.rtt.backoff()
            if self.on_round_trip is not None:
                self.on_round_trip(now - out.sent_at, out.nbytes)  # it took at least that long
        for out in self._out.values():
            if now >= out.expected_by and not out.presumed_lost:
                out.presumed_lost = True
                self.stats.presumed_lost += 1
        return any(not out.presumed_lost for out in self._out.values())

    def hold_until(self, step: int, now: float, bound: int) -> float | None:
        """Until when the training loop should wait (None: go on): the oldest push is ``bound`` steps old."""
        due = [out.expected_by for out in self._out.values() if now < out.expected_by and step - out.step >= bound]
        return min(due) if due else None
