"""The network side of one peer: membership gossip, answering joins, routing exchanges.

``PeerNode`` runs in the peer's event loop, an ``Endpoint``
(``gossiptrain.runtime.endpoint``) whose handler table routes each kind: it
drives the membership state machine on a heartbeat, answers joins like the
coordinator does, reports to the coordinator when one is known, and routes
exchange messages: the kinds the averaging algorithm takes on the network
side (pairwise requests and replies) go to it at once (``take_on_network``);
the rest wait for the trainer's next safe point in a bounded queue (see
``gossiptrain.runtime.safepoint``). When that queue is full, a push is
refused at once with its mass (its sender adds it back), and one taken is
acknowledged at once (``XACK``: flow control for pushers, see
``gossiptrain.protocol.receipts``); refusals that
carry our own mass back wait apart (``returns``), so a full queue never
drops them. State transfer messages go to
``self.state`` (``gossiptrain.runtime.state_endpoint``): it answers newcomers
as a donor and feeds our own download when we are one. End-of-run messages
go to ``self.finish`` (``gossiptrain.protocol.finish``). Ready sets go to
``self.rendezvous`` (``gossiptrain.protocol.rendezvous``): who is past its
state download, for peers that wait for a count before training.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import random
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import topologies
from gossiptrain.config import RunConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net import kinds
from gossiptrain.net.addressing import CURVE_QUERY, is_client_address, key_id, plain_address
from gossiptrain.net.transport import Transport
from gossiptrain.net.wire import Message
from gossiptrain.protocol import averaging_events, finish, push_sum
from gossiptrain.protocol.admission import join_source
from gossiptrain.protocol.averaging_events import Received, SendExchange
from gossiptrain.protocol.joining import JoinRequest
from gossiptrain.protocol.leases import SendLeases
from gossiptrain.protocol.member import ALIVE, DEAD, LEFT, REPORTED_DEATHS, SUSPECT, Member, members_from_wire
from gossiptrain.protocol.membership import Membership
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.piece_exchange import hello_answer
from gossiptrain.protocol.pieces import PieceLayout
from gossiptrain.protocol.reachability import nonce_of
from gossiptrain.protocol.rendezvous import Rendezvous, SendReady, ready_from_wire
from gossiptrain.protocol.status import JOINING, StatusAnswerer
from gossiptrain.protocol.swim.events import (
    Ack,
    Digest,
    Event as MembershipEvent,
    Leave,
    MemberDown,
    MemberUp,
    Ping,
    PingReq,
    Send,
    Suspected,
    Tick,
    Welcomed,
)
from gossiptrain.runtime.clock import Clock
from gossiptrain.runtime.endpoint import EndpointStats
from gossiptrain.runtime.final_phase import finish_event
from gossiptrain.runtime.join_answering import JoinAnsweringEndpoint
from gossiptrain.runtime.leased_data import LeaseClient, plan_for
from gossiptrain.runtime.state_endpoint import StateEndpoint

log = logging.getLogger(__name__)
MEMBER_EVENTS = "gossiptrain.members"
"""The logger of membership changes for people: ``member ID joined``, ``left``, ``died (suspected by ...)``, at INFO.

