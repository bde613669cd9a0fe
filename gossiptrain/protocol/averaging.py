"""The base every averaging algorithm shares: the live parameters, validation, compression, staleness.

Every algorithm (see ``gossiptrain.protocol.algorithms``) is a sans-IO state
machine with ``handle(event, now) -> actions``, over the live parameters of
the model being trained; ``Averaging`` holds what they all need around that
arithmetic, so each algorithm's module is its exchange and nothing else:
decoding and checking what arrives (``_validated``), encoding what we send
with ``gossip.compression`` (and, for ``auto``, following the measured link),
staleness weighting, robust clipping, exchange ids, and flow control's
default (the pushing algorithms' receipts, ``protocol.receipts``).

**Flow control.** A peer may take at most ``gossip.max_steps_ahead`` local
steps (``auto_steps_ahead`` by default: ``AUTO_STEPS_AHEAD`` unless an
algorithm says otherwise) past its last merge; past that, its safe point
waits (``hold_until``): pairwise for its exchange in flight
(``protocol.pairwise``), the pushing algorithms for the receipt of their
oldest push. On a link fast enough nothing waits; on a slow one, peers
compute at the link's pace instead of drifting toward their own shards.

The events and actions of ``handle`` live in ``protocol.averaging_events``,
below this module, so that ``protocol.receipts`` (which this module uses) can
import ``AveragingStats`` without an import circle. This module re-exports
the interface of ``handle``, for code that drives an algorithm: ``Event``,
``AtSafePoint``, ``Received``, ``Undelivered``, ``MemberGone``, ``Action``,
``SendExchange`` and ``Rejected``. Everything else is imported from its home:
the rest of ``protocol.averaging_events`` (``AveragingStats``,
``META_RANGES``, ``wire_bytes``, ``mean_staleness``), ``ParamSpec``
(``protocol.param_spec``), and ``PairwiseAveraging`` with its constants
(``protocol.pairwise``, which imports this module, so it cannot be
re-exported here).
"""

from __future__ import annotations

import logging
import random
from typing import Mapping, Sequence

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.auto_compression import AutoCompression
from gossiptrain.protocol.averaging_events import (
    Action,
    AtSafePoint,
    AveragingStats,
    Event,
    MemberGone,
    Received,
    Rejected,
    SendExchange,
    Undelivered,
)
from gossiptrain.protocol.compression import AutoCodec, get_codec
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.receipts import Receipts
from gossiptrain.protocol.robust import NormClip, norms
from gossiptrain.protocol.staleness import StalenessPolicy
from gossiptrain.protocol.step_timer import StepTimer
from gossiptrain.state.host_buffers import BufferPool, common_device, to_device

__all__ = [
    "AUTO_STEPS_AHEAD",
    "Averaging",
    # re-exported from protocol.averaging_events: the interface of Averaging.handle
    "Action",
    "AtSafePoint",
    "Event",
    "MemberGone",
    "Received",
    "Rejected",
    "SendExchange",
    "Undelivered",
]

log = logging.getLogger(__name__)


#: Flow control (``gossip.max_steps_ahead = 0``): local steps a pairwise peer may take past its last merge before
#: its safe point waits for the exchange in flight (every algorithm's default: ``Averaging.auto_steps_ahead``).
#: Where a round trip takes fewer steps (a fast link) nothing ever waits; on a slow link computation slows to the
#: link's pace instead of drifting apart (chosen by measurement: experiments/flow_control.py).
AUTO_STEPS_AHEAD = 8


