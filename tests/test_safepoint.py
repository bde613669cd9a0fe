"""The safe point's round counter: a time-varying topology advances by gossip rounds started, not by local steps."""

from __future__ import annotations

import queue
from collections import deque
from typing import Any

from gossiptrain.config import GossipConfig, RunConfig
from gossiptrain.net import kinds
from gossiptrain.protocol import averaging_events
from gossiptrain.protocol.averaging_events import AtSafePoint, SendExchange
from gossiptrain.protocol.receipts import Receipts
from gossiptrain.runtime.safepoint import SafePoint


class StoppedClock:
    def now(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        raise AssertionError("the safe point never sleeps")


class GraphNode:
    """What SafePoint reads of a PeerNode: a period-3 graph that offers one partner per round."""

    def __init__(self) -> None:
        self.config = RunConfig()
        self.exchanges: queue.Queue[Any] = queue.Queue()
        self.returns: deque[Any] = deque()
        self.step = 0

    def take_on_network(self, kinds: frozenset[str], handler: Any) -> None:
        pass

    def partners(self, round: int) -> list[str]:
        return [f"p{round % 3}"]

    def latency(self) -> float | None:
        return None


class EveryThirdStep:
    """An averaging that can start an exchange only every third step (a round trip of about 3 steps)."""

    network_kinds: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.stats = averaging_events.AveragingStats()  # the safe point reads the seconds waited (SafePoint.wait_share)
        self.receipts = Receipts(GossipConfig(), self.stats)  # the safe point switches them on (its node sends them)

    def hold_until(self, now: float) -> None:
        return None

    def handle(self, event: Any, now: float) -> list[averaging_events.Action]:
        if isinstance(event, AtSafePoint) and event.step % 3 == 0 and event.partners:
            self.asked.append(event.partners[0])
            return [SendExchange(event.partners[0], kinds.XREQ, event.step, {})]
        return []


def test_a_peer_that_starts_every_third_step_still_visits_every_phase_of_a_period_3_graph() -> None:
    sent: list[SendExchange] = []
    algo = EveryThirdStep()
    point = SafePoint(GraphNode(), algo, StoppedClock(), sent.append)  # type: ignore[arg-type]
    for step in range(1, 31):
        point(step)
    # Rounds taken from the step would be 3, 6, 9, ...: always p0, and the swarm splits into cliques.
    assert algo.asked[:3] == ["p0", "p1", "p2"]
    assert {a.to for a in sent} == {"p0", "p1", "p2"} and len(sent) == 10
    assert point.rounds == 10


class Recorder:
    """An algorithm that answers requests on the network side, noting the order of what the driver does."""

    network_kinds: frozenset[str] = frozenset({kinds.XREQ})

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.stats = averaging_events.AveragingStats()
        self.receipts = Receipts(GossipConfig(), self.stats)

    def handle(self, event: Any, now: float) -> list[averaging_events.Action]:
        self.log.append("handle")
        return [SendExchange(event.sender, kinds.XREP, event.xid, {})]

    def after_send(self) -> None:
        self.log.append("after_send")


class SendingNode(GraphNode):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def send_exchange(self, action: SendExchange) -> None:
        self.log.append(f"send {action.kind}")


def test_a_reply_is_sent_before_the_work_the_algorithm_put_off_until_then() -> None:
    log: list[str] = []
    point = SafePoint(SendingNode(log), Recorder(log), StoppedClock(), lambda a: None)  # type: ignore[arg-type]
    point.on_network(averaging_events.Received("p1", kinds.XREQ, 7, {}))
    assert log == ["handle", f"send {kinds.XREP}", "after_send"]
