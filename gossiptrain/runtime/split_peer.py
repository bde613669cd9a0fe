"""``Peer`` for a model split across the ranks of its group: each rank averages its own piece (issue 48).

``Peer(model, join=..., group=g)`` on every rank of a ``torch.distributed``
group whose model FSDP2 sharded (``fully_shard``) or cut into pipeline
stages: ``Peer.__new__`` finds the layout (one collective) and makes rank 0
a ``SplitPeer`` (``SplitLeaderRank``'s methods), the other ranks
``SplitWorker``s (``SplitWorkerRank``'s). Nothing else changes in
the user's loop: ``step()`` after each optimizer step, ``agree()`` to stop
together, ``finish()`` and ``close()`` at the end.

- **Joining.** Only the leader (rank 0) is a swarm member. It joins with the
  unsplit model's parameters and the layout (``pieces.split_spec``): a
  swarm whose models are split otherwise, or whole, refuses it with one line
  naming both layouts. Then every rank opens its own piece link
  (``PieceLink``, at the host the leader would advertise) and the leader's
  node answers partners' hellos with every rank's address.
- **Averaging.** At each ``step()`` the leader picks a partner among the
  live members it has met (``split_partners.PartnerBook``) and every rank
  runs the group's safe point (``SplitGroup.safe_point``, one small gather):
  exchanges decided on every rank alike, every rank's piece sent to the same
  rank of the partner. The leader's news (stop asked, members, steps) rides
  on that gather, so the workers need no other collective.
- **A dead rank** makes the group's next collective raise on the others;
  ``close()`` (a ``with`` block's exit) then leaves the swarm, and partners
  abort whatever was in flight with it (``piece_exchange``).
- **The end.** ``finish()`` runs the final phase as a whole-model peer does
  (waiting for the others, safe points without local steps, so the pieces
  meet); every rank takes part, following the leader's word. With
  ``final_model`` the leader then writes the model its ranks' pieces make,
  gathered into one state_dict of the unsplit model: this peer's own model
  after the consensus rounds, where a whole-model peer downloads and
  averages every member's.

- **A newcomer** downloads live members' pieces before its first step:
  its leader meets a few (at random, so newcomers spread over the swarm),
  and every rank downloads the piece of the donor's rank of its index in
  verified chunks, as a whole-model peer downloads its state: a donor that
  stops answering is left for another and the download resumes from the
  chunks already verified (``SplitGroup.download``); installed on every
  rank or on none.

- **Beyond plain averaging**, every rank runs the drift correction on its
  piece, the square-root rate rule on its optimizer (given on every rank,
  or found at its first step), the stability guard over the whole model's
  norm and, where the swarm asks for it, quasi-global momentum, by numbers
  the group agrees on (``piece_methods``); flow control holds every rank
  alike (``SplitGroup.hold``), and staleness weights weigh each exchange on
  every rank alike (``piece_exchange``).

With ``state.transfer_step`` the newcomer goes on from the donor's step
count. In a secure swarm every rank is given the peer's keys
(``security=``, the same on every rank) and its own link is CURVE-secured
with them.

With ``state.transfer_optimizer`` each rank's download carries the donor
rank's optimizer state too (``piece_optimizer_state``).

Not built yet, and said where it matters: a merged model that averages
every member's pieces, top-k compression (``piece_codec``) and peers
behind NAT.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Callable, Mapping

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.errors import ConfigError, GossipError
from gossiptrain.net.addressing import advertised_host, parse_hostport, plain_address
from gossiptrain.protocol.compression import Codec, get_codec
from gossiptrain.protocol.finish import Announce
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.pieces import PieceLayout, split_spec
from gossiptrain.protocol.status import DONE, FINAL
from gossiptrain.protocol.averaging import AUTO_STEPS_AHEAD
from gossiptrain.protocol.pairwise import steps_ahead
from gossiptrain.protocol.step_timer import StepTimer
from gossiptrain.runtime.final_phase import FinalPhase, FinalReport
from gossiptrain.runtime.group_worker import WorkerRank
from gossiptrain.runtime.loop_thread import LoopThread
from gossiptrain.runtime.optimizer_finder import OptimizerFinder
from gossiptrain.runtime.peer_group import CONTROL_FIELDS
from gossiptrain.runtime.peer_network import PeerNode
from gossiptrain.runtime.split_group import Partner, SplitGroup
from gossiptrain.runtime.split_partners import PartnerBook

log = logging.getLogger(__name__)

#: How long a split newcomer waits for the hello of a member it would download from.
HELLO_WAIT = 10.0


#: ``gossip.compression`` codecs a split peer's pieces travel in (top-k, which needs per-edge references: uncompressed,
#: said once).
PIECE_CODECS = ("auto", "fp16", "bf16", "int8")


def piece_codec(peer_config: Any, *, say: bool = False) -> Codec | None:
    """The codec a split peer's pieces travel in (``gossip.compression``: auto, fp16, bf16, int8; None: as they
    are). ``say``: log a codec asked for and not used."""
    spec = peer_config.gossip.compression
    name = spec.strip().partition(":")[0]
    if say and name not in PIECE_CODECS and name != "none":
        log.warning("split peers send their pieces uncompressed: gossip.compression=%s is not built for pieces "
                    "(auto, fp16, bf16 and int8 are)", spec)
    return get_codec(spec) if name in PIECE_CODECS else None


def unbuilt(gossip: GossipConfig) -> tuple[list[str], list[str]]:
    """The swarm's settings a split peer cannot honour: (refused: it would average otherwise than the swarm asked,
    or unprotected; said and run without: the rest), each in one sentence naming the field."""
    refused, unrun = [], []
    if gossip.algorithm != "pairwise":
        refused.append(f"gossip.algorithm={gossip.algorithm}: split peers average pairwise, piece by piece "
                       "(push-sum, neighbor and local-sgd are not built for pieces)")
    if gossip.robust:
        refused.append("gossip.robust: robust aggregation is not built for pieces")
    if gossip.exchanges_in_flight > 1:
        unrun.append(f"gossip.exchanges_in_flight={gossip.exchanges_in_flight} (one at a time)")
    return refused, unrun


def exchange_timeout(peer_config: Any) -> float:
    """Seconds a piece exchange may take before it is aborted on every rank: the gossip's adaptive ceiling (a piece
    of a large model over a slow link takes seconds, and one in flight at a time holds no step back)."""
    return float(peer_config.gossip.exchange_timeout_max)


class SplitLeaderRank:
    """Rank 0 of a split peer: the swarm member, and one rank of the group's piece exchanges (module docstring).

    Its methods only: ``gossiptrain.runtime.peer`` makes it a ``Peer`` (``SplitPeer(SplitLeaderRank, Peer)``,
    whose joining, membership and lifecycle it keeps), as ``WorkerRank`` and ``GroupWorker``, so the two modules
    import in one direction only."""

    _split_model = True

    def __init__(self, model: torch.nn.Module, join: str, **kwargs: Any) -> None:
        # In a secure swarm every rank's link is CURVE-secured with this peer's keys (every rank is given them)
        self._piece_security = kwargs.get("security")
        self._pieces: SplitGroup | None = None
        self._partners: PartnerBook | None = None
        self._download_wanted = False
        self._piece_transfer: tuple[str, list[str]] = ("none", [])  # how the state download went, and from whom
        self._candidates: tuple[tuple[str, ...], list[tuple[str, str]]] = ((), [])  # (view, its (id, address) pairs)
        self._step_timer = StepTimer()  # the local step's time, for the link's round trip in steps
        super().__init__(model, join, **kwargs)

    @property
    def layout(self) -> PieceLayout:
        """What each rank of this peer holds (``gossiptrain.protocol.pieces``)."""
        assert self._pieces is not None
        return self._pieces.layout

    @property
    def piece_address(self) -> str:
        """Where this rank's own link listens (in a secure swarm the address carries its CURVE key)."""
        assert self._pieces is not None
        return self._pieces.link.address

    # -- joining ---------------------------------------------------------------------------------

    def _spec_of(self, model: torch.nn.Module) -> ParamSpec:
        assert self._layout is not None
        return split_spec(self._layout)

    def _attach_training(self, node: PeerNode) -> None:
        """No whole-model averaging: the ranks' piece links do it (``_start_group``)."""
        self._side = None

    def _catch_up(self, enabled: bool) -> None:
        """Whether to download the swarm's state: the pieces come once every rank listens (``_start_group``)."""
        node = self._node
        assert node is not None
        self._loop.run(node.seeds_verified(), timeout=10)
        self._download_wanted = enabled and self.config.state.enabled and len(node.view()) > 1

    def _start_group(self, welcome: dict[str, Any]) -> None:
        """Joined: the welcome to the workers, every rank's piece link opened, our node answering partners' hellos."""
        assert self._group is not None and self._node is not None and self._transport is not None
        if self._transport.client_as is not None:
            problem = ("a split peer behind NAT (a client-mode member) is not built yet: its ranks must be reachable "
                       "at their own addresses")
            self._group.share(None, error=problem)
            raise GossipError(problem)
        refused, unrun = unbuilt(self.config.gossip)
        if refused:
            problem = "this swarm's run asks what split peers do not do: " + "; ".join(refused)
            self._group.share(None, error=problem)
            raise ConfigError(problem)
        if unrun:
            log.warning("split peer: not run for pieces: %s", "; ".join(unrun))
        self._group.share(welcome)
        host = parse_hostport(plain_address(self.address))[0]
        self._pieces = pieces = SplitGroup(
            self._group.group, self.model, me=self.id, host=host, fingerprint=self.fingerprint, loop=self._loop,
            timeout=exchange_timeout(self.config), clock=self._clock.now, limits=self.config.limits,
            seed=self._rng.getrandbits(32), codec=piece_codec(self.config, say=True), gossip=self.config.gossip,
            steps=self._step_timer, security=self._piece_security, state=self.config.state,
        )
        if self._optimizer_mode == "given":
            self._found(self.optimizer, given=True)
        self._partners = PartnerBook(pieces.link, pieces.layout, pieces.addresses, clock=self._clock.now, rng=self._rng)
        node = self._node
        log.info("split peer: %s; each rank averages its piece", pieces.layout.describe())
        tried: list[str] = []
        donors = self._donors(node, tried) if self._download_wanted else None
        got = pieces.download(donors, timeout=self.config.state.max_seconds)  # every rank, alike
        if tried:  # (the donors met; those whose chunks we kept, when it came)
            self._piece_transfer = ("complete", got.split(", ")) if got else ("failed", tried)
            if got:
                log.info("downloaded every rank's piece from %s (step %d)", got, pieces.downloaded_step)
                if self.config.state.transfer_step:  # the donor's step count goes on here (state.transfer_step)
                    self.resume_at(pieces.downloaded_step)
            else:
                log.warning("could not download the pieces from %s within state.max_seconds=%g: this peer starts from "
                            "its own model, and its exchanges bring it to the swarm's", ", ".join(tried),
                            self.config.state.max_seconds)

        async def ready() -> None:  # past the download: partners may meet us, and the rendezvous count us
            node.piece_introduction = (pieces.layout, pieces.addresses)
            node.mark_ready()

        self._loop.run(ready(), timeout=10)

    def _donors(self, node: PeerNode, tried: list[str]) -> Callable[[], Partner | None]:
        """The next live member to download from, met when asked for (its ranks' addresses), each added to
        ``tried``: in random order, so that newcomers spread over the swarm instead of all asking the same member
        (``SplitGroup.download`` meets a few, and leaves one that stops answering for another). None once they are
        spent, or where the first to answer has not trained (a fresh swarm: nothing to download)."""
        assert self._pieces is not None and self._partners is not None
        members = list(self._live(node))
        self._rng.shuffle(members)
        queue = members

        def next_donor() -> Partner | None:
            assert self._pieces is not None and self._partners is not None
            while queue:
                mid, addr = queue.pop(0)
                try:
                    partner = self._pieces.meet(addr, timeout=min(HELLO_WAIT, self.config.state.max_seconds))
                except GossipError as e:
                    log.warning("state download: %s", e)
                    continue
                self._partners.met[mid] = partner
                if partner.steps == 0:
                    if not tried:  # the first to answer never trained: a fresh swarm
                        return None
                    continue
                tried.append(mid)
                return partner
            return None

        return next_donor

    def transfer_summary(self) -> dict[str, Any]:
        status, donors = self._piece_transfer
        pieces = self._pieces
        return {"state_transfer": status, "state_donors": donors,
                "state_optimizer": pieces.optimizer_transfer if pieces is not None else "none"}

    def _found(self, optimizer: torch.optim.Optimizer, given: bool = False) -> None:
        if self.optimizer is None:
            self.optimizer = optimizer
        if not given:
            self._optimizer_mode = "found"
        assert self._pieces is not None
        bound = bind_piece_optimizer(self._pieces, optimizer)
        log.info("%s the optimizer that steps this model: %s, with %s", "given" if given else "found",
                 type(optimizer).__name__, bound)

    # -- the training loop's side ------------------------------------------------------------

    def step(self, samples_seen: int | None = None) -> None:
        """Call after each optimizer step, on every rank: the group's safe point (pieces exchanged with a partner),
        and flow control's hold (more safe points, without a local step, while the link is behind)."""
        node = self._count_step(samples_seen)  # (Peer's)
        self._safe_point(node, self._step)
        assert self._pieces is not None
        self._pieces.hold(lambda: self._safe_point(node, self._step, local_step=False))

    def _safe_point(self, node: PeerNode, step: int, local_step: bool = True, flow: bool = True) -> dict[str, Any]:
        pieces, partners = self._pieces, self._partners
        assert pieces is not None and partners is not None
        node.step = step
        every = self.config.gossip.exchange_every_steps
        # The topology's neighbours this round (rounds: the exchanges started), met among every live member
        neighbours = node.partners(pieces.stats.started)
        partner = partners.pick(self._live(node), among=neighbours) if step % every == 0 else None
        news = dict(zip(CONTROL_FIELDS, (float(self.finish_requested), float(self.members), float(self._step))))
        if local_step:  # the step's time, holds left out
            self._step_timer.at_step(step, self._clock.now(), pieces.waited_s)
        latency, step_time = node.latency(), self._step_timer.step_time
        round_trip = latency / step_time if latency is not None and step_time else None
        bound = steps_ahead(self.config.gossip.max_steps_ahead, AUTO_STEPS_AHEAD, round_trip) if flow else None
        return pieces.safe_point(partner, news, round_trip, bound, local_step)

    def _live(self, node: PeerNode) -> list[tuple[str, str]]:
        """(id, address) of the live members but us; asked of the network thread only when the view changed."""
        view = node.view()
        if view != self._candidates[0]:
            pairs = self._loop.call(lambda: [(m.id, m.addr) for m in node.membership.alive() if m.id != self.id], timeout=5)
            self._candidates = (view, pairs)
        return self._candidates[1]

    def serve_before_training(self) -> None:
        """Nothing to do: each rank's link answers partners from its piece as it is, from the start."""
        self._check_open()

    def averaging_state(self) -> dict[str, float]:
        return {}

    def restore_averaging(self, state: Mapping[str, float] | None) -> None:
        pass

    def _training_status(self) -> dict[str, Any]:
        last = self._last_step_at
        stats = self._pieces.stats if self._pieces is not None else None
        reported = self._reported
        return {
            "phase": self._phase, "step": self._step, "samples": self.samples_seen,
            "exchanges": stats.committed + stats.applied if stats else 0, "staleness_mean": 0.0, "rtt_ms": 0.0,
            "idle_s": 0.0 if last is None else round(max(0.0, self._clock.now() - last), 3),
            **{k: v for k, v in reported.items() if v == v and abs(v) != float("inf")},
        }

    def stats(self) -> dict[str, Any]:
        """Counters of this peer: its rank's piece exchanges (the group decides alike), membership, bytes."""
        out: dict[str, Any] = {"steps": self._step, "members": self.members, "optimizer": self._optimizer_mode}
        if self._pieces is not None:
            out.update(piece_counts(self._pieces))
        if self._node is not None:
            out.update(self._node.stats.to_dict())
            out["suspicions"] = self._node.membership.stats.suspicions
        if self._transport is not None:
            out.update(self._transport.stats.to_dict())
        return out

    # -- the end of the run ------------------------------------------------------------------

    def finish(
        self, reason: str = "budget", final_model: Any = None, abort: Callable[[], bool] = lambda: False
    ) -> FinalReport:
        """The final phase, as a whole-model peer's (``Peer.finish``), every rank taking part. ``final_model``: a
        path where this rank writes the model its ranks' pieces make once the phase is over, gathered into one
        ordinary state_dict of the unsplit model (``PeerGroup.whole_state``; a file ``load_state_dict`` takes, with
        ``write_merged``'s metadata). It is this peer's own model after the phase's consensus rounds, not a
        download of every member's (as a whole-model peer's is): the metadata names this peer alone."""
        node = self._check_open()
        self._pieces_done_stepping()
        phase = FinalPhase(
            self.config.final, me=self.id, endpoint=node.finish, view=node.view, idle=self._idle,
            notify=lambda phase, writer, everyone: self._loop.call_soon(node.on_finish, Announce(phase, writer, everyone)),
            abort=abort, renotify_every=self.config.membership.heartbeat_interval, clock=self._clock.now,
        )
        self._phase = FINAL
        path = str(final_model) if final_model is not None else None
        try:
            report = phase.run(reason, None, None)
        finally:
            self._group_done(gather=path is not None)
        if path is not None:
            self._write_final_model(path, report)
        self._phase = DONE
        log.info("final phase done (%s) in %.2f s: %d rounds without local steps", reason, report.seconds, report.rounds)
        return report

    def _pieces_done_stepping(self) -> None:
        """The final phase begins: no more drift to correct (the workers do the same in their ``finish``)."""
        if self._pieces is not None and self._pieces.methods is not None:
            self._pieces.methods.no_more_steps()

    def _idle(self) -> None:
        """A safe point of every rank without a local step (the workers follow: ``SplitWorkerRank.finish``)."""
        node = self._check_open()
        assert self._group is not None
        self._group.agree(True)
        self._rounds += 1
        self._last_step_at = self._clock.now()
        self._safe_point(node, self._step + self._rounds, local_step=False, flow=False)  # no steps: nothing to hold
        time.sleep(self._pace)

    def _group_done(self, gather: bool = False) -> None:
        """The workers' final phase ends; then whether they gather their pieces for our merged model."""
        assert self._group is not None
        self._group.agree(False)
        self._group.agree(gather)

    def _write_final_model(self, path: str, report: FinalReport) -> None:
        """Every rank's piece and buffers into one state_dict of the unsplit model, written at ``path`` (a failed
        write is named in the report, as a whole-model peer's is, and does not stop the leave)."""
        from gossiptrain.state.merged_model import MemberInfo, write_merged

        assert self._group is not None
        state = self._group.whole_state(self.model, self.layout)  # the workers gather with us
        assert state is not None
        try:
            write_merged(path, state, members=[MemberInfo(self.id, self.samples_seen, self._step)],
                         fingerprint=self.fingerprint, run=self.config.to_dict(), written_by=self.id)
        except GossipError as e:
            report.merge_error = f"{type(e).__name__}: {e}"
            log.error("final phase: could not write the merged model: %s", report.merge_error)
            return
        report.merged_members, report.final_model = [self.id], path
        log.info("wrote this peer's model, its %d ranks' pieces gathered, to %s", self.layout.ranks, path)

    def _teardown(self) -> None:
        pieces, self._pieces = self._pieces, None
        if pieces is not None:
            try:
                pieces.close()
            except Exception as e:  # closing is best effort: partners abort what was in flight at their deadlines
                log.warning("could not close this rank's piece link: %r", e)
        super()._teardown()


