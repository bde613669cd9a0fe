"""Asynchronous pairwise averaging (AD-PSGD): the default algorithm.

One exchange: the initiator sends its model ``s_a`` to a partner; the
partner replies with its own ``s_b`` and moves by ``a (s_a - s_b)``; when the
reply arrives the initiator moves by ``a (s_b - s_a)`` (``a`` = 1/2 without
staleness weighting). Adding the difference instead of overwriting with the
average keeps the local steps the initiator took while the exchange was in
flight (Lian et al., AD-PSGD).

**Invariant.** The sum of every member's model, plus the corrections that
replies in flight owe their requesters, changes only by local (optimizer)
steps: an exchange is applied on both sides or on neither. The pieces:

- *Requests are answered at once, never waiting for the training loop.*
  The network side handles requests and replies as they arrive
  (``network_kinds``), against ``view``: our model as of the last safe point
  (``base``, a frozen copy the safe point takes) plus every merge since
  (``pending``, which the next safe point adds to the live parameters: only
  the training loop touches those). A loop paused for evaluation, a
  checkpoint or slow data costs its partners nothing, and no request waits in
  a queue to be served after its requester gave up. A reply goes out before
  the server's own merge is computed (``after_send``): that arithmetic is off the
  exchange's critical path.
- *A late reply is applied, not dropped.* A timeout only lets us start
  another exchange; the timed-out one stays remembered (the latest
  ``OVERDUE_KEPT`` of them, for ``OVERDUE_SECONDS``), and its reply, whenever
  it comes, is applied as if on time. Only a reply later than the horizon, or
  than ``OVERDUE_KEPT`` newer timeouts, is abandoned (``stats.abandoned``,
  with a warning): by then it is most likely lost, and waiting for it would
  stop the peer averaging; one from a member we saw die is forgotten quietly
  (its model left the swarm with it).
- *A reply we could not send is taken back*: the driver reports it
  (``Undelivered``) and the server undoes its merge.
- *Crossing requests* (two peers asking each other at once) are served by
  the smaller id only, so the pair averages once instead of swapping.

The one fault this cannot absorb is a reply the network loses after it was
sent (a connection that breaks with the message in it, which in practice
means the requester died); the server has moved, the requester never will.

**Exchanges in flight.** Where the link's latency alone takes more than a
local step (a WAN), a peer keeps up to ``concurrency()`` exchanges in flight, with
different partners, each asking for weight ``1/(k+1)``; the partner answers
with at most what it can take (the reply's ``a``, which both ends apply).
What may be taken back of the model a peer sent (its exchanges in flight,
and the requests it served since) adds to at most 1 (``_committed``), so
every model stays in the convex hull of the swarm's; a request beyond that
is refused (``busy``). Each timeout adapts to measured round trips (as TCP's
RTO does), so a dead or slow partner costs one timeout and is then avoided
for a while; it never blocks training for longer.

**Flow control.** A peer may take at most ``gossip.max_steps_ahead`` local
steps (``averaging.AUTO_STEPS_AHEAD`` by default, more on a far link:
``flow_bound``) past its last merge; past that, its safe point waits for the
exchange in flight (``hold_until``), never past that exchange's timeout, and
not at all for a partner that timed out lately (a stopped or dead one costs
one timeout, then is avoided, see ``_avoid``). On a link fast enough for a
round trip within the bound nothing waits; on a slow one, peers compute at
the link's pace instead of drifting toward their own shards (overlap-bounded
SGP does the same).
"""

from __future__ import annotations

import logging
import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.net.kinds import XNAK, XREP, XREQ
from gossiptrain.protocol.averaging import AUTO_STEPS_AHEAD, Averaging
from gossiptrain.protocol.averaging_events import (
    Action,
    AtSafePoint,
    Event,
    MemberGone,
    Received,
    Rejected,
    SendExchange,
    Undelivered,
    wire_bytes,
)
from gossiptrain.protocol.compression import AutoCodec
from gossiptrain.protocol.merges import PendingMerges
from gossiptrain.protocol.rtt import RttEstimator
from gossiptrain.protocol.stability import NORM_RATIO