Each record carries ``peer_id``, the member that saw it (several peers may share a
process); the CLI peer prints them above its progress line (``Progress.logs_above``).
"""
_member_events = logging.getLogger(MEMBER_EVENTS)

_NEEDS_ANSWER = (kinds.XREQ, kinds.XPUSH)  # a sender wants to know when these were not taken
_ADDR_HINTS = 1024  # addresses remembered for senders not (yet) in our view
_DEATHS_KEPT = 256  # recent death verdicts kept for inspection (tests, debugging)
_PROBES = (kinds.PING, kinds.PING_REQ, kinds.ACK)


@dataclass
class NodeStats(EndpointStats):
    exchange_queue_full: int = 0  # requests refused because the trainer was behind
    joins_answered: int = 0
    joins_refused: int = 0
    joins_throttled: int = 0  # dropped unanswered: over the per-source join rate (limits.join_*)
    members_up: int = 0
    members_suspected: int = 0  # suspicions raised (by our probes or heard), most of them refuted
    members_dead: int = 0  # declared dead: suspected and never refuted
    members_left: int = 0  # announced a clean leave
    status_answered: int = 0  # `gossiptrain status` asks answered
    status_throttled: int = 0  # ...and dropped, over their source's rate
    relay_changes: int = 0  # as a client: relays taken for other clients (the first included; ``_pick_relay``)


class PeerNode(JoinAnsweringEndpoint):
    """Membership, join answering and exchange routing for one peer."""

    def __init__(
        self,
        *,
        me: Member,
        config: RunConfig,
        transport: Transport,
        clock: Clock,
        rng: random.Random,
        spec: ParamSpec | None,
        coordinator: str = "",
        seeds: list[Member] | None = None,
        nonces: random.Random | None = None,
    ) -> None:
        super().__init__(
            transport, config.limits, sender=me.id, fingerprint=config.fingerprint(), stats=NodeStats(), advertise=me.addr
        )
        self.stats: NodeStats
        self.config = config
        self.clock = clock
        self.rng = rng
        self.spec = spec
        self.coordinator = coordinator
        secure = CURVE_QUERY in me.addr  # a secure swarm's ids are derived from keys (gossiptrain.net.addressing)
        self.membership = Membership(
            me, config.membership, rng, candidates=config.limits.candidates, nonces=nonces, id_of=key_id if secure else None,
            can_reach=transport.can_reach,
        )
        self.topology = topologies.parse(config.gossip.topology_spec)
        self._fallback = topologies.get("complete")
        # self.step: the trainer's step, stamped on outgoing messages (written by the trainer thread)
        # Exchange messages for the trainer; bounded so that a slow trainer refuses instead of hoarding.
        self.exchanges: queue.Queue[Received] = queue.Queue(maxsize=config.limits.averaging_queue)
        # Refusals carrying our own pushes back (their mass): at most about one per push we sent since the last
        # safe point, so this bound only ever drops a flood of forged ones.
        self.returns: deque[Received] = deque(maxlen=config.limits.averaging_queue)
        self._now_kinds: frozenset[str] = frozenset()  # handed to _now as they arrive (see take_on_network)
        self._now: Callable[[averaging_events.Event], None] | None = None
        self._view: tuple[str, ...] = (me.id,)
        self._warned_fallback = False
        # Members an exchange message could not be sent to (no route: gone, or behind a relay that is), and until
        # when partner choice passes them over (see partners).
        self._unsendable_until: dict[str, float] = {}
        self._addr_hints: OrderedDict[str, str] = OrderedDict()
        self.deaths: deque[tuple[float, str]] = deque(maxlen=_DEATHS_KEPT)  # (when, member id) of recent death verdicts
        self._reported_at = -math.inf  # when our last report to the coordinator left (its deaths are those since)
        # State transfer: we answer newcomers as a donor, and download our own state through it when we are one.
        self.state = StateEndpoint(config, send=self.send, address_of=self._address_of, clock=clock, latency=self.latency)
        # The end of a run: stop requests, final-phase notices, queries from tools (gossiptrain.protocol.finish).
        self.finish = finish.FinishEndpoint(config, me=me.id, members=self.membership.alive)
        # Who is ready to train, for a peer that waits for a count first (`--wait-for`, Peer.wait_for_peers).
        self.rendezvous = Rendezvous(
            me.id, interval=config.membership.heartbeat_interval / 2, max_ids=config.limits.max_container_len, rng=rng,
            gone=self._gone,
        )
        self.released = threading.Event()  # the rendezvous's count is reached: the trainer may start (its thread waits)
        # Leased data (`--data leased`, Peer.sampler): the chunks of a shared dataset this peer trains; set by
        # use_leases from the training thread, then driven here (its table pushed, others' merged).
        self.leases: LeaseClient | None = None
        # `gossiptrain status`: what the training side last left for it (Peer sets a richer source), read when asked.
        self.status_answerer = StatusAnswerer(config.limits, clock.now())
        self.training_status: Callable[[], dict[str, Any]] = lambda: {"phase": JOINING, "step": self.step}
        self.ready_count = 0  # live members known ready, for the trainer thread to read
        # A split peer's leader (issue 48): our layout and every rank's piece-link address, for a partner's hello.
        self.piece_introduction: tuple[PieceLayout, tuple[str, ...]] | None = None
        # (view, our neighbours in it): asked at every step, the same until the view changes where the topology
        # does not vary with the round and every member can be sent to (no clients behind NAT)
        self._neighbours_of_view: tuple[tuple[str, ...] | None, list[str]] = (None, [])
        self._relays_wanted = False  # a client that reaches other clients through a relay (``use_relays``)
        self._relay_looked_at = -math.inf  # when _pick_relay last ran
        self.handlers = {
            kinds.JOIN: self._on_join,
            **dict.fromkeys(kinds.MEMBERSHIP, self._on_membership),
            **dict.fromkeys(kinds.EXCHANGE, self._on_exchange),
            **dict.fromkeys(kinds.STATE, self._on_state),
            kinds.READY: self._on_ready,
            kinds.LEASE: self._on_lease,
            **dict.fromkeys(kinds.FINISH, self._on_finish_message),
            kinds.STATUS_ASK: self._on_status_ask,
            kinds.REACH: self._on_reach,
            kinds.XPHELLO: self._on_piece_hello,
        }
        self.open_kinds = frozenset({kinds.JOIN, kinds.QUERY})  # a query comes from tools that do not know the run yet
        self._started = me.incarnation  # members of a lower one were there before us: they did not join just now
        self._seeds = tuple(m.id for m in seeds or () if m.incarnation > 0 and m.id != me.id)
        if seeds:
            self._apply(self.membership.handle(Digest(seeds), clock.now()))

    @property
    def me(self) -> Member:
        return self.membership.me

    # -- thread-safe reads for the trainer ---------------------------------------------------

    def view(self) -> tuple[str, ...]:
        """Ids of alive members (us included), sorted; replaced atomically on every change."""
        return self._view

    def latency(self) -> float | None:
        """The shortest probe round trip lately (``Membership.min_rtt``), None before the first."""
        return self.membership.min_rtt.value

    def partners(self, round: int) -> list[str]:
        """Our topology neighbours among the alive members at ``round``, those we can send to.

        Neighbours under suspicion, or that an exchange message could not be
        sent to lately, are passed over while others remain. Where none does,
        any member we can send to will do: a client whose neighbours were its
        dead relay and another client behind it went without averaging until
        membership declared the relay dead (2.7 s in the simulator), where
        the other public peer was there all along.
        """
        reachable = self._graph_neighbours(round)
        now = self.clock.now()
        if self._unsendable_until or self.membership.has_suspects():
            usable = [m for m in reachable if self._usable(m, now)]
        else:
            usable = reachable  # every neighbour is usable: no pass over all of them at every step
        if usable or len(reachable) + 1 >= len(self._view):
            return usable or reachable
        me = self.me.id
        others = [m for m in self._view if m != me and self._can_reach_id(m, relayed=True) and self._usable(m, now)]
        return others or reachable

    def _usable(self, member_id: str, now: float) -> bool:
        """Neither under suspicion nor lately unsendable (``send_exchange``)."""
        until = self._unsendable_until.get(member_id)
        if until is not None:
            if now < until:
                return False
            self._unsendable_until.pop(member_id, None)  # pop: the loop thread may drop it meanwhile (MemberDown)
        m = self.membership.get(member_id)
        return m is None or m.state != SUSPECT

    def _graph_neighbours(self, round: int) -> list[str]:
        """Our topology neighbours at ``round`` that we can send to (directly, or through our relay)."""
        view = self._view
        # Every member can be sent to (nobody is behind NAT, counted as members change) and the graph does not
        # change with the round: the neighbours are those of the view
        fixed = not self.topology.time_varying and not self.membership.holds_clients()
        if fixed and self._neighbours_of_view[0] is view:
            return list(self._neighbours_of_view[1])
        try:
            i = view.index(self.me.id)
        except ValueError:
            return []
        try:
            chosen = self.topology.neighbours(len(view), i, round)
        except ValueError as e:
            # The topology does not exist at this size (a degree above the live count under churn,
            # an edge-list file of another size): gossip with everyone rather than with no one.
            if not self._warned_fallback:
                log.warning("topology %s: %s; using the complete graph at %d members", self.topology.spec, e, len(view))
                self._warned_fallback = True
            chosen = self._fallback.neighbours(len(view), i, round)
        # A client-mode member (behind NAT) that has not opened a connection to us yet cannot be sent to; two
        # clients only through a relay. It reaches us when its own turn comes, or its probes and exchanges open
        # the way.
        if fixed:
            neighbours = [view[j] for j in chosen]
            self._neighbours_of_view = (view, neighbours)
            return list(neighbours)
        return [view[j] for j in chosen if self._can_reach_id(view[j], relayed=True)]

    def _sendable(self) -> tuple[str, ...]:
        """The members in our view we can send to now (all of them, unless some are behind NAT).

        For the rendezvous, while it waits (at every heartbeat tick and view change then): whether the view
        holds a client at all is looked at once per view.
        """
        view = self._view
        if not self.membership.holds_clients():
            return view
        return tuple(m for m in view if self._can_reach_id(m))

    def _can_reach_id(self, member_id: str, *, relayed: bool = False) -> bool:
        """Whether we can send to ``member_id``: directly, or (``relayed``: exchanges) through our relay."""
        addr = self._address_of(member_id)
        return addr is None or self.transport.can_reach(addr) or (relayed and self.transport.can_relay(addr))

    def take_on_network(self, kinds_: frozenset[str], handler: Callable[[averaging_events.Event], None]) -> None:
        """Hand exchange messages of ``kinds_`` to ``handler`` as they arrive, on this node's thread.

        The handler also hears of our own messages of those kinds that could not be
        sent (``Undelivered``) and of members that died or left (``MemberGone``).
        """
        self._now_kinds, self._now = frozenset(kinds_), handler

    # -- lifecycle -------------------------------------------------------------------------

    async def _start(self) -> None:
        await super()._start()  # the receive loop
        self.spawn(self._heartbeat_loop(), "heartbeat")
        self.spawn(self.state.run(), "state")
        if self.coordinator:
            self.spawn(self._report_loop(), "report")

    async def leave(self) -> None:
        """Tell everyone we know that we are leaving (best effort, never blocks)."""
        self._apply(self.membership.handle(Leave(), self.clock.now()))
        if self.coordinator:
            self.send(self.coordinator, kinds.REPORT, self._report_body())

    def mark_ready(self) -> None:
        """Our model is final (state downloaded, or none to download): donors may serve it, rendezvous count us."""
        self.state.mark_ready()
        self._send_ready(self.rendezvous.arrive(self.clock.now(), self._sendable()))

    def use_leases(self, samples: int, seed: int) -> LeaseClient:
        """Lease chunks of a dataset of ``samples`` (every member of the run the same: ``data.*``, ``seed``)."""
        if self.leases is None:
            plan = plan_for(samples, self.config.data, seed)
            rng = random.Random(f"{self.me.id}:{seed}")
            self.leases = LeaseClient(self.me.id, plan, self.config.data, live=self.view, now=self.clock.now, rng=rng)
            log.info("leased data: %d samples in %d chunks an epoch", plan.samples, plan.chunks)
        elif self.leases.plan.samples != samples:
            raise ValueError(f"this peer leases a dataset of {self.leases.plan.samples} samples, not {samples}")
        return self.leases

    def wait_for(self, count: int) -> None:
        """Start a rendezvous for ``count`` ready members (us included); ``released`` is set when they are there."""
        self.released.clear()
        self._send_ready(self.rendezvous.wait(count, self.clock.now(), self._sendable()))

    async def seeds_verified(self) -> None:
        """Wait until one of the members our welcome named has answered our probe (or none is left to answer).

        They are candidates until then (``gossiptrain.protocol.candidates``),
        so a newcomer that looked for a donor at once would find nobody. On
        loopback this takes a round trip; it never takes longer than the
        probes' own deadlines (two tries, one protocol period and then two,
        and one more as slack): a seed that has died meanwhile holds nobody
        up.
        """
        deadline = self.clock.now() + 4 * self.membership.period()
        while self.clock.now() < deadline and len(self._view) < 2:
            if not any(mid in self.membership.candidates for mid in self._seeds):
                return
            await self.clock.sleep(self.config.membership.min_probe_timeout)

    # -- sending ---------------------------------------------------------------------------

    def send_exchange(self, action: SendExchange) -> None:
        """Carry out an averaging action (called in the loop thread via call_soon_threadsafe)."""
        addr = self._address_of(action.to)
        body = {"xid": action.xid, **action.meta}
        ok = addr is not None and self.send(addr, action.kind, body, dict(action.tensors))
        if ok:
            return
        # For a protocol period partner choice passes it over; by then membership has probed it.
        self._unsendable_until[action.to] = self.clock.now() + self.config.membership.heartbeat_interval
        if action.kind in self._now_kinds and self._now is not None:
            # At once: a request need not wait out its timeout, a reply's merge is taken back.
            self._now(averaging_events.Undelivered(action.to, action.kind, action.xid))
        elif action.kind == kinds.XPUSH:  # the push comes back to us as its own refusal: its mass is not lost
            self.returns.append(Received(action.to, kinds.XNAK, action.xid, dict(action.tensors), 0, dict(action.meta)))

    def _address_of(self, member_id: str) -> str | None:
        m = self.membership.get(member_id)
        if m is not None:
            return m.addr
        return self._addr_hints.get(member_id)

    # -- relays between clients ------------------------------------------------------------

    def use_relays(self) -> None:
        """As a client-mode member, reach other clients through a relay from now on (``_pick_relay``).

        Call on the node's loop. A secure swarm's client calls this only where
        it can seal what it sends through one (``gossiptrain.net.sealed``).
        """
        self._relays_wanted = True
        self._pick_relay()

    def relays(self) -> list[Member]:
        """The members that relay between clients (``Member.relay``), us excluded, and none under suspicion.

        A suspected relay is left at once: its clients move on a probe's
        timeout, not after the whole suspicion (seconds, so that a slow
        member is not declared dead by mistake), and come back should it
        refute the suspicion.
        """
        return [m for m in self.membership.alive() if m.relay and m.state == ALIVE and m.id != self.me.id]

    def _pick_relay(self) -> None:
        """Our relay to other clients: a member that relays (``gossiptrain peer --relay``), else the coordinator.

        Among several relays each client takes the one that ranks highest for
        it by rendezvous hashing (``relay_rank``): clients spread over the
        relays without talking about it, and when a relay goes (or one comes)
        only the clients it ranks first for move. Any relay will do for any
        pair, since every client probes every reachable member and so keeps a
        route to each; the reply to a relayed request comes back through the
        answerer's own relay.
        """
        if self.transport.client_as is None:
            return
        self._relay_looked_at = self.clock.now()
        relays = self.relays()
        if relays:
            best = max(relays, key=lambda m: relay_rank(self.me.id, m.id))
            address, who = best.addr, f"member {best.id}"
        elif self.coordinator:
            address, who = self.coordinator, "the coordinator"
        else:
            return
        if address != self.transport.relay:
            self.transport.use_relay(address)
            self.stats.relay_changes += 1
            log.info("other peers behind NAT through %s's relay at %s", who, plain_address(address))

    # -- background tasks ------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Tick the membership machine whenever it asks (probe deadlines, period starts, suspicion timers)."""
        floor = self.config.membership.min_probe_timeout / 2  # never spin, whatever a timer says
        while True:
            now = self.clock.now()
            self._apply(self.membership.handle(Tick(), now))
            self.state.tick(now)
            if self._relays_wanted and now >= self._relay_looked_at + self.config.membership.heartbeat_interval:
                self._pick_relay()  # a relay's entry may come without a view change (it replaced a placeholder)
            if self.rendezvous.waiting:  # only then: the members we can send to cost a look at the whole view
                self._send_ready(self.rendezvous.tick(now, self._sendable()))
            leases = self.leases
            if leases is not None:
                self._send_leases(leases, leases.tick())
            wake = min(self.membership.next_timer(), self.rendezvous.next_timer(),
                       leases.next_timer() if leases is not None else math.inf)
            await self.clock.sleep(max(floor, wake - self.clock.now()))

    async def _report_loop(self) -> None:
        while True:
            self.send(self.coordinator, kinds.REPORT, self._report_body())
            await self.clock.sleep(self.config.membership.report_interval)

    def _report_body(self) -> dict[str, Any]:
        """Ourselves, the model's spec, and the members we found dead since the last report (still dead to us).

        The coordinator then stops handing those to newcomers until they
        report again themselves, rather than for as long as its registry
        takes to expire them (``gossiptrain.runtime.coordinator``).
        """
        now = self.clock.now()
        since, self._reported_at = self._reported_at, now
        dead = []
        for when, mid in reversed(self.deaths):
            if when < since or len(dead) >= REPORTED_DEATHS:
                break
            if mid not in self._view and mid not in dead:
                dead.append(mid)
        body = {"member": self.me.to_wire(), "spec": self.spec.to_wire() if self.spec else None, "dead": dead}
        if is_client_address(self.me.addr):  # behind NAT: the coordinator hands us to no newcomer, introduces us to none
            body["unreachable"] = True
        return body

    # -- handling --------------------------------------------------------------------------

    def _on_membership(self, msg: Message, frames: Sequence[object]) -> None:
        event = membership_event(msg, self.config.limits.max_container_len, self.transport.source_of(frames) or "")
        self._apply(self.membership.handle(event, self.clock.now()))

    def _on_exchange(self, msg: Message, frames: Sequence[object]) -> None:
        xid = msg.body.get("xid")
        if type(xid) is not int:
            raise ProtocolError("exchange message without an int xid")
        meta = exchange_meta(msg.body)
        self._remember_addr(msg.sender, msg.addr)
        self._offer(Received(msg.sender, msg.kind, xid, msg.tensors, msg.step, meta))

    def _on_state(self, msg: Message, frames: Sequence[object]) -> None:
        self.state.on_message(msg)

    def _on_piece_hello(self, msg: Message, frames: Sequence[object]) -> None:
        """A split partner's leader asks where our ranks listen (``gossiptrain.runtime.split_partners``): answered at
        its piece link, with our layout and addresses, or refused naming both layouts. Not answered before our ranks
        listen (a split peer joins first, then opens its ranks' links) nor by a whole model's peer (which no split
        swarm admits): the asker asks again later."""
        intro = self.piece_introduction
        if intro is None:
            self.stats.unexpected += 1
            return
        answer = hello_answer(intro[0], intro[1], msg.body)
        answer["steps"] = self.step  # 0: not trained yet, nothing for a newcomer to download (a fresh swarm)
        self.send(msg.addr, kinds.XPWELCOME, answer)

    def _on_reach(self, msg: Message, frames: Sequence[object]) -> None:
        nonce_of(msg.body)  # our join's dial-back, come after its verdict (join_client.reach_verdict): checked, nothing more

    def _on_ready(self, msg: Message, frames: Sequence[object]) -> None:
        ids, go = ready_from_wire(msg.body, self.config.limits.max_container_len)
        self._remember_addr(msg.sender, msg.addr)  # our answer reaches a sender not yet in our view
        self._send_ready(self.rendezvous.handle(msg.sender, ids, go, self.clock.now(), self._sendable()))

    def _on_lease(self, msg: Message, frames: Sequence[object]) -> None:
        leases = self.leases
        if leases is None:
            return  # we lease nothing (yet): the sender's next push comes to someone, or to us later
        self._remember_addr(msg.sender, msg.addr)
        self._send_leases(leases, leases.handle(msg.sender, msg.body))

    def _send_leases(self, leases: LeaseClient, actions: list[SendLeases]) -> None:
        for a in actions:
            addr = self._address_of(a.to)
            if addr is not None:
                self.send(addr, kinds.LEASE, leases.message(a))

    def _send_ready(self, actions: list[SendReady]) -> None:
        for a in actions:
            addr = self._address_of(a.to)
            if addr is not None:
                self.send(addr, kinds.READY, {"ready": list(a.ready), "go": a.go})
        self.ready_count = self.rendezvous.count()
        if self.rendezvous.released and not self.released.is_set():
            self.released.set()

    def _on_finish_message(self, msg: Message, frames: Sequence[object]) -> None:
        self.on_finish(finish_event(msg, self.transport.source_of(frames)))

    def _on_status_ask(self, msg: Message, frames: Sequence[object]) -> None:
        """Answer a visitor's ``status-ask`` with ourselves (``gossiptrain.protocol.status``), within its rate."""
        now = self.clock.now()
        stats = self.transport.stats
        status = {
            "phase": JOINING, "step": self.step, "samples": 0, "exchanges": 0, "staleness_mean": 0.0, "rtt_ms": 0.0,
            "idle_s": 0.0, **self.training_status(),
            "shard": self.me.shard, "members": len(self._view), "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received, "partners": tuple(self.partners(self.step)),
        }
        body = self.status_answerer.answer(join_source(self.transport.source_of(frames), msg.addr), now, status)
        if body is None:
            self.stats.status_throttled += 1
            return
        self.stats.status_answered += 1
        self.send(msg.addr, kinds.STATUS, body)

    def on_finish(self, event: finish.Event) -> None:
        """Feed the end-of-run machine (a message's event, or a local stop or announce) and send what it says."""
        for a in self.finish.handle(event, self.clock.now()):
            self.send(a.addr, a.kind, a.body)

    def _offer(self, event: Received) -> None:
        if event.kind in self._now_kinds and self._now is not None:
            self._now(event)
            return
        if event.kind == kinds.XNAK and event.tensors:  # our push, refused and given back
            self.returns.append(event)
            return
        try:
            self.exchanges.put_nowait(event)
            if event.kind == kinds.XPUSH:  # its receipt: the pusher's link is free (gossiptrain.protocol.receipts)
                self.send_exchange(SendExchange(event.sender, kinds.XACK, event.xid, {}))
        except queue.Full:
            self.stats.exchange_queue_full += 1
            if event.kind in _NEEDS_ANSWER:  # refused at once: a requester moves on, a pusher takes its mass back
                bare = SendExchange(event.sender, kinds.XNAK, event.xid, {})
                self.send_exchange(push_sum.refusal(event) if event.kind == kinds.XPUSH else bare)

    def _gone(self, member_id: str) -> bool:
        m = self.membership.get(member_id)
        return m is not None and m.state in (DEAD, LEFT)

    def _remember_addr(self, member_id: str, addr: str) -> None:
        self._addr_hints[member_id] = addr
        self._addr_hints.move_to_end(member_id)
        while len(self._addr_hints) > _ADDR_HINTS:
            self._addr_hints.popitem(last=False)

    # -- joins (JoinAnsweringEndpoint) --------------------------------------------------------

    def _join_sample(self) -> tuple[Sequence[Member], Callable[[int], int]]:
        # Not a client-mode member: a newcomer could not reach it before it happens to send to the newcomer.
        sample = [m for m in self.membership.sample(self.config.membership.sample_size) if not is_client_address(m.addr)]
        return sample, self.membership.free_shard

    def _coordinator_address(self) -> str:
        return self.coordinator

    def _welcomed(self, newcomer: Member, request: JoinRequest) -> None:
        self._apply(self.membership.handle(Welcomed(newcomer), self.clock.now()))  # a placeholder until it starts

    def _apply(self, actions: list[Any]) -> None:
        changed = False
        met: list[str] = []
        for a in actions:
            if isinstance(a, Send):
                body: dict[str, Any] = {"members": [m.to_wire() for m in a.entries]}
                if a.kind in _PROBES:
                    body["seq"] = a.seq
                if a.challenge:
                    body["challenge"] = a.challenge
                if a.kind == kinds.PING_REQ:
                    body["target"], body["taddr"] = a.target, a.target_addr
                self.send(a.addr, a.kind, body)
            elif isinstance(a, Suspected):
                self.stats.members_suspected += 1
                log.debug("member %s is suspected (by %s)", a.member.id, a.member.by or "?")
            elif isinstance(a, MemberUp):
                self.stats.members_up += 1
                changed = True
                met.append(a.member.id)
                log.debug("member %s is up at %s", a.member.id, a.member.addr)
                self._tell(a)
            elif isinstance(a, MemberDown):
                if a.reason == "left":
                    self.stats.members_left += 1
                else:
                    self.stats.members_dead += 1
                    self.deaths.append((self.clock.now(), a.member.id))
                changed = True
                self.transport.forget(a.member.addr)
                self._unsendable_until.pop(a.member.id, None)
                log.debug("member %s is down (%s)", a.member.id, a.reason)
                self._tell(a)
                if self._now is not None:
                    self._now(averaging_events.MemberGone(a.member.id))
        if changed:
            self._view = self.membership.alive_ids()
            if self._relays_wanted:  # our relay may be gone, or one may have come
                self._pick_relay()
            if self.rendezvous.waiting:  # a member we counted may be gone
                self._send_ready(self.rendezvous.tick(self.clock.now(), self._sendable()))
            self._send_ready(self.rendezvous.met(met))

    def _tell(self, a: MemberUp | MemberDown) -> None:
        """The line people see (``MEMBER_EVENTS``); members already there when we started are not news (DEBUG)."""
        m, extra = a.member, {"peer_id": self.me.id}
        if isinstance(a, MemberUp):
            news = a.rejoined or m.incarnation == 0 or m.incarnation > self._started  # 0: a welcome's placeholder
            _member_events.log(logging.INFO if news else logging.DEBUG, "member %s joined" if news else "member %s is up", m.id, extra=extra)
        elif a.reason == "left":
            _member_events.info("member %s left", m.id, extra=extra)
        elif m.incarnation == 0:
            _member_events.info("member %s died (welcomed, never started)", m.id, extra=extra)
        elif a.suspectors:
            _member_events.info("member %s died (suspected by %s)", m.id, ", ".join(a.suspectors), extra=extra)
        else:
            _member_events.info("member %s died", m.id, extra=extra)