class Averaging:
    """What every algorithm shares: the live parameters, validation, compression and staleness.

    Subclasses implement ``handle``. ``busy`` says an exchange is in flight;
    ``version`` counts merges applied to the local model (sent with pushes so a
    receiver can drop an older model from a sender it already has a newer one of).

    ``network_kinds``: the message kinds the driver hands over as they arrive,
    on the network side (a real peer's loop thread), instead of queueing them
    for the next safe point. An algorithm that takes any must never touch
    ``params`` while handling them; ``AtSafePoint`` is the only event that may.
    The driver serialises all calls to ``handle`` and ``after_send``, and
    calls ``after_send`` once it has sent what a network-side event returned.
    """

    network_kinds: frozenset[str] = frozenset()
    #: Flow control's bound where ``gossip.max_steps_ahead`` is 0 (automatic).
    auto_steps_ahead: int = AUTO_STEPS_AHEAD
    #: Merges move the model toward partners' models of before our last local step, against the model as it
    #: is now, not against the one we sent (push-sum): they undo part of that step (``take_stale_share``).
    merges_stale: bool = False
    #: ``moved`` says what each safe point added to the live parameters, so the drift correction reads it instead
    #: of copying the model before the safe point and subtracting after (two passes over the model fewer).
    reports_moves: bool = False

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        self.me = me  # our member id (breaks ties between peers)
        self.names = list(params)
        self.params = [p for p in params.values()]
        self.spec = ParamSpec.of(params)
        # Snapshots, merge differences and codec outputs come from here and are reused once dropped (they may be
        # on the wire meanwhile: see gossiptrain.state.host_buffers); received tensors move to ``device`` to merge.
        self.buffers = BufferPool()
        self.device = common_device(self.params)
        self.config = config
        self.rng = rng
        self.stats = AveragingStats()
        self.codec = get_codec(config.compression, "gossip.compression")
        # compression "auto": the level follows the measured link (``protocol.auto_compression``)
        self.steps = StepTimer()  # the local step time, flow control's waits excluded
        self.auto = AutoCompression(self.codec, self.params, self.steps) if isinstance(self.codec, AutoCodec) else None
        self.stats.compression_level = self.auto.codec.level if self.auto is not None else 0
        self.staleness = StalenessPolicy(config.staleness_weighting, config.staleness_exponent, config.staleness_bound)
        self.clip = NormClip(config.robust_clip) if config.robust else None
        # Fault injection for robustness experiments (the simulator's rogue peers, tests): this peer
        # scales what it sends by this factor. 1.0, honest, everywhere else.
        self.poison = 1.0
        # Set by the driver after each safe point: the stability guard saw a sign of a blow-up lately. Pairwise
        # averaging then starts no exchange and serves none until it has settled (``model_put_back``'s docstring).
        self.settling = False
        # ...and the model's norm the guard measured there (None: no guard, or still in its warmup). Pairwise
        # requests carry it; a server refuses one whose norm and its own are ``stability.NORM_RATIO`` apart.
        self.norm: float | None = None
        self.version = 0
        self._moved: tuple[list[torch.Tensor], float] = ([], 0.0)  # see take_moved
        self._next_xid = rng.getrandbits(31)
        self._step = 0  # our latest local step, from the last AtSafePoint
        # Flow control: local steps past the last completed averaging before the loop waits (see hold_until).
        self.max_ahead = config.max_steps_ahead or self.auto_steps_ahead
        self.receipts = Receipts(config, self.stats)  # pushing algorithms: pushes not yet acknowledged (protocol.receipts)
        self.receipts.on_round_trip = self._link_measured

    @property
    def lossless(self) -> bool:
        """Whether what we send now is decoded exactly (the level of ``auto`` may change between messages)."""
        return self.codec.name == "none"

    def flow_bound(self) -> int:
        """Local steps past the last completed averaging before the training loop waits (``hold_until``)."""
        return self.max_ahead

    def round_trip_steps(self, latency: float | None) -> float | None:
        """A round trip of ``latency`` seconds in our local steps (None: either not measured yet)."""
        step = self.steps.step_time
        return latency / step if latency is not None and step else None

    def compression_bound(self) -> int:
        """Local steps an exchange may take before ``auto`` compression sends fewer bytes: flow control's bound."""
        return self.flow_bound()

    def _at_step(self, step: int, now: float) -> None:
        """Every algorithm's first move at a safe point: note the step (and, for ``auto``, the step time)."""
        self._step = step
        self.steps.at_step(step, now, self.stats.waited_s)

    def _link_measured(self, seconds: float, nbytes: int) -> None:
        """One of our messages of ``nbytes`` got its answer (reply, receipt) after ``seconds``."""
        if self.auto is not None:
            self.auto.exchanged(seconds, nbytes, self.compression_bound())
            self.stats.compression_level = self.auto.codec.level
            self.stats.compression_switches = self.auto.switches

    @property
    def busy(self) -> bool:
        return False

    def handle(self, event: Event, now: float) -> list[Action]:
        raise NotImplementedError

    def after_send(self) -> None:
        """Do the arithmetic the last ``handle`` deferred until its messages were sent (pairwise: a served merge).

        Every ``handle`` does it first, so a driver that never calls this
        loses nothing; one that calls it after sending gets replies out sooner.
        """

    def take_stale_share(self) -> float:
        """The share of the model the merges since the last call replaced (``merges_stale`` algorithms; else 0)."""
        return 0.0

    def take_moved(self) -> tuple[list[torch.Tensor], float]:
        """``(terms, scale)``: the last safe point added ``scale * terms`` to the live parameters (no terms: nothing).

        Where ``reports_moves``; once per safe point (the tensors are then the
        caller's to read, and let go), and only read.
        """
        moved, self._moved = self._moved, ([], 0.0)
        return moved

    def checkpoint_state(self) -> dict[str, float]:
        """What a checkpoint must keep of this machine besides the model (push-sum: its weight); {}: nothing."""
        return {}

    def restore_state(self, state: Mapping[str, float]) -> None:
        """Take back what ``checkpoint_state`` gave, before the first safe point (a resumed peer)."""

    def serve_as_is(self) -> None:
        """Before the first safe point: answer partners from the model as it is now (a peer at a rendezvous).

        Only pairwise refuses requests before its first safe point (the model
        might still be replaced); pushes are taken at safe points anyway.
        """

    def model_put_back(self) -> None:
        """The live parameters were put back outside averaging (the stability guard, at a blow-up): forget what was
        computed from the model they replaced. Pushing algorithms read the live parameters at each safe point and
        keep nothing of them: nothing to forget."""

    def hold_until(self, now: float) -> float | None:
        """Flow control: until when the training loop should wait after the last safe point (None: go on).

        Pairwise waits for its reply in flight (its own override); pushing
        algorithms for the receipt of their oldest push (``protocol.receipts``).
        The driver waits on the network side's progress, never past the returned time.
        """
        return self.receipts.hold_until(self._step, now, self.flow_bound())

    # -- helpers for subclasses --------------------------------------------------------------

    def _like(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.params))

    def _snapshot(self) -> list[torch.Tensor]:
        """A copy of the parameters to keep (pooled copies are for what is sent: ``_frozen``)."""
        return [p.detach().clone() for p in self.params]

    def _frozen(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``values`` to send and remember while they move on, in reused buffers."""
        return self.buffers.copies(values)

    def _encode(self, values: Sequence[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Wire tensors for ``values`` (in host memory), and what a receiver will decode from them (on our device)."""
        if self.poison != 1.0:  # a rogue member: valid tensors, scaled; it keeps its own model sane
            wire = self.codec.encode({n: v * self.poison for n, v in zip(self.names, values)})
            return self.buffers.to_host(wire), list(values)
        wire = self.codec.encode(dict(zip(self.names, values)), pool=self.buffers)
        if self.lossless:
            sent = list(values)
        else:
            decoded = self.codec.decode(wire, like=self._like(), pool=self.buffers)
            sent = [decoded[n] for n in self.names]
        wire = self.buffers.to_host(wire)
        self.stats.buffers = self.buffers.made
        return wire, sent

    def _encode_own(self, values: Sequence[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]] | None:
        """``_encode``, or None if our own model cannot be sent (non-finite: training diverged)."""
        try:
            return self._encode(values)
        except ProtocolError as e:
            self.stats.unsendable += 1
            if self.stats.unsendable & (self.stats.unsendable - 1) == 0:  # 1st, 2nd, 4th, ...: not every step
                log.error("not sending our model (%d times so far): %s; has training diverged?", self.stats.unsendable, e)
            return None

    def _new_xid(self) -> int:
        self._next_xid = (self._next_xid + 1) % (1 << 31)
        return self._next_xid

    def _validated(self, msg: Received) -> list[torch.Tensor] | Rejected:
        """The remote tensors in parameter order, decoded and checked, or why they cannot touch the model.

        The codec's decode checks names, dtypes, shapes and finiteness against
        our own parameters before anything is written.
        """
        try:
            decoded = self.codec.decode(to_device(msg.tensors, self.device), like=self._like(), pool=self.buffers)
        except ProtocolError as e:
            self.stats.rejected += 1
            return Rejected(msg.sender, str(e))
        return [decoded[n] for n in self.names]

    def _staleness_weight(self, msg: Received, symmetric: bool = False) -> float | None:
        """The policy's factor for ``msg`` (None: drop it); counts the drop."""
        s = abs(self._step - msg.step) if symmetric else self._step - msg.step
        weight = self.staleness.weight(s)
        if weight is None:
            self.stats.stale_dropped += 1
        return weight

    def _clip_factor(self, remote: Sequence[torch.Tensor], own: Sequence[torch.Tensor], sender: str = "") -> float | None:
        """Robust mode: the scale (0, 1] for moving by ``remote - own``, None to refuse it; 1 when robust is off."""
        if self.clip is None:
            return 1.0
        factor = self.clip.factor(*norms(remote, own), sender=sender)
        if factor is None:
            self.stats.rejected += 1
        elif factor < 1.0:
            self.stats.clipped += 1
        return factor

    def _record_staleness(self, msg: Received) -> None:
        self.stats.staleness[max(0, self._step - msg.step)] += 1
