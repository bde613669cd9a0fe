"""The trainer's safe point: where averaging reads and writes the model.

Between two optimizer steps nothing else touches the parameters, so that is
where exchange messages the network side queued are applied, requests are
answered, and the next exchange is started. Members in quarantine (see
``gossiptrain.protocol.quarantine``) are refused here, before their messages cost a
decode or a merge, and are not picked as partners. Both drivers call this once per
local step: ``Peer`` (a real process, network on another thread) and the
simulator (everything on one virtual-time loop); they differ only in how an
outgoing message reaches the node (``submit``).
"""

from __future__ import annotations

import logging
import queue
from typing import Callable

from gossiptrain.net import kinds
from gossiptrain.protocol import averaging
from gossiptrain.protocol.averaging import Averaging, Rejected, SendExchange
from gossiptrain.protocol.quarantine import Quarantine
from gossiptrain.runtime.clock import Clock
from gossiptrain.runtime.peer_network import PeerNode

log = logging.getLogger(__name__)


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
        gossip = node.config.gossip
        self.quarantine = Quarantine(gossip.quarantine_after, gossip.quarantine_seconds)
        # Gossip rounds this peer has started (ticks that sent a request or a push, or found no partner it
        # may use in this round's graph). A time-varying topology advances by these, not by local steps: a
        # peer that starts an exchange every k steps would otherwise see the same phase of a period-k graph
        # every time (one-peer-exponential at 8 peers, where a round trip takes about 3 steps, split the
        # swarm into two halves that never met).
        self.rounds = 0

    def __call__(self, step: int) -> None:
        """Run the safe point after local step ``step``."""
        node = self.node
        node.step = step
        now = self.clock.now()
        quarantine = self.quarantine
        actions: list[averaging.Action] = []
        while True:
            try:
                event = node.exchanges.get_nowait()
            except queue.Empty:
                break
            if quarantine.blocks(event.sender, now):
                quarantine.refused()
                if event.kind in (kinds.XREQ, kinds.XPUSH):  # so that it moves on (and takes back a push)
                    actions.append(SendExchange(event.sender, kinds.XNAK, event.xid, {}))
                continue
            actions += self.averaging.handle(event, now)
        partners = [p for p in node.partners(self.rounds) if not quarantine.blocks(p, now)]
        started = self.averaging.handle(averaging.AtSafePoint(step, partners), now)
        if not partners or any(isinstance(a, SendExchange) and a.kind in (kinds.XREQ, kinds.XPUSH) for a in started):
            self.rounds += 1
        actions += started
        for action in actions:
            if isinstance(action, SendExchange):
                self.submit(action)
            elif isinstance(action, Rejected):
                log.warning("rejected an update from %s: %s", action.sender, action.reason)
                quarantine.offence(action.sender, now)