log = logging.getLogger(__name__)


#: Timed-out pairwise exchanges remembered so that a late reply is still applied (each holds one model copy);
#: past that many, the oldest is given up (its reply most likely lost).
OVERDUE_KEPT = 4
#: How long a timed-out exchange's reply is still applied; later, the exchange is abandoned.
OVERDUE_SECONDS = 120.0
#: Automatic exchanges in flight (``gossip.exchanges_in_flight = 0``): at most this many at once...
MAX_IN_FLIGHT = 3
#: ...and a second one only once the latency takes more than this many steps over one.
ROUND_TRIP_SLACK = 0.5
#: Automatic flow control on a far link: at most this many steps past a round trip (``PairwiseAveraging.flow_bound``)...
ROUND_TRIP_STEPS_AHEAD = 2
#: ...and never more than this many in all: past it, peers on skewed shards drift apart faster than merges pull them
#: together (real processes, 50 ms each way, a round trip of 70 steps: unbounded, non-finite after 33 s).
MAX_AUTO_STEPS_AHEAD = 3 * AUTO_STEPS_AHEAD
#: A request is refused (busy) rather than served with a mixing weight below this (see PairwiseAveraging._committed).
MIN_SHARE = 0.1


def steps_ahead(asked: int, least: int, round_trip_steps: float | None) -> int:
    """Flow control's bound (``PairwiseAveraging.flow_bound``, whose docstring has the measurements): ``asked``
    (``gossip.max_steps_ahead``) where given, else at least ``least`` and a round trip of the link in local steps
    plus ``ROUND_TRIP_STEPS_AHEAD``, at most ``MAX_AUTO_STEPS_AHEAD``."""
    if asked or round_trip_steps is None:
        return asked or least
    return max(least, min(MAX_AUTO_STEPS_AHEAD, math.ceil(round_trip_steps) + ROUND_TRIP_STEPS_AHEAD))


@dataclass
class _InFlight:
    xid: int
    partner: str
    snapshot: list[torch.Tensor]
    sent_at: float
    deadline: float  # the timeout: then the partner is avoided for a while and the reply waited for as overdue
    expected_by: float  # past this (replies usually come much sooner) it is presumed lost (see _live) until its deadline
    share: float = 0.5  # the mixing weight we asked for (the partner may answer with less: its reply's "a")
    served_meanwhile: float = 0.0  # the weights of the requests we served while this one was in flight (see _serve)
    may_hold: bool = True  # flow control may wait for it (not when the partner was one we are avoiding)
    nbytes: int = 0  # of the request on the wire
    presumed_lost: bool = False  # its reply is far later than replies come (expected_by passed)
    partner_gone: bool = False  # membership declared the partner dead or gone (MemberGone)


@dataclass
class _Served:
    """A request we served: we move by ``a (remote - sent)``, computed once the reply is out, undone if it never was."""

    xid: int
    to: str
    remote: list[torch.Tensor]
    sent: list[torch.Tensor]
    a: float
    delta: list[torch.Tensor] | None = None  # remote - sent, once computed (_settle)



