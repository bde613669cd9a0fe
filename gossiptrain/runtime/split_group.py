"""A peer whose model is split across its ranks, at its safe points: every rank averages its own piece (issue 48).

Each rank holds a piece (``gossiptrain.protocol.pieces``: its FSDP2 shard
of every parameter, or its pipeline stage) and a socket of its own
(``PieceLink``); ``RankExchanges`` keeps its side of every exchange. What
makes the ranks one peer is the safe point, which every rank of the group
calls after the same local step (FSDP2 and pipelines step in lockstep):

1. one gather over the group carries each rank's view of the exchanges it
   asked for (``Status``), the held merges past their deadline, and from
   the leader (rank 0) the outcomes partners' leaders told it and the
   exchange to start, if any;
2. from that, every rank computes the same decisions: an exchange of ours
   every rank has the reply to is committed on all, one any rank failed is
   aborted on all (the leader tells the partner's leader), a partner's
   outcome is applied or dropped on all, and a held merge past its
   deadline on any rank is dropped on all;
3. the merges are added to the pieces; the partners' requests that every
   rank holds are answered from the pieces as they now are (so every rank
   answers one request from the same safe point, whenever its copy came);
   and every rank sends its piece to the same rank of the partner for the
   new exchange (as soon as the last one of ours is decided, in the same
   safe point); the drift correction, where the swarm runs it, goes into the
   piece once the merges are in (``PieceMethods``: every rank by the same
   numbers, the leader's measure of the link among them).

**Automatic compression** (``gossip.compression = auto``): the leader runs
a whole-model peer's policy (``AutoCompression``) on its own exchanges'
times and bytes and its step time, and its level rides in the gather: every
rank encodes at it from that safe point on.

**Flow control**, as a whole-model peer's (``pairwise.steps_ahead``): past
the leader's bound of local steps since the last merge, with an exchange of
ours in flight, the safe point ends ``held`` on every rank alike, and every
rank runs another, without a local step, until the exchange is decided. The
leader asks for a hold only while the exchange is younger than its link
makes a reply late (``RttEstimator.late_after``: two typical round trips,
``FIRST_HOLD`` before any was measured), so a dead or slow partner holds
the group that long, not for the exchange's whole timeout. The drift
correction and the guard count local steps, not a hold's safe points: the
correction measures every merge of a step's safe points and corrects once,
at the last; the guard judges once a step.

**State transfer** runs rank by rank with the protocol whole-model peers
use, over each rank's own socket (``PieceTransfer``).

One gather per safe point, of a few hundred bytes: the bytes of the model
go over the ranks' own sockets, never through rank 0. A rank that dies
makes the group's next collective fail on the others (gloo: the connection
closes): the error goes up to the peer, which leaves; partners' exchanges
with it abort on their side (no reply, or no outcome by the deadline), so
no half-applied exchange is left anywhere.

Which partner is the leader's to say (``start``); where its ranks listen,
and whether its layout is ours, the leaders swap before their first
exchange (``meet``: a hello to the partner's leader, answered with its
layout and its ranks' addresses, or refused naming both layouts). The
swarm's membership will name the partners once split peers join (not
built yet: this driver is exercised by tests/test_split_group.py).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from gossiptrain.config import GossipConfig, Limits, SecurityConfig, StateConfig
from gossiptrain.errors import GossipError, ProtocolError
from gossiptrain.net.transport import listen
from gossiptrain.protocol.auto_compression import AutoCompression
from gossiptrain.protocol.averaging import AUTO_STEPS_AHEAD
from gossiptrain.protocol.compression import AutoCodec, Codec
from gossiptrain.protocol.drift import keeps_running_stats
from gossiptrain.protocol.momentum import LINK_BOUND_SHARE
from gossiptrain.protocol.piece_exchange import Outcome, PieceStats, RankExchanges, Status, decide, welcome_addresses
from gossiptrain.protocol.pieces import PieceLayout, local_piece, piece_entries
from gossiptrain.protocol.rtt import RttEstimator
from gossiptrain.protocol.staleness import StalenessPolicy
from gossiptrain.protocol.step_timer import StepTimer
from gossiptrain.runtime.loop_thread import LoopThread
from gossiptrain.runtime.peer_group import PeerGroup
from gossiptrain.runtime.piece_link import PieceLink
from gossiptrain.runtime.piece_methods import PieceMethods
from gossiptrain.runtime.piece_transfer import PieceTransfer
from gossiptrain.runtime.safepoint import WaitShare

log = logging.getLogger(__name__)

#: The weight of a piece exchange (one in flight at a time: pairwise averaging's 1/2).
SHARE = 0.5
#: Flow control: how long the group holds for an exchange before any reply was measured (seconds).
FIRST_HOLD = 2.0


@dataclass(frozen=True)
class Partner:
    """The peer to average with next, as the leader knows it: its id, the address of each of its ranks, and the
    steps it had taken when it answered our hello (0: a peer that has not trained, with nothing to download)."""

    id: str
    addresses: tuple[str, ...]
    steps: int = 0


class SplitGroup:
    """One rank's side of its split peer's exchanges (see the module docstring). Collective: construct it, call
    ``safe_point`` and ``close`` on every rank of ``group`` alike."""

    def __init__(
        self,
        group: Any,
        model: torch.nn.Module,
        *,
        me: str,
        host: str,
        fingerprint: str,
        loop: LoopThread,
        timeout: float,
        clock: Callable[[], float],
        limits: Limits | None = None,
        seed: int = 0,
        codec: Codec | None = None,
        gossip: GossipConfig | None = None,
        steps: StepTimer | None = None,
        security: SecurityConfig | None = None,
        state: StateConfig | None = None,
    ) -> None:
        self.group = PeerGroup(group)
        self.rank = self.group.rank
        self.me = me
        self.clock = clock
        self.loop = loop
        self.layout: PieceLayout = self.group.layout(model)
        if self.layout.kind == "whole":
            raise ValueError("every rank holds the whole model: a DDP peer averages through its rank 0 (Peer(group=...))")
        self.lock = threading.RLock()  # the training side's safe point and the link's network side
        staleness = (StalenessPolicy(gossip.staleness_weighting, gossip.staleness_exponent, gossip.staleness_bound)
                     if gossip is not None else None)
        self.exchanges = RankExchanges(local_piece(model), piece_entries(model), timeout=timeout, codec=codec,
                                       staleness=staleness)
        limits = limits or Limits()
        self._local_steps = 0
        self._rng = random.Random(f"{me}/{seed}")
        # State transfer, rank by rank: this rank serves its piece to the same rank of newcomers, and as a newcomer
        # downloads it from the same rank of donors (``download``)
        self.transfer = PieceTransfer(self.group, self.exchanges, model, me=me, loop=loop, lock=self.lock,
                                      limits=limits, state=state, rng=self._rng)
        # (security: CURVE with the peer's keys, every rank alike: partners' ranks dial the addresses, keys in them,
        # that the leaders swap)
        self.link = PieceLink(listen(f"tcp://{host}:0", limits, security=security), limits, self.exchanges, sender=me,
                              fingerprint=fingerprint, clock=clock, transfer=self.transfer.endpoint, lock=self.lock)
        self.transfer.link = self.link
        loop.run(self.link.start(timeout=10), timeout=15)
        # Every rank's address, and whether its piece of the model keeps running statistics (one rank's BatchNorm
        # turns the drift correction off on every rank: the gain is the model's)
        shared = self.group.all_json([self.link.address, keeps_running_stats(model)])
        self.addresses: tuple[str, ...] = tuple(address for address, _ in shared)
        # The methods beyond plain averaging (gossip given: the peer's configuration; None: plain averaging)
        self.methods = (PieceMethods(self.exchanges.params, gossip, running_stats=any(stats for _, stats in shared))
                        if gossip is not None else None)
        if self.rank == 0:  # the leader answers hellos: who we are, and where each of our ranks listens
            self.link.introduction = (self.layout, self.addresses)
        self._partners: dict[int, Partner] = {}  # leader: the partner of each exchange we asked for, to tell it
        # Flow control, alike on every rank: local steps since a merge last landed, and the last safe point's verdict
        self._since_merge, self._merges_seen = 0, 0
        self.held = False
        self.waits, self.waited_s = 0, 0.0  # holds (of one or more safe points without a local step), and their time
        # The share of time spent in holds lately (smoothed as a whole-model peer's ``SafePoint.wait_share``): the
        # leader's decides whether quasi-global momentum runs (only while the link keeps up)
        self._waits = WaitShare()
        # leader: when each exchange of ours started, and how long they take to be decided (what makes one late)
        self._started: dict[int, float] = {}
        self._rtt = RttEstimator(0.0, timeout)
        # leader, with ``auto``: the level every rank encodes at, from its exchanges (bytes sent, by xid) and
        # ``steps`` (the leader's step time)
        self._auto = (AutoCompression(codec, self.exchanges.params, steps)
                      if self.rank == 0 and isinstance(codec, AutoCodec) else None)
        self._sent_bytes: dict[int, int] = {}
        self._bound = AUTO_STEPS_AHEAD

    def meet(self, addr: str, timeout: float = 10.0) -> Partner:
        """Leader only, before the first exchange with a peer: swap layouts and ranks' addresses with the leader
        whose piece link is at ``addr``. GossipError naming both layouts where they differ (pieces of different
        layouts cannot be averaged; resharding between them is not done), or where it does not answer."""
        if self.rank != 0:
            raise ValueError("only the leader (rank 0) meets partners")
        try:
            partner, body = self.link.greet(addr, self.layout, self.addresses, timeout)
            steps = body.get("steps", 0)
            return Partner(partner, welcome_addresses(self.layout, body), steps if type(steps) is int and steps > 0 else 0)
        except (ProtocolError, TimeoutError) as e:  # another layout (its words name both), or no answer
            raise GossipError(f"cannot average with the peer at {addr}: {e}") from None

    @property
    def stats(self) -> PieceStats:
        return self.exchanges.stats

    @property
    def busy(self) -> bool:
        """Whether an exchange we asked for is still undecided (the leader starts one at a time)."""
        return bool(self.exchanges.in_flight)

    def safe_point(self, start: Partner | None = None, news: dict[str, Any] | None = None,
                   round_trip_steps: float | None = None, hold_bound: int | None = None,
                   local_step: bool = True) -> dict[str, Any]:
        """After a local step, on every rank: decide, settle and apply what can be; answer the requests every rank
        holds, from the piece just taken; then start ``start`` (the leader's word; other ranks pass None; none is
        started while one of ours is still undecided). Returns the leader's ``news`` (small JSON: the swarm's word
        for the other ranks), on every rank; its ``members``, where it names them, are what the rate scaling counts
        from the next optimizer step on. ``round_trip_steps``: the leader's measure of the link's round trip in
        local steps, for the drift correction's memory (None: not measured). ``hold_bound``: the leader's flow
        control bound in local steps (None: no flow control, as in the final phase); ``local_step``: False for the
        safe points of a hold (``held``: the caller runs another until it is False, every rank alike)."""
        now = self.clock()
        methods = self.methods
        self._local_steps += int(local_step)
        with self.lock:
            mine = {
                "status": {str(xid): int(self.exchanges.status(xid, now)) for xid in self.exchanges.in_flight},
                "expired": self.exchanges.expired(now),
                "waiting": self.exchanges.waiting(now),
            }
        # The stability guard's share of this rank (the whole model's norm: every rank's), once per local step
        square = methods.piece_square() if methods is not None and local_step else None
        if square is not None:
            mine["square"] = square
        if methods is not None and methods.quasi_global:  # quasi-global momentum: every rank ready for it?
            mine["qgm_ready"] = methods.momentum_ready()
        if self.rank == 0:
            told = self.link.take_outcomes()
            mine["told"] = [[xid, requester, int(outcome)] for xid, (requester, outcome) in told.items()]
            if start is not None:
                mine["start"] = [self._rng.getrandbits(62), start.id, list(start.addresses)]
            if news is not None:
                mine["news"] = news
            if round_trip_steps is not None:
                mine["round_trip_steps"] = round_trip_steps
            if methods is not None and methods.quasi_global:
                share = self._waits.observe(now, self.waited_s) if local_step else self._waits.share
                mine["keeps_up"] = share < LINK_BOUND_SHARE
            if hold_bound is not None and self._may_hold(now):
                mine["hold"] = hold_bound
            if self._auto is not None:
                mine["level"] = self.exchanges.level
                self._bound = hold_bound or self._bound
        every = self.group.all_json(mine)  # the one collective: every rank now decides alike
        leader = every[0]
        answers, request = [], None
        # The guard first, on every rank alike: a piece put back makes every merge computed from the one it replaced
        # void, before any of them is decided (our exchanges aborted, the partners told; held merges dropped).
        put_back = methods is not None and local_step and methods.judge([float(rank.get("square", 0.0)) for rank in every])
        settling = methods is not None and methods.settling
        # The group's step (the leader's count, else ours: alike on every rank), for staleness weights and donations
        step = int(leader.get("news", {}).get("steps", self._local_steps))
        with self.lock:
            self.exchanges.step = step
            if methods is not None and methods.guard is not None:  # the whole model's, judged: partners' compared to it
                self.exchanges.norm = methods.guard.norm
            if "level" in leader:  # (auto) what every rank encodes at from here on
                self.exchanges.level = leader["level"]
            if put_back:
                aborted, answers = self.exchanges.put_back()
                for xid in aborted:
                    partner = self._partners.pop(xid, None)
                    if partner is not None:
                        self.link.tell(partner.addresses[0], xid, Outcome.ABORT)
            elif settling:  # the guard lets a sign settle: neither ask nor serve (a blow-up is neither given nor taken)
                answers = self.exchanges.refuse_waiting()
            if methods is not None and local_step:  # the drift correction measures every merge of this step's safe
                methods.before()  # points, its hold's included, and corrects once, at the last (as a whole model's)
            self._decide(every)
            for xid, requester, outcome in leader.get("told", []):
                self.exchanges.settle(int(xid), Outcome(outcome), str(requester))
            for rank in every:
                for xid, requester in rank["expired"]:
                    self.exchanges.settle(int(xid), Outcome.ABORT, str(requester))
            merges = self.stats.committed + self.stats.applied
            self.exchanges.apply()
            self._since_merge = 0 if merges != self._merges_seen else self._since_merge + int(local_step)
            self._merges_seen = merges
            # Flow control's verdict, from what every rank holds alike (decided before any new start)
            self.held = "hold" in leader and bool(self.exchanges.in_flight) and self._since_merge >= leader["hold"]
            if methods is not None and not self.held:  # answered from the piece apply() took: merged, not corrected
                if methods.quasi_global:  # once a local step, after its merges, before the correction (a whole model's order)
                    runs = all(rank.get("qgm_ready", False) for rank in every) and bool(leader.get("keeps_up", True))
                    squares = methods.momentum_measure(runs)
                    if squares is not None:  # (alike on every rank) the clip judges the whole model's change
                        methods.momentum_apply(math.sqrt(sum(self.group.all_json(squares))))
                methods.after(leader.get("round_trip_steps"))
            # Requests every rank holds, answered from the piece this safe point took: one model's pieces, whenever
            # each rank's request came. (One some rank lacks waits; the requester gives up on it at its deadline.)
            held_by_all = set.intersection(*({(int(x), str(r)) for x, r in rank["waiting"]} for rank in every))
            for xid, _requester in sorted(held_by_all if not (put_back or settling) else ()):
                answers.append(self.exchanges.serve_waiting(xid, now))
            # The next exchange once ours is decided (alike on every rank), unless the guard or flow control holds
            if "start" in leader and not self.exchanges.in_flight and not (put_back or settling or self.held):
                xid, partner, addresses = leader["start"]
                if len(addresses) != len(self.addresses):
                    raise ValueError(f"partner {partner} has {len(addresses)} ranks, this peer {len(self.addresses)}")
                request = self.exchanges.start(int(xid), str(partner), SHARE, now)
                if self.rank == 0:
                    self._partners[int(xid)] = Partner(str(partner), tuple(addresses))
                    self._started[int(xid)] = now
                    if request is not None:
                        self._sent_bytes[int(xid)] = sum(t.numel() * t.element_size() for t in request.tensors.values())
        for answer, addr in answers:
            self.link.answer(addr, answer)
        if request is not None:
            self.link.ask(request, addresses[self.rank])
        if local_step:  # (the leader's step count: a newcomer's with state.transfer_step)
            self.transfer.donate(step, self._local_steps)
        told = dict(leader.get("news", {}))
        if methods is not None and "members" in told:
            methods.members = max(1, int(told["members"]))
        return told

    def _may_hold(self, now: float) -> bool:
        """Leader: whether our exchange in flight is young enough to hold the group for (see the module docstring)."""
        if not self.exchanges.in_flight:
            return False
        began = self._started.get(self.exchanges.in_flight[0])
        late = self._rtt.late_after()
        return began is not None and now - began < (FIRST_HOLD if late is None else late)

    def hold(self, again: Callable[[], dict[str, Any]], pause: float = 0.001) -> dict[str, Any] | None:
        """Flow control on every rank: while the last safe point ended ``held``, run ``again`` (a safe point without a
        local step) after ``pause`` seconds; the last one's news (None: no hold). Counted in ``waits``/``waited_s``."""
        if not self.held:
            return None
        began, news = time.monotonic(), None
        while self.held:
            time.sleep(pause)
            news = again()
        self.waits += 1
        self.waited_s += time.monotonic() - began
        return news

    def download(self, next_donor: Callable[[], Partner | None] | None, timeout: float) -> str | None:
        """A newcomer's state download, on every rank alike (``PieceTransfer.download``: a collective)."""
        return self.transfer.download(next_donor, timeout, self.methods.took_download if self.methods else None)

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """This rank's optimizer (given, or found at its first step): newcomers get its state, a donor's state
        downloaded before it was known goes into it now (``PieceTransfer.bind_optimizer``)."""
        self.transfer.bind_optimizer(optimizer)

    @property
    def downloaded_step(self) -> int:
        return self.transfer.downloaded_step

    @property
    def optimizer_transfer(self) -> str:
        return self.transfer.optimizer_transfer

    def _decide(self, every: Sequence[dict[str, Any]]) -> None:
        """Our exchanges that every rank can settle now: committed or aborted on all, the partner told (leader)."""
        xids = sorted({int(x) for rank in every for x in rank["status"]})
        for xid in xids:
            outcome = decide([int(rank["status"].get(str(xid), Status.FAILED)) for rank in every])
            if outcome == Outcome.WAIT:
                continue
            began, nbytes = self._started.pop(xid, None), self._sent_bytes.pop(xid, 0)
            if outcome == Outcome.COMMIT:
                self.exchanges.commit(xid)
                if began is not None:  # (leader) how long an exchange takes to be decided: flow control, compression
                    took = self.clock() - began
                    self._rtt.observe(took)
                    if self._auto is not None:
                        self._auto.exchanged(took, nbytes, self._bound)
            else:
                self.exchanges.abort(xid)
            partner = self._partners.pop(xid, None)
            if partner is not None:  # the leader tells the partner's leader, for every rank of it
                self.link.tell(partner.addresses[0], xid, outcome)

    def close(self) -> None:
        """Close this rank's socket (not a collective); the optimizer steps at the user's rate again."""
        if self.methods is not None:
            self.methods.close()
        self.loop.run(self.link.close("split group closed"), timeout=10)