class SplitWorkerRank(WorkerRank):
    """A rank other than 0 of a split peer: its piece link, and the group's safe points (no membership)."""

    _split_model = True

    def _start_worker(self, join: str, member_only: dict[str, Any]) -> None:
        assert self._group is not None
        bind, advertise = member_only.get("bind"), member_only.get("advertise")
        host = advertised_host(parse_hostport(join, "join address")[0],
                               parse_hostport(bind, "bind address")[0] if bind else None, advertise)
        self._loop = LoopThread(f"gossiptrain-piece-rank{self._group.rank}").start()
        try:
            self._pieces = SplitGroup(
                self._group.group, self.model, me=self.id, host=host, fingerprint=self.fingerprint, loop=self._loop,
                timeout=exchange_timeout(self.config), clock=time.monotonic, limits=self.config.limits,
                seed=random.getrandbits(32), codec=piece_codec(self.config), gossip=self.config.gossip,
                security=member_only.get("security"), state=self.config.state,
            )
            self._pieces.download(None, timeout=self.config.state.max_seconds)  # the leader's donors, if any
        except BaseException:
            self._loop.stop()
            raise
        # This rank's optimizer, as the leader binds its own: given, or found at its first step
        self._finder: OptimizerFinder | None = None
        if self._find_optimizer:
            self._finder = OptimizerFinder(self.model, self._found).start()
        elif self.optimizer is not None:
            self._found(self.optimizer)

    def _found(self, optimizer: torch.optim.Optimizer) -> None:
        if self.optimizer is None:
            self.optimizer = optimizer
        bind_piece_optimizer(self._pieces, optimizer)

    @property
    def layout(self) -> PieceLayout:
        return self._pieces.layout

    @property
    def piece_address(self) -> str:
        return self._pieces.link.address

    def _follow(self) -> None:
        """The group's safe point, the leader's news with it, and flow control's hold where the leader's word says."""
        news = self._pieces.safe_point(None)
        news = self._pieces.hold(lambda: self._pieces.safe_point(None, local_step=False)) or news
        self._control = {k: float(news[k]) for k in CONTROL_FIELDS if k in news} or self._control
        self._step = int(self._control.get("steps", self._step))

    def finish(
        self, reason: str = "budget", final_model: Any = None, abort: Callable[[], bool] = lambda: False
    ) -> FinalReport:
        """The leader's final phase: a safe point for each of its rounds, until its word that it is over; then this
        rank's piece for the merged model, where the leader writes one (``final_model`` is rank 0's to give)."""
        self._check_worker()
        assert self._group is not None
        if self._pieces.methods is not None:  # as the leader, before the first of its rounds
            self._pieces.methods.no_more_steps()
        rounds = 0
        while self._group.agree(False):
            self._pieces.safe_point(None, local_step=False)
            rounds += 1
        if self._group.agree(False):  # the leader writes the merged model (its final_model): our piece for it
            self._group.whole_state(self.model, self.layout)
        return FinalReport(reason, rounds=rounds)

    def stats(self) -> dict[str, Any]:
        return {"steps": self._step, "members": self.members, **piece_counts(self._pieces)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._finder is not None:
            self._finder.close()
        try:
            self._pieces.close()
        except Exception as e:
            log.warning("could not close this rank's piece link: %r", e)
        finally:
            self._loop.stop()


def piece_counts(pieces: SplitGroup) -> dict[str, Any]:
    """A rank's piece exchanges in ``Peer.stats()``'s words (``completed``: ours applied, ``served``: theirs; flow
    control's ``waits`` and ``waited_s``), every count as ``piece_*``, and its methods' numbers (``drift_gain``,
    ``lr_scale``, the guard's)."""
    s = pieces.stats
    methods = pieces.methods.stats() if pieces.methods is not None else {}
    return {"completed": s.committed, "served": s.applied, **{f"piece_{k}": v for k, v in vars(s).items()}, **methods,
            "waits": pieces.waits, "waited_s": round(pieces.waited_s, 3), "compression_level": pieces.exchanges.level}


def bind_piece_optimizer(pieces: SplitGroup, optimizer: torch.optim.Optimizer) -> str:
    """Give a rank's optimizer what the swarm runs with it (``PieceMethods.bind``) and its state to newcomers (and a
    donor's downloaded state to it: ``SplitGroup.bind_optimizer``); what it got, in words."""
    pieces.bind_optimizer(optimizer)
    got = pieces.methods.bind(optimizer) if pieces.methods is not None else []
    return " and ".join(got) or "nothing extra"