class PairwiseAveraging(Averaging):
    """AD-PSGD pairwise averaging; requests and replies are handled on the network side (see the module).

    Both ends of an exchange move by the same mixing weight ``a`` toward each
    other (0.5 without staleness weighting): the server picks it from the
    step difference and sends it with its reply, so the two changes still
    sum to zero. With a lossy codec each end moves toward what the other
    decoded, ``x += a * (D(C(x_remote)) - D(C(x_own)))``, which keeps the
    sum zero too.

    ``view`` is our model as others see it: ``base`` (a frozen copy of the
    live parameters taken at the last safe point) plus ``pending`` (the
    merges made since); the live parameters are ``view`` plus the local steps
    taken since that safe point. Snapshots are never written once taken, so
    they go on the wire as they are and their encoding is kept for the next
    message that sends the same model (``_encoded``).
    """

    network_kinds = frozenset({XREQ, XREP, XNAK})
    reports_moves = True  # a safe point adds ``pending`` and nothing else

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        super().__init__(params, config, rng, me)
        self.rtt = RttEstimator(config.exchange_timeout_min, config.exchange_timeout_max)
        self._base = self._frozen(self.params)  # the live parameters at the last safe point (never written)
        self._view: list[torch.Tensor] | None = self._base  # base + pending, frozen; None: not computed since a merge
        self._pending = PendingMerges(self.params, self.buffers)  # merges not yet added to the live parameters
        self._unsettled: _Served | None = None  # a reply sent whose merge is not computed yet (_settle)
        # the last view encoded, the codec (level) it was encoded at, and the encoding: sent again as it is
        self._encoded: tuple[list[torch.Tensor], str, tuple[dict[str, torch.Tensor], list[torch.Tensor]]] | None = None
        self._inflight: dict[int, _InFlight] = {}  # xid -> our exchange in flight, oldest first
        self._overdue: OrderedDict[int, _InFlight] = OrderedDict()  # timed out, reply still welcome
        self._last_served: _Served | None = None  # the last request served, with its merge: to undo
        self._last_start_step = -(10**9)
        self._avoid_until: dict[str, float] = {}
        self._ready = False  # before our first safe point the model may still be replaced (state transfer)
        self._merged_at_step = 0  # our step at the last merge (completed or served): flow control counts from it
        self._latency: float | None = None  # the link's round trip without queues, from the last safe point

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    @property
    def view(self) -> list[torch.Tensor]:
        """Our model as partners see it now: ``base`` plus the merges made since (frozen: do not write to it).

        For inspection (tests); like every call into the machine, with the driver's lock held.
        """
        self._settle()
        return self._current()

    @property
    def pending(self) -> list[torch.Tensor]:
        """The merges made since the last safe point, which the next one adds to the live parameters (as ``view``)."""
        self._settle()
        return self._pending.values()

    def serve_as_is(self) -> None:
        if not self._ready:  # nothing merged yet (requests were refused): the model others see is the live one
            self._base = self._view = self._frozen(self.params)  # a downloaded state replaced the parameters in place
            self._ready = True

    def model_put_back(self) -> None:
        """Forget the merges computed from the model the guard discarded, and serve the one it put back.

        Partners were served ``base`` (the discarded model) and our requests in
        flight carried it: their replies would add ``a (s_b - s_discarded)``,
        and the merges served since the safe point ``a (s_r - s_discarded)``,
        to the model put back, which is the blow-up again. On real processes
        (experiments/user_loop.py, quasi-global momentum asked for on a skewed
        100 Mbit/s link) restored models went non-finite again within 20-50
        steps, hundreds of times, until this was done. The partners keep what
        they merged: that part of the blow-up is theirs to catch.

        Then, while the guard lets the run settle (``StabilityGuard.settling``:
        a sign within its grace), the peer neither starts exchanges nor serves
        any: partners whose models blew up pulled restored ones straight back
        up (a plain-averaging peer's norm grew 2e17 times in 16 steps), and a
        peer in the middle of a blow-up would hand it on.
        """
        self._settle()
        self._pending.clear()
        self._last_served = None  # its merge is gone with pending: nothing to take back should its reply be lost
        self.stats.put_back += len(self._inflight) + len(self._overdue)
        self._inflight.clear()  # their replies, when they come, are to exchanges we no longer know (stats.late)
        self._overdue.clear()
        self._base = self._frozen(self.params)
        self._merged()

    def after_send(self) -> None:
        self._settle()

    def _settle(self) -> None:
        served = self._unsettled
        if served is not None:
            self._unsettled = None
            served.delta = self._pending.difference(served.remote, served.sent)  # kept to undo this merge
            self._pending.add(served.delta, served.a)  # ...and held as pending's sum while it is the only merge
            served.remote = served.sent = []  # an undo needs only the delta: let the received frames go

    def hold_until(self, now: float) -> float | None:
        deadlines = [x.expected_by for x in self._live() if x.may_hold and now < x.expected_by]
        if not deadlines or self._step - self._merged_at_step < self.flow_bound():
            return None
        return min(deadlines)  # the driver asks again after each merge: one completed exchange lets the loop go on

    def handle(self, event: Event, now: float) -> list[Action]:
        self._settle()
        if isinstance(event, AtSafePoint):
            return self._tick(event, now)
        if isinstance(event, Received):
            if event.kind == XREQ:
                return self._serve(event)
            if event.kind == XREP:
                return self._complete(event, now)
            if event.kind == XNAK:
                return self._refused(event, now)
            return []  # another algorithm's message (a misconfigured sender): ignore
        if isinstance(event, Undelivered):
            return self._undelivered(event)
        if isinstance(event, MemberGone):
            # A reply it sent before it went may still be on the wire, carrying the other half of its merge: it is
            # applied if it comes; if not, the exchange is given up quietly (its model left the swarm with it).
            for x in [*self._inflight.values(), *self._overdue.values()]:
                if x.partner == event.member:
                    x.partner_gone = True
            return []
        raise TypeError(f"unknown event {event!r}")

    # -- the safe point ----------------------------------------------------------------------

    def _tick(self, tick: AtSafePoint, now: float) -> list[Action]:
        self._at_step(tick.step, now)
        self._latency = tick.latency
        self._ready = True
        self._apply_pending()
        self._expire(now)
        for inflight in list(self._inflight.values()):
            if now >= inflight.expected_by and not inflight.presumed_lost:
                inflight.presumed_lost = True  # far later than replies come: most likely lost
                self.stats.presumed_lost += 1
            if now >= inflight.deadline:
                self.stats.timeouts += 1
                self.rtt.backoff()
                self._link_measured(now - inflight.sent_at, inflight.nbytes)  # it took at least that long
                self._avoid(inflight.partner, now)
                del self._inflight[inflight.xid]
                self._overdue[inflight.xid] = inflight
        while len(self._overdue) >= OVERDUE_KEPT:
            # That many replies outstanding: the oldest is most likely lost, not late (a dropped message, a relay
            # past its budget). Waiting for it would stop this peer averaging for up to OVERDUE_SECONDS (with 1%
            # of messages lost, for good after a few seconds: experiments/latency_loss.py); give it up instead.
            gone = [xid for xid, x in self._overdue.items() if x.partner_gone]
            oldest = gone[0] if gone else next(iter(self._overdue))
            self._abandon(self._overdue.pop(oldest), f"{OVERDUE_KEPT} newer exchanges timed out since")
        if self.settling:  # a blow-up lately (model_put_back): neither take one from partners nor give them ours
            return []
        k = self.concurrency()
        if len(self._live()) >= k or len(self._inflight) >= 2 * k or tick.step - self._last_start_step < self.config.exchange_every_steps:
            return []
        asked = {x.partner for x in self._inflight.values()}
        partner, healthy = self._pick([p for p in tick.partners if p not in asked], now)
        if partner is None:
            if not tick.partners:
                self._merged_at_step = tick.step  # alone: nobody to drift from, nothing to wait for
            return []
        encoded = self._encode_view()  # == the live parameters: pending was just applied
        if encoded is None:
            return []
        wire, sent = encoded
        xid = self._new_xid()
        share = 1.0 / (k + 1)  # 1/2 with one exchange in flight, 1/(k+1) with up to k
        deadline = now + self.rtt.timeout()
        # Presumed lost a few typical round trips late (rtt.LATE_ROUND_TRIPS), well before its patient timeout:
        # waiting for that on every lost message stalled peers for seconds with 1% of messages lost
        # (experiments/latency_loss.py). One presumed lost holds no one: see _live.
        self._inflight[xid] = _InFlight(xid, partner, sent, now, deadline, self.rtt.presumed_lost_at(now, deadline),
                                        share=share, may_hold=healthy, nbytes=wire_bytes(wire))
        self._last_start_step = tick.step
        self.stats.started += 1
        self.stats.in_flight_most = max(self.stats.in_flight_most, len(self._inflight))
        meta: dict[str, float | int] = {"ver": self.version}
        if share < 0.5:
            meta["a"] = share
        if self.norm is not None and self.norm > 0:  # (a model of zeros has no norm to compare)
            meta["norm"] = self.norm
        return [SendExchange(partner, XREQ, xid, wire, meta)]

    def concurrency(self) -> int:
        """How many exchanges we may have in flight: ``gossip.exchanges_in_flight``, or as many as the latency takes steps.

        On a far link (a WAN), whose latency alone takes several local steps,
        one exchange per round trip averages too rarely to hold peers on
        skewed shards together; a few at once, each with a smaller weight, do
        (experiments/latency_loss.py). The latency is that of small messages
        (``AtSafePoint.latency``), not the exchanges' own round trip: on a
        near link that is only busy (a shared 100 Mbit/s one), exchanges at
        once share its bytes and each takes as much longer. On a near link
        this is 1.
        """
        if self.config.exchanges_in_flight:
            return self.config.exchanges_in_flight
        steps = self.round_trip_steps(self._latency)
        if steps is None:
            return 1
        return max(1, min(MAX_IN_FLIGHT, math.ceil(steps - ROUND_TRIP_SLACK)))

    def flow_bound(self) -> int:
        """Flow control's bound: ``gossip.max_steps_ahead``, or ``AUTO_STEPS_AHEAD`` and at least a round trip.

        No merge can come sooner than a round trip of the link after the
        request left. Where that alone took more steps than the bound (a far
        link), a peer with few partners to ask waited at most safe points:
        simulated, 4 skewed peers, 10 ms steps, 50 ms each way, the first
        peers lost a quarter of their steps while the swarm gathered, and at
        100 ms each way a peer ran at half speed for the whole run. So the
        automatic bound is the round trip in steps plus ``ROUND_TRIP_STEPS_AHEAD``
        (experiments/latency_loss.py's setting: 50 ms, seeds 0-4, sampled
        every 0.05 s, 2.5 s median to the target against 2.7 s; 100 ms, the
        experiment's seeds 0-2, 3.75-9.25 s against 5.0-9.5 s). On a near
        link nothing changes. On a link far beyond that the bound stops at
        ``MAX_AUTO_STEPS_AHEAD`` and peers compute at the link's pace again:
        real processes (experiments/real_delay.py, 50 ms each way, steps of
        about 1.7 ms, a round trip of 70 of them, seed 0) reached the target
        in 7.1 s with 8, 9.2 s with 16, 7.4 s with 24, and unbounded drifted
        apart until their models were non-finite after 33 s.
        """
        return steps_ahead(self.config.max_steps_ahead, self.max_ahead, self.round_trip_steps(self._latency))

    def _committed(self) -> float:
        """The weights our exchanges in flight may still take back of the model we sent, and what we served since.

        A reply moves us by ``a (s_partner - s_sent)``, taking back a share ``a``
        of what we sent; served requests since it left took shares too. While
        the shares add to at most 1 our model still holds what each reply takes
        back, so every merge stays in the convex hull of the models.
        """
        live = self._live()
        return sum(x.share for x in live) + max((x.served_meanwhile for x in live), default=0.0)

    def _live(self) -> list[_InFlight]:
        """Our exchanges in flight not presumed lost.

        One presumed lost holds no one: not the loop (flow control), not a
        place among ``concurrency``, not a share of ``_committed``. Should its
        reply come after all, it is applied, and the shares taken back may
        then add to a little over 1 (rare: most are lost).
        """
        return [x for x in self._inflight.values() if not x.presumed_lost]

    def _apply_pending(self) -> None:
        """Add the merges made since the last safe point to the live parameters, and take a new ``base``."""
        self._pending.add_to(self.params)
        self._moved = self._pending.moved()  # for the drift correction (take_moved): what this safe point added
        self._pending.clear()
        self._base = self._view = self._frozen(self.params)
        # _last_served stays undoable through pending: the network side releases the lock between our reply
        # and its failed send, so a safe point may apply the merge before the Undelivered comes back.

    def _current(self) -> list[torch.Tensor]:
        """``view``, computed once after each merge (the merge itself only adds to ``pending``)."""
        if self._view is None:
            view = self.buffers.like(self.params)
            self._pending.plus(self._base, view)
            self._view = view
        return self._view

    def _encode_view(self) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]] | None:
        """``view`` encoded to send (``_encode_own``); a view sent again is not encoded again (the codecs keep no state)."""
        values = self._current()
        cached = self._encoded
        if cached is not None and cached[0] is values and cached[1] == self.codec.name:
            return cached[2]
        encoded = self._encode_own(values)
        if encoded is not None:
            self._encoded = (values, self.codec.name, encoded)
        return encoded

    def _pick(self, partners: Sequence[str], now: float) -> tuple[str | None, bool]:
        """A partner, preferring those that have not timed out lately; and whether it is one of those."""
        if not partners:
            return None, False
        fresh = [p for p in partners if self._avoid_until.get(p, 0.0) <= now]
        return self.rng.choice(fresh or list(partners)), bool(fresh)

    def _avoid(self, partner: str, now: float) -> None:
        self._avoid_until[partner] = now + 4 * self.rtt.timeout()

    # -- merging (network side) ----------------------------------------------------------------

    def _merged(self) -> None:
        """Note a merge: ``view`` moves (``pending`` takes by how much, now or once the reply is sent: ``_settle``)."""
        self._view = None
        self.version += 1
        self._merged_at_step = self._step

    # -- answering -------------------------------------------------------------------------

    def _serve(self, msg: Received) -> list[Action]:
        if not self._ready:  # our model is not the one we will train yet: the requester asks someone else
            self.stats.busy += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        if self.settling:
            self.stats.settling += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        if self._norms_apart(msg.meta.get("norm")):
            self.stats.norm_apart += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        if self.me > msg.sender and any(x.partner == msg.sender for x in self._inflight.values()):
            # We asked each other at the same time. Serving both requests would not average the
            # two models but swap them (each side adds the other's difference twice). The smaller
            # id serves; we refuse, and our own request will be answered.
            self.stats.crossed += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        share = min(float(msg.meta.get("a", 0.5)), 1.0 - self._committed())
        if share < MIN_SHARE:
            # Our replies in flight will each take back their share of what we sent (see _committed): serving
            # more now could leave the convex hull of the models (and overshoot). With one exchange in flight
            # at 1/2, one request is served meanwhile.
            self.stats.busy += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        remote = self._validated(msg)
        if isinstance(remote, Rejected):
            return [remote, SendExchange(msg.sender, XNAK, msg.xid, {})]
        weight = self._staleness_weight(msg, symmetric=True)  # both ends must agree: |step difference|
        if weight is None:
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        encoded = self._encode_reply(msg)
        if encoded is None:
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        wire, sent = encoded
        clip = self._clip_factor(remote, sent, msg.sender)
        if clip is None:
            return [Rejected(msg.sender, "difference far beyond recent ones (robust)"), SendExchange(msg.sender, XNAK, msg.xid, {})]
        a = share * weight * clip
        self._last_served = self._unsettled = _Served(msg.xid, msg.sender, remote, sent, a)  # moved by _settle
        self._merged()
        self.stats.served += 1
        self._record_staleness(msg)
        for x in self._live():
            x.served_meanwhile += a
        return [SendExchange(msg.sender, XREP, msg.xid, wire, {"a": a, "ver": self.version})]

    def _norms_apart(self, theirs: object) -> bool:
        """Whether the requester's model norm (its guard's, in the request) and ours are ``NORM_RATIO`` apart: one of
        the two blew up, and averaging would hand it on. Decided here, on the server, before either side moves."""
        ours = self.norm
        if ours is None or type(theirs) is not float or not math.isfinite(theirs) or theirs <= 0 or ours <= 0:
            return False
        return max(theirs, ours) > NORM_RATIO * min(theirs, ours)

    def _encode_reply(self, request: Received) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]] | None:
        """Our model for a reply, with ``auto`` at least as lossy as the request.

        A requester that measured its link slow enough for int8 gets int8 both
        ways, so that its exchanges are as short as its level makes them and
        the trial of that level (``protocol.auto_compression``) measures the
        level, not the partner's. Before, 4 peers on a 100 Mbit/s link ended on
        mixed levels: those at none judged int8 no shorter, because their
        partners answered at none, and went back (experiments/wan.py, skewed
        digits-small, seed 0: 1.32 s to the target against 0.54 s at int8).
        """
        codec = self.codec
        if not isinstance(codec, AutoCodec):
            return self._encode_view()
        own = codec.level
        codec.level = max(own, codec.level_of(request.tensors))
        try:
            return self._encode_view()
        finally:
            codec.level = own

    def _undelivered(self, event: Undelivered) -> list[Action]:
        if event.kind == XREQ:  # our request never left: as a refusal
            return self._refused(Received(event.to, XNAK, event.xid), 0.0)
        served = self._last_served
        if event.kind == XREP and served is not None and served.xid == event.xid and served.to == event.to:
            # The requester will never apply its half: take ours back (pending, or in the model already: the next
            # safe point subtracts it there). handle computed it first (_settle), so its delta is there.
            assert served.delta is not None
            self._pending.add(served.delta, -served.a)
            self._view = None
            self._last_served = None
            self.stats.served -= 1
            self.stats.undelivered += 1
        return []

    def _complete(self, msg: Received, now: float) -> list[Action]:
        inflight = self._inflight.get(msg.xid)
        on_time = inflight is not None and inflight.partner == msg.sender
        if not on_time:
            inflight = self._overdue.get(msg.xid)
            if inflight is None or inflight.partner != msg.sender:
                self.stats.late += 1
                if inflight is None:  # not ours, or abandoned already (counted then)
                    log.debug("a reply from %s to an exchange we do not know (xid %d)", msg.sender, msg.xid)
                return []
            del self._overdue[msg.xid]
            self.stats.late += 1
        else:
            del self._inflight[msg.xid]
        assert inflight is not None
        remote = self._validated(msg)
        if isinstance(remote, Rejected):
            return [remote]
        # The server already moved by this weight; robust mode may move us less (then the pair's sum changes).
        clip = self._clip_factor(remote, inflight.snapshot, msg.sender)
        if clip is None:
            return [Rejected(msg.sender, "difference far beyond recent ones (robust)")]
        a = float(msg.meta.get("a", 0.5)) * clip
        # keep local progress made in flight: x <- x + a * (x_remote - x_sent)
        self._merged()
        self._pending.add_difference(remote, inflight.snapshot, a)
        if now <= inflight.deadline:  # before its timeout (if after its presumed loss): the link as it is now
            self.rtt.observe(now - inflight.sent_at)
            self.stats.round_trip(now - inflight.sent_at, self.rtt.srtt)
            self._link_measured(now - inflight.sent_at, inflight.nbytes)
        self.stats.completed += 1
        self._record_staleness(msg)
        return []

    def _refused(self, msg: Received, now: float) -> list[Action]:
        # A refusal costs no waiting (the partner was busy, or we crossed), so unlike a timeout
        # it does not make us avoid the partner.
        inflight = self._inflight.get(msg.xid)
        if inflight is not None and inflight.partner == msg.sender:
            del self._inflight[msg.xid]
            self.stats.refused += 1
        elif msg.xid in self._overdue and self._overdue[msg.xid].partner == msg.sender:
            del self._overdue[msg.xid]  # refused after all: nothing to wait for
            self.stats.refused += 1
        return []

    # -- overdue exchanges ---------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        self._forget(lambda x: now - x.sent_at > OVERDUE_SECONDS, f"no reply in {OVERDUE_SECONDS:.0f} s")

    def _forget(self, which: Callable[[_InFlight], bool], why: str) -> None:
        for xid in [xid for xid, x in self._overdue.items() if which(x)]:
            self._abandon(self._overdue.pop(xid), why)

    def _abandon(self, exchange: _InFlight, why: str) -> None:
        if exchange.partner_gone:
            log.debug("gave up on the exchange with %s, which is gone (%s)", exchange.partner, why)
            return
        self.stats.abandoned += 1
        log.warning(
            "gave up on the exchange with %s (%s): if its reply still comes, the pair's sum will have moved",
            exchange.partner, why,
        )