def relay_rank(client: str, relay: str) -> int:
    """Where ``relay`` ranks for ``client`` (highest first): a hash of both ids, the same in every process."""
    return int.from_bytes(hashlib.blake2b(f"{client}\0{relay}".encode(), digest_size=8).digest(), "big")


def membership_event(msg: Message, max_members: int, source: str = "") -> MembershipEvent:
    """The membership event a gossip, sync, leave or probe message carries; ProtocolError if malformed.

    ``source``: the IP it came from, where the transport can tell (what its candidates are charged to).
    """
    body = msg.body
    entries = members_from_wire(body.get("members"), max_members)
    if msg.kind in (kinds.GOSSIP, kinds.LEAVE, kinds.SYNC):
        return Digest(entries, msg.sender, msg.addr, reply=msg.kind == kinds.SYNC, source=source)
    seq = body.get("seq")
    if type(seq) is not int or not 0 <= seq < 1 << 63:
        raise ProtocolError(f"{msg.kind} without a valid seq")
    if msg.kind == kinds.PING:
        return Ping(msg.sender, msg.addr, seq, entries, source)
    if msg.kind == kinds.ACK:
        challenge = body.get("challenge", 0)
        if type(challenge) is not int or not 0 <= challenge < 1 << 63:
            raise ProtocolError("ack with an invalid challenge")
        return Ack(msg.sender, seq, entries, source, challenge)
    target = Member.from_wire([body.get("target"), body.get("taddr"), 0, 0, ALIVE, ""])  # validates both
    return PingReq(msg.sender, msg.addr, seq, target.id, target.addr, entries, source)


def exchange_meta(body: dict[str, Any]) -> dict[str, float | int]:
    """The scalars of an exchange message's body (``averaging_events.META_RANGES``), checked; ProtocolError if bad."""
    out: dict[str, float | int] = {}
    for key, (kind, lo, hi) in averaging_events.META_RANGES.items():
        if key not in body:
            continue
        value = body[key]
        if kind is float:
            ok = type(value) is float and lo < value <= hi  # NaN fails both comparisons
        else:
            ok = type(value) is int and lo <= value <= hi
        if not ok:
            raise ProtocolError(f"exchange field {key!r} must be a {kind.__name__} in range, got {type(value).__name__}")
        out[key] = value
    return out
