"""``Peer``: join a swarm and gossip-average a model that your own loop trains.

In the spirit of wrapping a model with DDP::

    with gossiptrain.Peer(model, join="127.0.0.1:7070") as peer:
        for batch in data:
            loss = ...; opt.zero_grad(); loss.backward(); opt.step()
            peer.step()

The network side (membership, joins, routing) runs on an event loop in a
background thread. All reads and writes of the model's parameters happen in
``step()``, on the training thread, between optimizer steps: that is the only
safe point, so no lock is needed and no update is ever half-applied.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from gossiptrain.config import RunConfig, SecurityConfig
from gossiptrain.errors import ConfigError, GossipError, MismatchError
from gossiptrain.net import sealed
from gossiptrain.net.addressing import (
    advertised_host,
    client_address,
    curve_address,
    parse_hostport,
    plain_address,
    tcp_url,
    with_host_if_wildcard,
)
from gossiptrain.net.keys import join_server_key
from gossiptrain.net.transport import Transport, listen
from gossiptrain.protocol.admission import warn_open
from gossiptrain.protocol.averaging_events import mean_staleness
from gossiptrain.protocol.finish import Announce, RequestStop
from gossiptrain.protocol.joining import JoinRequest, Welcome, model_differs, taken_from_swarm
from gossiptrain.protocol.lr_scaling import SwarmLrScaling
from gossiptrain.protocol.momentum import QuasiGlobalMomentum
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.pieces import PieceLayout
from gossiptrain.protocol.reachability import AUTO, NO, REACHABLE_ENV, ReachCheck, Verdict
from gossiptrain.protocol.state_transfer import TransferResult
from gossiptrain.protocol.status import DONE, FINAL, JOINING, TRAINING
from gossiptrain.runtime.assembly import TrainingSide, bind_optimizer, install_transfer, node_for, training_side
from gossiptrain.runtime.clock import REAL_CLOCK, Clock
from gossiptrain.runtime.factories import ModelFactory, OptimizerFactory
from gossiptrain.runtime.final_phase import FinalPhase, FinalReport
from gossiptrain.runtime.group_worker import WorkerRank
from gossiptrain.runtime.join_client import join_swarm, not_joining, reach_verdict
from gossiptrain.runtime.leased_data import LeaseClient, LeasedSampler
from gossiptrain.runtime.loop_thread import LoopThread
from gossiptrain.runtime.optimizer_finder import FIND_OPTIMIZER, FindOptimizer, OptimizerFinder
from gossiptrain.runtime.peer_group import PeerGroup
from gossiptrain.runtime.peer_network import PeerNode
from gossiptrain.runtime.preflight import ThreadCheck, refuse_unusable_model
from gossiptrain.runtime.split_peer import SplitLeaderRank, SplitWorkerRank
from gossiptrain.runtime.state_endpoint import catch_up
from gossiptrain.runtime.swarm_client import merge_members
from gossiptrain.runtime.wrapped import inner_model, inner_optimizer
from gossiptrain.service import Status
from gossiptrain.state.merged_model import MemberInfo

log = logging.getLogger(__name__)


class Peer:
    """One member of a gossip swarm, driven by a synchronous training loop.

    ``model`` is either the module to average, or a factory
    ``(config, shard) -> module`` called once the swarm's configuration is
    known (the CLI peer builds its workload's model that way). A model no
    swarm can average (no parameters, or tensors on the ``meta`` device) is
    refused with ``ConfigError``, a ValueError, before anything is contacted.
    Several peers on one machine whose torch threads exceed its cores get
    one warning per process, naming the thread count to set.
    ``join`` is ``HOST:PORT`` of the coordinator or of any live peer.
    ``bind`` defaults to the advertised host, port 0; ``advertise`` defaults to
    the local address of the interface that routes to the join host, so a
    peer joining a remote host never advertises 127.0.0.1.
    ``config``, when given, is the run this peer expects: a swarm running
    anything else in the fields it was given (``RunConfig.fields_given``:
    those ``with_overrides`` or its TOML file wrote, else those not at their
    defaults) refuses it with the differences named; the rest it takes from
    the swarm (``taken_from_swarm`` names them).
    ``join_attempts`` bounds the join (``membership.join_timeout`` seconds
    each); after the last one ``JoinError`` says who did not answer.
    ``security`` makes this a member of a secure (CURVE) swarm; the member at
    ``join`` is dialled with ``security.server_key_file``'s key.
    Before it returns, a peer that finds other live members downloads the
    current state of one of them into the model (``state.*``, see
    ``gossiptrain.protocol.state_transfer``); ``transfer_state=False`` skips that (a
    model restored from a checkpoint on purpose). ``optimizer`` (the
    optimizer, or a factory ``(config, model) -> optimizer`` for a model
    factory) lets that download bring the donor's optimizer state too, with
    ``state.transfer_optimizer``, and lets this peer give its own; an
    adaptive one (Adam and its kin) then steps at sqrt(members) times its
    rate while in the swarm, the scaling rule for the swarm's larger batch
    (``gossip.lr_scaling``, see ``gossiptrain.protocol.lr_scaling``), and
    SGD with momentum gets quasi-global momentum where the swarm runs it
    (``gossiptrain.protocol.momentum``). Without ``optimizer``, the peer finds
    the optimizer that steps the model's parameters at its first ``step()``
    (before that step runs) and treats it as if it had been given, a
    downloaded optimizer state included; several such optimizers each get
    their momentum and scaling, and newcomers then get no optimizer state
    (``gossiptrain.runtime.optimizer_finder``). ``stats()["optimizer"]`` says
    which: ``given``, ``found``, ``waiting`` (none has stepped yet) or
    ``none``. ``optimizer=None`` asks for none of it: plain averaging of the
    parameters, and no hook on any optimizer.
    When your loop ends (its budget spent, or ``finish_requested`` after a
    ``gossiptrain stop``), ``finish()`` runs the final phase: consensus with
    the others, and optionally the swarm's merged model (``gossiptrain.protocol.finish``).
    ``model`` and ``optimizer`` may be what DDP or accelerate wrapped them
    in: the peer takes what is inside (``gossiptrain.runtime.wrapped``).
    ``group``, a ``torch.distributed`` process group, makes one member of
    several workers training with DDP: call it on every rank; rank 0 joins,
    the others get a ``GroupWorker`` (``gossiptrain.runtime.peer_group``).
    A model split across those ranks before the call (FSDP2's ``fully_shard``,
    a pipeline stage) makes each rank average its own piece with the same
    rank of a partner (``SplitPeer``, ``SplitWorker``: ``gossiptrain.runtime.split_peer``).
    ``reachable`` (``auto``, ``yes`` or ``no``; default ``$GOSSIPTRAIN_REACHABLE``,
    else ``auto``): ``auto`` has the member answering our join dial us back at
    the advertised address (``gossiptrain.protocol.reachability``), waiting
    up to ``membership.join_timeout`` seconds for it; ``yes`` and ``no`` take
    the caller's word. ``reachability`` holds the verdict; one that says
    others cannot reach us is logged as a warning, with what follows from it.
    ``relay=True`` passes messages between members behind NAT (client-mode
    members, which cannot reach each other) within ``limits.relay_*``, and
    says so in our membership entry, so that clients spread over the
    relaying members instead of all using the coordinator; a peer that
    turns out to be behind NAT itself cannot relay and says so.
    """

    #: Whether the others can dial us at our address, and how that is known; None until joined.
    reachability: Verdict | None = None
    #: Whether this peer's model is split across its group's ranks (``SplitPeer``: each rank averages its piece).
    _split_model = False
    #: What each rank of the group holds, found in ``__new__`` (a collective); None: no group, or a model factory.
    _layout: PieceLayout | None = None

    def __new__(cls, model: Any = None, *args: Any, group: Any = None, **kwargs: Any) -> "Peer":
        """On a group's ranks, the peer each rank is: ``Peer`` (rank 0) or ``GroupWorker`` where every rank holds
        the whole model (DDP), ``SplitPeer`` and ``SplitWorker`` where it is split across them (FSDP2, pipeline
        stages: ``gossiptrain.runtime.split_peer``). The layout is found here, on every rank alike (a collective)."""
        if group is None or cls is not Peer:
            return super().__new__(cls)
        import torch.distributed as dist

        if not dist.is_initialized():  # __init__ says so (PeerGroup)
            return super().__new__(cls)
        layout = PeerGroup(group).layout(inner_model(model)) if isinstance(model, torch.nn.Module) else None
        leader = dist.get_rank(group) == 0
        if layout is not None and layout.kind != "whole":
            obj: Peer = super().__new__(SplitPeer if leader else SplitWorker)
        else:
            obj = super().__new__(cls if leader else GroupWorker)
        obj._layout = layout
        return obj

    def __init__(
        self,
        model: torch.nn.Module | ModelFactory,
        join: str,
        *,
        bind: str | None = None,
        advertise: str | None = None,
        config: RunConfig | None = None,
        shard: int | None = None,
        seed: int | None = None,
        join_attempts: int | None = None,
        clock: Clock = REAL_CLOCK,
        security: SecurityConfig | None = None,
        transfer_state: bool = True,
        optimizer: torch.optim.Optimizer | OptimizerFactory | FindOptimizer | None = FIND_OPTIMIZER,
        group: Any = None,
        reachable: str | None = None,
        relay: bool = False,
    ) -> None:
        self._closed = False
        if isinstance(model, torch.nn.Module):  # before anything is started or contacted (a factory's: once built)
            refuse_unusable_model(inner_model(model), pieces=self._split_model)
        self._relay = relay  # asked for: we relay only if reachable (``_attach``)
        self._group = PeerGroup(group) if group is not None else None  # the leader of several workers
        self.transfer: TransferResult | None = None  # how the state download went; None: there was none
        self.taken_from_swarm: list[str] = []  # run fields the caller did not set, as "field=value" the swarm runs with
        self._clock = clock
        self._rng = random.Random(seed)
        self._step = 0
        self._samples: int | None = None  # samples the training loop says it has trained on (None: it never said)
        self._last_step_at: float | None = None
        self._pace = 0.01  # seconds between safe points without a local step: about the recent step time
        self._rounds = 0  # safe points run without a local step (the final phase)
        self._phase = JOINING  # for `gossiptrain status`: joining, training, final, done
        self._reported: dict[str, float] = {}  # the loop's latest numbers (``report``), replaced whole, never changed
        self._threads = ThreadCheck()  # several peers on this machine at torch's default threads: one warning
        join_host, join_port = parse_hostport(join, "join address")
        bind_host, bind_port = parse_hostport(bind, "bind address") if bind else (None, 0)
        advertise = advertised_host(join_host, bind_host, advertise)
        local = config or RunConfig()
        reach = ReachCheck((os.environ.get(REACHABLE_ENV) or AUTO) if reachable is None else reachable, random.SystemRandom())
        join_target = tcp_url(join_host, join_port)
        server_key: bytes | None = None
        if security is not None:
            server_key = join_server_key(security)
            join_target = curve_address(join_target, server_key)
        self._loop = LoopThread().start()
        self._transport: Transport | None = None
        self._node: PeerNode | None = None
        self._side: TrainingSide | None = None
        finding = isinstance(optimizer, FindOptimizer)
        self._finder: OptimizerFinder | None = None  # watches optimizer steps, where we find the optimizer
        self._optimizer_mode = "none"  # given, found (at its first step), waiting (to be found) or none (optimizer=None)
        try:
            self._transport = listen(tcp_url(bind_host or advertise, bind_port), local.limits, security=security)
            if server_key is not None and not self._transport.accepts_key(server_key):
                # The member we join answers from its own key: refused by our allow-list, we would hear nothing.
                raise ConfigError(
                    f"the public key of the --join target (security.server_key_file) is not in "
                    f"security.allow_dir {security.allow_dir if security else ''}: its answer would be refused"
                )
            self._loop.run(self._transport.start(), timeout=10)
            self.address = self._transport.reachable_at(tcp_url(advertise, parse_hostport(plain_address(self._transport.address))[1]))
            if security is None:
                warn_open("peer", self.address)
            module = inner_model(model) if isinstance(model, torch.nn.Module) else None  # DDP's: what it wraps
            spec = self._spec_of(module) if module is not None else None
            if reach.mode == NO:  # the caller knows nobody can dial us: a client from the start
                self._become_client()

            def join_once(check: ReachCheck | None, shard: int) -> Welcome:
                request = JoinRequest(config=config, spec=spec, shard=shard, reach=check.nonce if check else None)
                welcome = self._loop.run(
                    join_swarm(
                        self._transport,
                        join_target,
                        request,
                        advertise=self.address,
                        limits=local.limits,
                        clock=clock,
                        attempts=join_attempts or local.membership.join_attempts,
                        attempt_timeout=local.membership.join_timeout,
                        rng=self._rng,
                        reach=check,
                    )
                )
                if welcome.coordinator and welcome.answered_by == welcome.coordinator:  # we dialled the coordinator itself
                    dialled = with_host_if_wildcard(welcome.coordinator, join_host)
                    welcome = replace(welcome, coordinator=dialled, answered_by=dialled)
                return welcome

            welcome = join_once(reach, -1 if shard is None else shard)
            reach.welcomed(plain_address(welcome.answered_by), clock.now(), local.membership.join_timeout)
            try:  # a factory that refuses (a checkpoint of another run, a bad configuration) never trains
                if module is None:  # a factory's model, checked once built (a module was checked before joining)
                    module = inner_model(model(welcome.config, welcome.shard))  # type: ignore[operator]
                    refuse_unusable_model(module)
                self.model = module
                # accelerate's AcceleratedOptimizer: the torch optimizer inside (gossiptrain.runtime.wrapped)
                given = None if isinstance(optimizer, FindOptimizer) else optimizer
                self.optimizer = inner_optimizer(given(welcome.config, self.model) if callable(given) else given)
                self._optimizer_mode = "waiting" if finding else "given" if self.optimizer is not None else "none"
            except Exception:
                self._withdraw(welcome)
                raise
            wait = local.membership.join_timeout + 10  # it bounds itself; this only guards a bug
            self.reachability = self._loop.run(
                reach_verdict(self._transport, reach, plain_address(self.address), local.limits, clock), timeout=wait
            )
            if not self.reachability.reachable and reach.mode == AUTO:  # measured: join again, as the client we are
                self._withdraw(welcome)
                self._become_client()
                welcome = join_once(None, welcome.shard)  # the shard our model was built for
            log.log(logging.INFO if self.reachability.reachable else logging.WARNING, "%s", self.reachability.line(welcome.member_id))
            self._attach(welcome)
            if self._transport.client_as is not None:
                if security is None or sealed.available():
                    self._use_relays()
                else:
                    log.warning("no relay to other peers behind NAT: a secure swarm seals what passes through one, "
                                "which needs the cryptography package (pip install 'gossiptrain[nat]')")
            # Compared only on the fields the caller gave (config.fields_given); the rest came from the swarm: say what.
            self.taken_from_swarm = taken_from_swarm(config, welcome.config) if config is not None else []
            if self.taken_from_swarm:
                log.info("took from the swarm: %s", ", ".join(self.taken_from_swarm))
            self._catch_up(transfer_state)
            if finding:  # from here on: a state downloaded for it is kept on the side (install_transfer)
                self._finder = OptimizerFinder(self.model, self._found).start()
        except BaseException as e:
            if self._group is not None:  # the other workers wait for our welcome: tell them why there is none
                self._group.share(None, error=f"{type(e).__name__}: {e}")
            if self._node is not None and self._node.status is Status.RUNNING:
                self.close()  # a member by now (Ctrl+C during the state download, say): leave, as close() does
            else:
                self._teardown()
            raise
        if self._group is not None:
            try:
                self._start_group({
                    "id": self.id, "shard": self.shard, "fingerprint": self.fingerprint, "config": self.config.to_dict(),
                    "address": self.address, "joined_via": self.joined_via, "taken_from_swarm": self.taken_from_swarm,
                })
            except BaseException:  # a worker is gone already: leave the swarm we just joined
                self.close()
                raise

    def _spec_of(self, model: torch.nn.Module) -> ParamSpec:
        """What the swarm checks our model against at join: its parameters (a split peer's: and its layout)."""
        return ParamSpec.of(dict(model.named_parameters()))

    def _start_group(self, welcome: dict[str, Any]) -> None:
        """Joined: the welcome to the group's other workers, and our model to them (every rank holds it whole)."""
        assert self._group is not None
        self._group.share(welcome)
        self._group.check_whole(self.model)
        self._sync_group()

    def _sync_group(self) -> None:
        """Our parameters and buffers, and the swarm's news, to the other workers of this peer (``PeerGroup.sync``)."""
        assert self._group is not None
        self._group.sync(self.model, (float(self.finish_requested), float(self.members), float(self._step)))

    def agree(self, flag: bool) -> bool:
        """This peer's decision, e.g. to go on training: ``flag`` here, and on every worker of a group (rank 0's)."""
        return self._group.agree(flag) if self._group is not None else flag

    def _attach(self, welcome: Welcome) -> None:
        spec = self._spec_of(self.model)
        if welcome.spec is not None and (problem := spec.mismatch(welcome.spec)):
            self._withdraw(welcome)
            raise MismatchError(model_differs(problem, welcome.config))
        self.config = welcome.config
        self.fingerprint = welcome.fingerprint
        self.id = welcome.member_id
        self.shard = welcome.shard
        self.joined_via = welcome.answered_by
        assert self._transport is not None
        transport = self._transport

        relay = self._relay and transport.client_as is None
        if self._relay and not relay:
            log.warning("not relaying (--relay): behind NAT, we cannot be dialled by the peers we would relay for")
        elif relay:
            limits = transport.limits  # the budget serve_as_relay takes
            log.info("relaying between peers behind NAT (--relay): at most %.0f MB/s, bursts of %.0f MB",
                     limits.relay_bytes_per_second / 1e6, limits.relay_burst_bytes / 1e6)

        async def build() -> PeerNode:
            # On the loop thread, where the transport lives: the constructor already probes the welcome's members.
            node = node_for(
                welcome,
                address=self.address,
                incarnation=time.time_ns() // 1000,  # wall-clock microseconds outrank an earlier process under this id
                transport=transport,
                clock=self._clock,
                rng=self._rng,
                spec=spec,
                nonces=random.SystemRandom(),  # probe nonces stay unguessable whatever seed the run was given
                relay=relay,
            )
            self._node = node  # closed at teardown, even if it fails to start
            await node.start()
            return node

        node = self._loop.run(build(), timeout=10)
        self._attach_training(node)
        node.training_status = self._training_status
        log.info("joined via %s as %s (shard %d of %d)", self.joined_via, self.id, self.shard, self.num_shards)

    def _attach_training(self, node: PeerNode) -> None:
        """The training side over our model: averaging at safe points, and our snapshots offered to newcomers."""
        # Donor side: a session waiting for a snapshot gets a copy at our next safe point, hashed off this thread.
        node.state.offload = True
        side = training_side(
            node, self.model, clock=self._clock, rng=self._rng, optimizer=self.optimizer,
            send=lambda a: self._loop.call_soon(node.send_exchange, a),
            offer=lambda copy: self._loop.call_soon(node.state.offer_snapshot, copy),
        )
        self._averaging, self._safepoint, self._snapshots = side.averaging, side.safepoint, side.snapshots
        self._side = side

    def _become_client(self) -> None:
        """Nobody can dial us (behind NAT): from now on we are the client-mode member at our address + /client.

        Every message of ours names that address, so whoever we send to
        answers, probes and exchanges over the connection we opened
        (``Transport.become_client``); other clients we reach through a relay (``_use_relays``).
        """
        assert self._transport is not None
        self.address = client_address(self.address)
        self._loop.call(self._transport.become_client, self.address, timeout=5)  # on the loop, where it lives

    def _use_relays(self) -> None:
        """Average with other clients through a relay: a member that relays, else the coordinator
        (``PeerNode.use_relays``; a secure swarm's messages are sealed for their target alone). One that does
        not relay drops them; those exchanges are presumed lost after a few round trips."""
        assert self._node is not None
        self._loop.call(self._node.use_relays, timeout=5)  # on the loop, where it lives

    def _withdraw(self, welcome: Welcome) -> None:
        """Tell whoever welcomed us, and the coordinator, that we are not joining after all (``not_joining``)."""
        transport = self._transport
        assert transport is not None
        self._loop.call(lambda: not_joining(transport, welcome, self.address), timeout=5)  # where the transport lives

    def _catch_up(self, enabled: bool) -> None:
        """Download a live member's state into the model before the first step, if anyone else is alive."""
        node = self._node
        assert node is not None
        self._loop.run(node.seeds_verified(), timeout=10)
        others = [m for m in node.view() if m != self.id]
        if enabled and self.config.state.enabled and others:
            result, values = self._loop.run(
                catch_up(
                    node.state, self.model, me=self.id, members=node.view, rng=self._rng, clock=self._clock,
                    optimizer=self.optimizer, keep_optimizer=self._optimizer_mode == "waiting",
                ),
                timeout=self.config.state.max_seconds + 30,  # the download bounds itself; this only guards a bug
            )
            self.transfer = result
            assert self._side is not None
            install_transfer(result, values, self._side)  # on the training thread
            if values is not None and self.config.state.transfer_step:
                self.resume_at(result.step)

        async def ready() -> None:  # on the loop thread, where the node lives
            node.mark_ready()

        self._loop.run(ready(), timeout=10)

    def _found(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer finder's news, at ``optimizer``'s first step and before it: bind it as if it had been given."""
        assert self._side is not None
        got = bind_optimizer(self._side, optimizer)
        if self.optimizer is None:
            self.optimizer = optimizer
        self._optimizer_mode = "found"
        log.info("found the optimizer that steps this model: %s, with %s", type(optimizer).__name__,
                 " and ".join(got) or "nothing extra")

    @property
    def _momentum(self) -> QuasiGlobalMomentum | None:
        """Quasi-global momentum of (the first of) our optimizer(s), where this swarm runs it."""
        return self._side.momentum if self._side is not None else None

    @property
    def _lr_scaling(self) -> SwarmLrScaling | None:
        """The square-root rate scaling of (the first scaled of) our optimizer(s), if any."""
        return self._side.lr_scaling if self._side is not None else None

    # -- the training loop's side ------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        return self.config.train.shards

    @property
    def steps(self) -> int:
        return self._step

    def resume_at(self, step: int) -> None:
        """Count on from ``step`` (a model restored from a checkpoint); only before the first ``step()``."""
        if self._step != 0:
            raise GossipError(f"resume_at({step}) after {self._step} steps: call it before the first step()")
        if step < 0:
            raise GossipError(f"resume_at: step must be >= 0, got {step}")
        self._step = step
        if self._node is not None:
            self._node.step = step  # what our messages carry until the next safe point

    def averaging_state(self) -> dict[str, float]:
        """The averaging machine's state a checkpoint keeps beside the model (push-sum: its weight)."""
        self._check_open()
        with self._safepoint.locked():
            return self._averaging.checkpoint_state()

    def restore_averaging(self, state: Mapping[str, float] | None) -> None:
        """Take a checkpoint's averaging state back (``resume_at``'s companion); only before the first ``step()``."""
        if self._last_step_at is not None:
            raise GossipError("restore_averaging() after the first step(): call it before")
        self._check_open()
        if state:
            with self._safepoint.locked():
                self._averaging.restore_state(state)

    @property
    def members(self) -> int:
        """Alive members in our view, ourselves included."""
        return len(self._node.view()) if self._node else 0

    def wait_for_peers(
        self, count: int, timeout: float | None = None, *, stop: threading.Event | None = None,
        serve: bool = True, on_wait: Callable[[int], None] | None = None,
    ) -> int:
        """Block until ``count`` members (us included) are ready to train: a rendezvous, as DDP's.

        For loops that should not start alone, e.g. ``peer.wait_for_peers(peer.num_shards)``.
        Ready means joined and past the state download (``gossiptrain.protocol.rendezvous``),
        so every member starts within about one message of the others, and none
        downloads from a member that started before it. Meanwhile the peer answers
        its partners' exchanges with the model as it is now (``serve``; call it
        once the model is final). ``on_wait(ready)`` is called about every 50 ms
        while it waits. Returns the ready members counted: ``count`` or more,
        fewer only when ``stop`` was set first. Raises TimeoutError after
        ``timeout`` seconds.
        """
        node = self._check_open()
        if serve:
            self.serve_before_training()

        async def start() -> None:  # on the loop thread; a rendezvous of an earlier call is over when this returns
            node.wait_for(count)

        self._loop.run(start(), timeout=10)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not node.released.wait(0.05):
            if self._closed:
                raise GossipError("this peer is closed")
            if stop is not None and stop.is_set():
                self.agree(False)
                return node.ready_count
            if deadline is not None and time.monotonic() > deadline:
                self.agree(False)
                raise TimeoutError(f"only {node.ready_count} of {count} members ready after {timeout} s")
            if on_wait is not None:
                on_wait(node.ready_count)
        self.agree(True)  # the other workers of a group wait for this
        return max(count, node.ready_count)

    def serve_before_training(self) -> None:
        """Answer partners' exchanges from the model as it is now, before the first ``step`` (see ``wait_for_peers``)."""
        self._check_open()
        self._safepoint.serve_as_is()

    def step(self, samples_seen: int | None = None) -> None:
        """Call after each optimizer step: apply finished exchanges, answer requests, start one.

        ``samples_seen``, the samples your loop has trained on so far in all,
        weighs this peer's model in a merged model (``gossiptrain.state.merged_model``);
        without it, the steps taken do.
        """
        self._count_step(samples_seen)
        self._safepoint(self._step)
        self._snapshots(self._step, self.samples_seen)
        self._safepoint.wait()  # flow control: on a slow link, at most gossip.max_steps_ahead steps past the last merge
        if self._group is not None:
            self._sync_group()  # every worker holds what the safe point made of the model

    def _count_step(self, samples_seen: int | None) -> PeerNode:
        """A local step taken: the counts, the pace of the final phase's safe points, the phase, the threads' check."""
        node = self._check_open()
        self._step += 1
        if samples_seen is not None:
            self._samples = samples_seen
        now = self._clock.now()
        if self._last_step_at is not None:  # the final phase's safe points come at about this pace
            self._pace = 0.9 * self._pace + 0.1 * min(0.1, max(0.001, now - self._last_step_at))
        self._last_step_at = now
        self._phase = TRAINING if self._phase == JOINING else self._phase
        if not ThreadCheck.warned:
            self._check_threads(node)
        return node

    def _check_threads(self, node: PeerNode) -> None:
        """Warn once per process when the peers on this machine oversubscribe its cores (``preflight.ThreadCheck``)."""
        if not self._threads.due(len(node.view())) or not any(p.device.type == "cpu" for p in self.model.parameters()):
            return
        addresses = self._loop.call(lambda: [m.addr for m in node.membership.alive()], timeout=5)
        self._threads.judge(addresses, self.address)

    def report(self, *, loss: float | None = None, test_loss: float | None = None, test_acc: float | None = None) -> None:
        """Tell ``gossiptrain status`` (and the dashboard) how this peer is learning; any of the three, when known.

        Cheap: it only keeps the numbers; a visitor's ask reads them on the
        network thread. The CLI peer reports at each evaluation.
        """
        given = {"loss": loss, "test_loss": test_loss, "test_acc": test_acc}
        self._reported = {**self._reported, **{k: float(v) for k, v in given.items() if v is not None}}

    def _training_status(self) -> dict[str, Any]:
        """What a status answer says of the training side; on the network thread: plain reads, no lock, no wait."""
        stats = self._averaging.stats
        last = self._last_step_at
        reported = self._reported
        guard = self._side.guard.stats if self._side is not None and self._side.guard is not None else None
        return {
            "phase": self._phase, "step": self._step, "samples": self.samples_seen,
            "backed_off": guard.backed_off if guard else 0, "restores": guard.restores if guard else 0,
            "exchanges": stats.completed + stats.served, "staleness_mean": mean_staleness(Counter(dict(stats.staleness))),
            "rtt_ms": stats.rtt_ms, "idle_s": 0.0 if last is None else round(max(0.0, self._clock.now() - last), 3),
            **{k: v for k, v in reported.items() if v == v and abs(v) != float("inf")},  # finite only
            **self._lease_status(),
        }

    def _lease_status(self) -> dict[str, int]:
        leases = self._node.leases if self._node is not None else None
        if leases is None:
            return {}
        stats = leases.stats()
        return {"lease_epoch": stats["lease_epoch"], "lease_chunks_done": stats["lease_epoch_chunks_done"]}

    @property
    def samples_seen(self) -> int:
        """What weighs this peer's model in a merged model: the samples reported to ``step()``, else the steps."""
        return self._samples if self._samples is not None else self._step

    def _check_open(self) -> PeerNode:
        node = self._node
        if node is None or self._closed:
            raise GossipError("this peer is closed")
        if node.status is Status.FAILED:
            raise GossipError(f"the network side of this peer failed: {node.error!r}") from node.error
        return node

    # -- the end of the run (gossiptrain.protocol.finish) -----------------------------------------------

    @property
    def finish_requested(self) -> bool:
        """The swarm was asked to stop (``gossiptrain stop``, or a member's ``request_stop``): end your loop, ``finish()``."""
        node = self._node
        return node is not None and node.finish.stop is not None

    def request_stop(self, reason: str = "requested by a member") -> None:
        """Ask the whole swarm to finish its run, as ``gossiptrain stop`` does."""
        node = self._check_open()
        self._loop.call_soon(node.on_finish, RequestStop(reason))

    def finish(
        self, reason: str = "budget", final_model: str | Path | None = None, abort: Callable[[], bool] = lambda: False
    ) -> FinalReport:
        """End this peer's run: wait for the others, average without training, maybe write the merged model.

        Call once your loop has ended (its budget spent, or ``finish_requested``),
        then ``close()``. With ``final_model`` this peer downloads every live
        member's state and writes their average, weighted by samples seen, there.
        ``abort()`` returning True (a signal) cuts the phase short. Bounded by
        ``final.*``; see ``gossiptrain.protocol.finish``.
        """
        node = self._check_open()
        phase = FinalPhase(
            self.config.final, me=self.id, endpoint=node.finish, view=node.view, idle=self._idle,
            notify=lambda phase, writer, everyone: self._loop.call_soon(node.on_finish, Announce(phase, writer, everyone)),
            abort=abort, renotify_every=self.config.membership.heartbeat_interval, clock=self._clock.now,
        )
        path = str(final_model) if final_model is not None else None
        merge = (lambda: self._start_merge(path)) if path is not None else None
        self._phase = FINAL
        report = phase.run(reason, merge, path)
        self._phase = DONE
        if self._group is not None:
            self._sync_group()  # the consensus reached, on every worker
        log.info("final phase done (%s) in %.2f s: %d rounds without local steps", reason, report.seconds, report.rounds)
        return report

    def _idle(self) -> None:
        """A safe point without a local step: averaging goes on, snapshots are served."""
        self._check_open()
        self._rounds += 1
        self._last_step_at = self._clock.now()  # a safe point all the same: the loop is not stuck
        self._safepoint.drift = None  # no local steps any more: no drift to correct, the models only meet
        self._safepoint(self._step + self._rounds)  # exchanges start once per round, as after a step
        self._snapshots(self._step, self.samples_seen)
        time.sleep(self._pace)

    def _start_merge(self, path: str) -> concurrent.futures.Future[tuple[list[str], list[str]]]:
        node = self._check_open()
        # Our own state is read here, on the training thread, between safe points: a consistent copy.
        own = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        others = [m for m in node.view() if m != self.id]
        log.info("writing the merged model of %d members to %s", len(others) + 1, path)
        coro = merge_members(
            node.state, (MemberInfo(self.id, self.samples_seen, self._step), own), others, path=path, me=self.id,
            config=self.config, rng=random.Random(), clock=self._clock, alive=node.view, written_by=self.id,
        )
        return asyncio.run_coroutine_threadsafe(coro, self._loop.loop)

    def transfer_summary(self) -> dict[str, Any]:
        """How the state download before training went (zeros and "none" when there was none), for metrics."""
        stats = self._node.state.transfer.to_dict() if self._node is not None else {}
        result = self.transfer
        optim = "none" if result is None or not result.ok else "installed" if result.optimizer_state is not None else "none"
        if result is not None and result.optimizer_aside and self._side is not None:  # for the optimizer to be found
            optim = self._side.aside_outcome or "waiting"
        return {
            # "none": no download was needed (nobody else alive, or nobody had trained yet: a fresh swarm)
            "state_transfer": "none" if result is None or result.nothing_to_fetch else "complete" if result.ok else "failed",
            "state_donors": list(result.donors) if result is not None else [],
            "state_optimizer": "refused" if result is not None and result.optimizer_problem else optim,
            **{k: stats.get(k, 0) for k in ("state_bytes_received", "state_donors_tried", "state_transfer_seconds")},
        }

    def sampler(self, num_samples: int, *, seed: int | None = None) -> LeasedSampler:
        """A ``DataLoader`` sampler over a dataset of ``num_samples`` that every peer can read: the indices of
        the chunks this peer leases from the swarm (``data.*``; ``gossiptrain.protocol.leases``), so a faster
        peer trains more, a dead peer's chunks are taken over, and each sample is trained once an epoch.
        Every peer must pass the same ``num_samples`` and ``seed`` (default ``train.seed``)."""
        return LeasedSampler(self.leases(num_samples, seed=seed), lambda: self.members)

    def leases(self, num_samples: int, *, seed: int | None = None) -> LeaseClient:
        """This peer's lease machine for a dataset of ``num_samples`` (``sampler``'s; the CLI loop's batches)."""
        node = self._check_open()
        if self._group is not None:
            raise GossipError("leased data is not built for a peer of several workers yet: give each worker its own data")
        return node.use_leases(num_samples, self.config.train.seed if seed is None else seed)

    def wait_for_data(self, timeout: float = 0.05) -> None:
        """Leased data and nothing to claim now: wait up to ``timeout`` for the swarm's tables to free a chunk."""
        node = self._check_open()
        if node.leases is not None:
            node.leases.wait_chunk(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters of this peer: exchanges, bytes, drops, membership."""
        out: dict[str, Any] = {"steps": self._step, "members": self.members}
        if self._node is not None:
            out.update(self._averaging.stats.to_dict())
            out.update(self._safepoint.quarantine.stats.to_dict())
            out.update(self._node.stats.to_dict())
            out.update(self._node.membership.trust_stats())
            out["suspicions"] = self._node.membership.stats.suspicions
            out.update(self._node.state.stats())
            out["lr_scale"] = self._lr_scaling.last_factor if self._lr_scaling is not None else 1.0
            if self._node.leases is not None:
                out.update(self._node.leases.stats())
        out["optimizer"] = self._optimizer_mode
        guard = self._side.guard if self._side is not None else None
        if guard is not None:  # the stability guard (gossiptrain.protocol.stability): what it backed off, restored
            out.update(guard.stats.to_dict())
            out["guard_off"] = ", ".join(guard.backed_off)
        if self._side is not None and self._side.optimizers:
            out["optimizer_class"] = ", ".join(type(o).__name__ for o in self._side.optimizers)
        if self._transport is not None:
            out.update(self._transport.stats.to_dict())
        return out

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Announce the leave to our neighbours and stop. Idempotent; bounded in time."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._node is not None:
                self._loop.run(self._node.leave(), timeout=2)
        except Exception as e:  # leaving is best effort: the others will time us out
            log.warning("could not announce our leave: %r", e)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        if self._finder is not None:  # no optimizer is bound to a peer that is gone, nor watched for one
            self._finder.close()
        if self._side is not None:  # the user's optimizers outlive the peer: back to the rates they set
            self._side.close()
        try:
            if self._node is not None:
                self._loop.run(self._node.close("peer closed"), timeout=3)
            if self._transport is not None:
                self._loop.run(self._transport.close("peer closed"), timeout=3)
        finally:
            self._loop.stop()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class GroupWorker(WorkerRank, Peer):
    """What ``Peer(..., group=g)`` is on a rank other than 0: a ``Peer`` whose loop-facing methods are ``WorkerRank``'s."""


class SplitPeer(SplitLeaderRank, Peer):
    """What ``Peer(..., group=g)`` is on rank 0 when the model is split across the ranks (``gossiptrain.runtime.split_peer``)."""


class SplitWorker(SplitWorkerRank, Peer):
    """What ``Peer(..., group=g)`` is on the other ranks when the model is split across them."""
