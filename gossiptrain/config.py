"""Run configuration: frozen dataclasses, validated on construction.

A swarm shares one ``RunConfig``. The coordinator (or any peer answering a
join) hands it to newcomers, and its fingerprint travels in every message so
that peers of different runs never mix. TOML files and CLI flags map onto the
same dotted field names (``train.lr``, ``gossip.topology``, ...).

Every limit and timing is a named field here; nothing is hard-coded deeper
down. Timeouts a user would otherwise tune are derived (see
``MembershipConfig.suspicion_timeout``) or adapted at run time (exchange timeouts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from gossiptrain.codec_spec import parse_codec_spec
from gossiptrain.errors import ConfigError

#: Algorithms the averaging layer offers (see gossiptrain.protocol.algorithms).
ALGORITHMS = ("pairwise", "push-sum", "neighbor", "local-sgd")
#: Algorithms that keep per-edge references and so can send top-k compressed differences.
_EDGE_ALGORITHMS = ("neighbor", "local-sgd")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{name} {message}")


@dataclass(frozen=True)
class Limits:
    """Bounds on everything that arrives from the network (wire and transport)."""

    max_header_bytes: int = 1 << 20  # msgpack header frame of one message
    max_frames: int = 1025  # header + tensor frames in one message
    max_frame_bytes: int = 64 << 20  # one tensor frame (also ZMQ_MAXMSGSIZE)
    max_message_bytes: int = 512 << 20  # all frames of one message together
    max_container_len: int = 65_536  # msgpack array / map length
    max_str_len: int = 4096  # msgpack string length
    inbox_messages: int = 256  # received messages waiting for the peer loop
    # received messages waiting for the coordinator's loop: every member's join comes there, all at once when a
    # scheduler starts them together (1,024 simulated peers started in one instant: 644 joins were dropped at 256
    # and came back 2-3 s later)
    coordinator_inbox_messages: int = 4096
    send_queue_messages: int = 8  # ZMQ SNDHWM: queued messages per connection
    # Outgoing connections kept open; past it the least recently used is closed (and dialled again if needed),
    # so gossip about many members (or made-up ones) cannot use up the process's file descriptors.
    max_connections: int = 256
    # Incoming connections (gossiptrain.net.transport.incoming) from one source (an IP, an IPv6 /64); past it a new
    # one is shut down at once. A host running many peers, or many behind one NAT, holds one connection per peer to us.
    incoming_per_source: int = 256
    # incoming connections in all (less if the descriptor limit leaves less room); past it a new one is shut down at once
    max_incoming: int = 4096
    handshake_seconds: float = 5.0  # a connection that has not completed the ZMTP handshake by then is closed
    averaging_queue: int = 8  # exchange messages waiting for the trainer
    chunk_bytes: int = 16 << 20  # a tensor over this is sent as several frames of at most this size (wire)
    # Joins are answered by the coordinator and by every peer; each source (an IP, an IPv6 /64)
    # gets a token bucket, so one host flooding joins is dropped without slowing anyone else.
    join_rate_per_source: float = 5.0  # joins answered per second per source, after the burst; excess dropped
    join_burst: int = 32  # joins one source may send at once (the bucket's size)
    join_sources_tracked: int = 4096  # sources with a bucket; beyond this the least recently seen is forgotten
    # Reports to the coordinator (every membership.report_interval per member), bucketed per source the same
    # way: a host of 64 peers sends 32 a second; a flood costs a counter, not registry entries or answers.
    report_rate_per_source: float = 40.0  # reports answered per second per source, after the burst; excess dropped
    report_burst: int = 128  # reports one source may send at once (the bucket's size)
    registry_members: int = 16_384  # members the coordinator keeps; past it, reports of unknown ids are not recorded
    # Members heard of through gossip but not yet verified (probed at the address claimed), at most a quarter
    # of them from one introducer: a liar's made-up members cost a bounded table, never a place in views.
    candidates: int = 128
    # What a relay (the coordinator, or a peer run with --relay, for two client-mode members behind NAT:
    # gossiptrain.net.transport) forwards, in bytes per second on average; past it, or past relay_burst_bytes at
    # once, a relayed message is dropped (the exchange times out).
    relay_bytes_per_second: float = 32e6
    relay_burst_bytes: int = 64 << 20  # bytes a relay forwards at once (the bucket's size; see relay_bytes_per_second)

    def check(self, section: str = "limits") -> None:
        for f in fields(self):
            _require(getattr(self, f.name) > 0, f"{section}.{f.name}", "must be > 0")
        _require(self.max_frames >= 1, f"{section}.max_frames", "must be >= 1")
        for name in ("join_rate_per_source", "report_rate_per_source", "relay_bytes_per_second"):
            rate = getattr(self, name)
            _require(math.isfinite(rate), f"{section}.{name}", f"must be a finite number, got {rate}")
        _require(
            self.max_message_bytes >= self.max_frame_bytes,
            f"{section}.max_message_bytes",
            "must be >= limits.max_frame_bytes",
        )

    def __post_init__(self) -> None:
        self.check()


@dataclass(frozen=True)
class SecurityConfig:
    """CURVE settings of one process (``--secure``): local, never part of the run or its fingerprint.

    Every member (the coordinator included) has its own keypair from
    `gossiptrain keys new` and a directory of the public keys allowed to
    connect to it. ZeroMQ then encrypts every connection and admits only
    those keys; see SECURITY.md. Files are read when the transport is built
    (gossiptrain.net.keys), so a missing or malformed one fails at start, named.
    """

    secret_key_file: Path  # this member's NAME.key_secret (holds its public key too)
    allow_dir: Path  # the public keys (*.key) of every member allowed to connect to us
    server_key_file: Path | None = None  # public key of the --join target; default: allow_dir/coordinator.key
    zap_domain: str = "gossiptrain"  # ZAP domain our listening socket authenticates clients in

    def __post_init__(self) -> None:
        s = "security"
        for name in ("secret_key_file", "allow_dir", "server_key_file"):
            value = getattr(self, name)
            if value is None and name == "server_key_file":
                continue
            _require(isinstance(value, (str, Path)) and str(value) != "", f"{s}.{name}", f"must be a path, got {value!r}")
            object.__setattr__(self, name, Path(value).expanduser())  # frozen: normalise to a Path once, here
        _require(
            isinstance(self.zap_domain, str) and 0 < len(self.zap_domain) <= 254 and self.zap_domain.isascii()
            and self.zap_domain.isprintable(),
            f"{s}.zap_domain",
            f"must be 1 to 254 printable ASCII characters, got {self.zap_domain!r}",
        )


class _DefaultSteps(int):
    """The type of ``TrainConfig.max_steps``'s default: tells a budget left alone from one given as 2000."""


class _DefaultSeconds(float):
    """The type of ``TrainConfig.max_seconds``'s default (see ``_DefaultSteps``)."""


#: The budget fields with their defaults. A budget given alone is the only budget: the other one is then off
#: (``TrainConfig.__post_init__``); given neither, both defaults apply; given both, both apply.
_BUDGET_DEFAULTS: dict[str, int | float] = {"max_steps": _DefaultSteps(2000), "max_seconds": _DefaultSeconds(0.0)}


#: What ``train.optimizer`` may name (gossiptrain.train.local_trainer.make_optimizer builds them).
OPTIMIZERS = ("sgd", "adam")
#: ``train.lr_schedule``: the rate over the run where the workload brings no schedule of its own.
LR_SCHEDULES = ("constant", "step")

@dataclass(frozen=True)
class TrainConfig:
    """What each peer trains and for how long.

    The budget: a peer finishes after ``max_steps`` steps or ``max_seconds``
    seconds, whichever comes first (0: that budget is off). A budget given
    alone is the only one: ``TrainConfig(max_seconds=150)`` (or
    ``--seconds 150``, ``--set train.max_seconds=150``, a TOML file setting
    only ``max_seconds``) has no step budget, and ``max_steps`` alone no time
    budget. Given neither, the defaults apply (2000 steps, no time budget).
    ``budgets_given`` says which of the two were given.
    """

    # digits (a 1.1M-parameter MLP), digits-small (the same data, 19k parameters: what the tests train), logreg,
    # charlm (a GRU language model on the standard library's source, contiguous shards; with optimizer adam and
    # lr 0.003; evaluations add bits_per_char), "package.module:attr" of your own, or "external" (the Python API)
    workload: str = "digits"
    optimizer: str = "sgd"  # sgd (lr, momentum, weight_decay) or adam (lr, weight_decay; torch's betas 0.9, 0.999)
    lr: float = 0.05  # learning rate (Adam wants about 0.003)
    # the rate over the run: constant, or step (x0.1 after 75% of train.max_steps, x0.01 after 90%: the CIFAR
    # recipe of the decentralized-learning papers; needs max_steps). A workload that brings its own schedule
    # (make_scheduler) keeps it, and asking for step there is refused
    lr_schedule: str = "constant"
    momentum: float = 0.9  # SGD momentum
    weight_decay: float = 0.0  # the optimizer's weight decay (torch's weight_decay)
    batch_size: int = 32  # mini-batch size of each local step
    shards: int = 4  # the data is cut into this many shards; a peer trains one
    seed: int = 0  # model init and shards are deterministic from it
    # budget per peer: this many steps (0 = none); given alone, the only budget (max_seconds is then 0)
    max_steps: int = _BUDGET_DEFAULTS["max_steps"]  # type: ignore[assignment]
    # budget per peer: this many seconds (0 = none); given alone, the only budget (max_steps is then 0)
    max_seconds: float = _BUDGET_DEFAULTS["max_seconds"]
    eval_every_seconds: float = 1.0  # test-set evaluation cadence for progress/metrics
    # how labels spread over shards: iid, dirichlet (label skew, partition_alpha), dirichlet-even (the same draw
    # cut into shards of equal size), classes-per-peer (partition_classes); each peer logs its class histogram
    # (gossiptrain.train.partition)
    partition: str = "iid"
    partition_alpha: float = 0.5  # dirichlet concentration: small = few classes per shard, large = near iid
    partition_classes: int = 2  # classes-per-peer: classes each shard holds (shards * this >= classes)

    def __post_init__(self) -> None:
        s = "train"
        given = frozenset(name for name, default in _BUDGET_DEFAULTS.items() if getattr(self, name) is not default)
        object.__setattr__(self, "_budgets_given", given)  # frozen: set once, here; not a field (not in the fingerprint)
        for name, default in _BUDGET_DEFAULTS.items():
            if name not in given:  # a budget given alone is the only budget: the other is off; given none, the default
                plain = float if isinstance(default, float) else int
                object.__setattr__(self, name, plain(0 if given else default))
        _require(bool(self.workload.strip()), f"{s}.workload", "must name a workload")
        _require(self.optimizer in OPTIMIZERS, f"{s}.optimizer", f"is {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
        _require(self.lr > 0 and math.isfinite(self.lr), f"{s}.lr", f"must be a positive number, got {self.lr}")
        _require(0 <= self.momentum < 1, f"{s}.momentum", f"must be in [0, 1), got {self.momentum}")
        _require(self.lr_schedule in LR_SCHEDULES, f"{s}.lr_schedule",
                 f"is {self.lr_schedule!r}; known: {', '.join(LR_SCHEDULES)}")
        _require(self.weight_decay >= 0, f"{s}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(self.batch_size >= 1, f"{s}.batch_size", f"must be >= 1, got {self.batch_size}")
        _require(self.shards >= 1, f"{s}.shards", f"must be >= 1, got {self.shards}")
        _require(self.max_steps >= 0, f"{s}.max_steps", f"must be >= 0, got {self.max_steps}")
        _require(self.lr_schedule != "step" or self.max_steps > 0, f"{s}.lr_schedule",
                 "step decays the rate at 75% and 90% of train.max_steps: give max_steps")
        _require(self.max_seconds >= 0, f"{s}.max_seconds", f"must be >= 0, got {self.max_seconds}")
        _require(self.eval_every_seconds > 0, f"{s}.eval_every_seconds", "must be > 0")
        # gossiptrain.train.partition.SCHEMES, spelled out: importing it would pull torch into config.
        schemes = ("iid", "dirichlet", "dirichlet-even", "classes-per-peer")
        _require(
            self.partition in schemes,
            f"{s}.partition",
            f"is {self.partition!r}; known schemes: {', '.join(schemes)}",
        )
        _require(
            self.partition_alpha > 0 and math.isfinite(self.partition_alpha),
            f"{s}.partition_alpha",
            f"must be a positive number, got {self.partition_alpha}",
        )
        _require(self.partition_classes >= 1, f"{s}.partition_classes", f"must be >= 1, got {self.partition_classes}")

    @property
    def budgets_given(self) -> frozenset[str]:
        """Which of ``max_steps`` and ``max_seconds`` were given (not left at their defaults)."""
        given: frozenset[str] = self.__dict__.get("_budgets_given", frozenset(_BUDGET_DEFAULTS))
        return given


#: How SGD momentum meets averaging (gossiptrain.protocol.momentum).
MOMENTA: tuple[str, ...] = ("auto", "local", "quasi-global")
#: The largest ``gossip.drift_gain`` accepted: 8 already diverged in the simulator on a 100 Mbit/s link.
MAX_DRIFT_GAIN = 8.0
#: The largest outer step local-sgd accepts, outer_lr / (1 - outer_momentum), and the largest outer momentum.
#: In the simulator (digits, 8 peers, exponential, H = 4; tests/test_algorithms_sim.py) 0.7/0.8 (3.5),
#: 1.0/0.7 (3.3), 0.5/0.9 (5) and 0.7/0.9 (7) went non-finite. The averaging nemesis
#: (gossiptrain.testing.averaging_nemesis: no gradients, faults, asynchronous rounds, 60 schedules each)
#: found more: 0.3/0.9 (3.0) drifted without any gradient (6 peers: 1,800 box widths away, peers 640
#: apart), 0.7/0.75 (2.8) and, rarely, 0.5/0.8 (2.5) left the box their extrapolation allows, and
#: momentum 0.92-0.96 left the peers 1e-4 apart after 300 healing rounds; 0.4/0.8, 1.0/0.5 and 0.6/0.7
#: (2.0) passed 150 schedules each, 2.0/0 and everything smaller passed too, and all train digits to 0.9.
MAX_OUTER_STEP = 2.0
MAX_OUTER_MOMENTUM = 0.8


#: ``gossip.topology``'s default: each algorithm's own graph (``GossipConfig.topology_spec``).
AUTO_TOPOLOGY = "auto"


@dataclass(frozen=True)
class GossipConfig:
    """How peers pick partners and average."""

    # auto: the algorithm's own graph (topology_spec): one-peer-exponential for push-sum (as SGP runs), exponential
    # for the others; or a name: ring, torus, hypercube, exponential, one-peer-exponential, complete (random peer),
    # erdos-renyi, random-regular, star, small-world, base-k, file:path=edges.txt; parameters as NAME:key=value,...
    # e.g. "random-regular:degree=4" (topologies.parse; `gossiptrain topology NAME --peers N` prints degree,
    # diameter and spectral gap)
    topology: str = "auto"
    # pairwise (AD-PSGD), push-sum (SGP), neighbor (D-PSGD) or local-sgd (ALGORITHMS)
    algorithm: str = "pairwise"
    # start at most one exchange per this many local steps: steps per exchange (pairwise), push (push-sum) or
    # round (neighbor)
    exchange_every_steps: int = 1
    # adaptive exchange timeout: floor (seconds). A reply 2 typical round trips late (or past what RFC 6298 computes
    # from the replies that came) is presumed lost before the timeout: it holds neither the loop nor a place in
    # flight, and is still applied if it comes (presumed_lost in the stats)
    exchange_timeout_min: float = 0.5
    exchange_timeout_max: float = 10.0  # adaptive exchange timeout: ceiling (seconds)
    # pairwise flow control: at most this many local steps past the last merge before a safe point waits for the
    # exchange in flight (never past its timeout); 0: automatic (gossiptrain.protocol.averaging.AUTO_STEPS_AHEAD)
    max_steps_ahead: int = 0
    # pairwise: exchanges a peer may have in flight at once, with different partners, each of weight 1/(k+1);
    # 0: automatic, as many as the link's latency (the shortest membership probe round trip lately) takes local
    # steps, at most 3, so 1 on a near link (gossiptrain.protocol.pairwise.PairwiseAveraging.concurrency)
    exchanges_in_flight: int = 0
    local_steps: int = 8  # local-sgd: local steps between averaging rounds (H)
    outer_lr: float = 1.0  # local-sgd: outer learning rate on the round's delta (1 and momentum 0: plain averaging)
    # local-sgd: Nesterov momentum of the outer optimizer; at most 0.8 (MAX_OUTER_MOMENTUM), and
    # outer_lr / (1 - outer_momentum) at most 2 (MAX_OUTER_STEP): beyond, the asynchronous outer step diverged in the
    # simulator (DiLoCo's synchronous 0.7/0.9 included) or drifted with no gradient under the averaging nemesis;
    # 1.0/0.5 and 0.4/0.8 train
    outer_momentum: float = 0.0
    # weight of an update s steps stale: constant (1), or polynomial: 1/(1+s)^staleness_exponent
    staleness_weighting: str = "constant"
    staleness_exponent: float = 0.5  # polynomial staleness weighting: an update s steps stale weighs 1/(1+s)^this
    staleness_bound: int = 0  # drop updates more than this many steps stale (0: no bound)
    # how SGD momentum meets averaging: quasi-global (the buffer follows the model's real change, merges included:
    # Lin et al. 2021; pairwise runs it while its safe points wait less than half the time for the link), local
    # (the optimizer's own); auto: local, since a user's model went to NaN with quasi-global
    # (gossiptrain.protocol.momentum says more); Adam is left alone
    momentum_mode: str = "auto"
    # drift correction (gossiptrain.protocol.drift): replay each merge this many times more, smoothed over 100 steps
    # (or 15 round trips of a far link); 0: off; at most 8 (MAX_DRIFT_GAIN); -1: auto (4)
    drift_gain: float = -1.0
    # The square-root scaling rule for the swarm's n-fold batch (gossiptrain.protocol.lr_scaling): auto steps
    # adaptive optimizers (Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, RMSprop; in the Python API the one found
    # stepping the model, or given as Peer(..., optimizer=opt)) at sqrt(members) x their rate, members counted at
    # most 16, and leaves SGD as set; sqrt: any optimizer; none: off. The rate is scaled only inside
    # optimizer.step(): schedulers and checkpoints see yours. Peer.stats()["lr_scale"] is the last step's multiplier.
    lr_scaling: str = "auto"
    # the stability guard (gossiptrain.protocol.stability): at a sign of a blow-up, back the added methods off, put
    # the model back and restart the optimizer; restore a non-finite model; false: off (the methods run as
    # configured whatever happens)
    guard: bool = True
    # what exchanges send: auto (none, fp16 or int8 as the measured link calls for; Peer.stats() and simulator rows
    # show it as compression_level 0/1/2), or fixed: none, fp16, bf16, int8, topk:ratio=R (neighbor and local-sgd
    # only: per-edge references); bytes are counted after compression
    compression: str = "auto"
    # against valid but poisoned models: clip each applied difference to robust_clip x the median of recent ones
    # and refuse those 10x beyond; neighbor rounds use a coordinate-wise trimmed mean (not with push-sum)
    robust: bool = False
    robust_clip: float = 3.0  # with robust: an applied difference is clipped to this x the median of recent ones
    robust_trim: float = 0.2  # neighbor/local-sgd with robust: fraction trimmed at each end, per coordinate
    # updates refused (by validation) within quarantine_seconds before their sender is quarantined: ignored (not a
    # partner, its messages refused) for quarantine_seconds; logged and counted
    quarantine_after: int = 3
    quarantine_seconds: float = 60.0  # how long a quarantined sender's exchanges are refused
    consensus_step: float = 0.0  # topk: step toward the neighbours' references (CHOCO's gamma); 0: min(1, 2 * ratio)

    @property
    def topology_spec(self) -> str:
        """The topology peers use: ``topology``, where ``auto`` is the algorithm's own graph.

        Push-sum's is the one-peer exponential graph, as in SGP: each member
        pushes to one member per round and, rounds being about aligned, hears
        from one, so its weight stays near 1; on a static graph, partners
        drawn at random left weights between 0.06 and 1.9 and the members
        with little weight trained on their own shard. On a real shaped link
        (experiments/wan.py, 4 peers, label-skewed digits-small, medians of 3
        seeds) 2.56 -> 1.79 s to 0.93 at 100 Mbit/s, 2.05 -> 1.78 s at
        1 Gbit/s. Every other algorithm: the static exponential graph.
        """
        if self.topology != AUTO_TOPOLOGY:
            return self.topology
        return "one-peer-exponential" if self.algorithm == "push-sum" else "exponential"

    def __post_init__(self) -> None:
        import topologies  # local: topologies is a sibling package, kept optional at import

        s = "gossip"
        try:
            topologies.parse(self.topology_spec)
        except ValueError as e:
            raise ConfigError(f"{s}.topology {self.topology!r}: {e}") from None
        _require(
            self.algorithm in ALGORITHMS,
            f"{s}.algorithm",
            f"is {self.algorithm!r}; known algorithms: {', '.join(ALGORITHMS)}",
        )
        _require(self.exchange_every_steps >= 1, f"{s}.exchange_every_steps", "must be >= 1")
        _require(self.exchange_timeout_min > 0, f"{s}.exchange_timeout_min", "must be > 0")
        _require(
            self.exchange_timeout_max >= self.exchange_timeout_min,
            f"{s}.exchange_timeout_max",
            "must be >= gossip.exchange_timeout_min",
        )
        _require(self.exchanges_in_flight >= 0, f"{s}.exchanges_in_flight", f"must be >= 0 (0: automatic), got {self.exchanges_in_flight}")
        _require(self.max_steps_ahead >= 0, f"{s}.max_steps_ahead", f"must be >= 0 (0: automatic), got {self.max_steps_ahead}")
        _require(self.local_steps >= 1, f"{s}.local_steps", f"must be >= 1, got {self.local_steps}")
        _require(
            0 < self.outer_lr <= 2 and math.isfinite(self.outer_lr), f"{s}.outer_lr", f"must be in (0, 2], got {self.outer_lr}"
        )
        _require(0 <= self.outer_momentum < 1, f"{s}.outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        effective = self.outer_lr / (1 - self.outer_momentum)  # the outer step's long-run size, heavy-ball style
        stable = "stable: outer_lr 1.0 with outer_momentum 0.5, or outer_lr 0.4 with outer_momentum 0.8"
        _require(
            self.outer_momentum <= MAX_OUTER_MOMENTUM + 1e-9,
            f"{s}.outer_momentum",
            f"is {self.outer_momentum:g}; above {MAX_OUTER_MOMENTUM:g} the asynchronous outer step drifts or keeps"
            f" the peers apart (DiLoCo's synchronous 0.9 included: see config.MAX_OUTER_STEP); {stable}",
        )
        _require(
            effective <= MAX_OUTER_STEP + 1e-9,
            f"{s}.outer_momentum",
            f"with outer_lr {self.outer_lr} makes an outer step of outer_lr / (1 - outer_momentum) = {effective:.2g};"
            f" above {MAX_OUTER_STEP:g} the asynchronous outer step diverges (digits, 8 simulated peers: every peer"
            f" non-finite at 0.7/0.9, DiLoCo's synchronous recipe); {stable}",
        )
        # gossiptrain.protocol.staleness.WEIGHTINGS, spelled out: config does not import the runtime.
        _require(
            self.staleness_weighting in ("constant", "polynomial"),
            f"{s}.staleness_weighting",
            f"is {self.staleness_weighting!r}; known: constant, polynomial",
        )
        _require(
            0 <= self.staleness_exponent <= 16,
            f"{s}.staleness_exponent",
            f"must be in [0, 16], got {self.staleness_exponent}",
        )
        _require(self.staleness_bound >= 0, f"{s}.staleness_bound", f"must be >= 0 (0: no bound), got {self.staleness_bound}")
        _require(0 <= self.consensus_step <= 1, f"{s}.consensus_step", f"must be in [0, 1] (0: auto), got {self.consensus_step}")
        _require(self.robust_clip >= 1, f"{s}.robust_clip", f"must be >= 1, got {self.robust_clip}")
        _require(0 <= self.robust_trim < 0.5, f"{s}.robust_trim", f"must be in [0, 0.5), got {self.robust_trim}")
        _require(
            not (self.robust and self.algorithm == "push-sum"),
            f"{s}.robust",
            "cannot be used with push-sum: clipping a push would destroy the mass push-sum conserves",
        )
        _require(self.quarantine_after >= 1, f"{s}.quarantine_after", f"must be >= 1, got {self.quarantine_after}")
        _require(self.quarantine_seconds >= 0, f"{s}.quarantine_seconds", f"must be >= 0, got {self.quarantine_seconds}")
        _require(
            self.drift_gain == -1 or 0 <= self.drift_gain <= MAX_DRIFT_GAIN, f"{s}.drift_gain",
            f"is {self.drift_gain:g}; use 0 (off) up to {MAX_DRIFT_GAIN:g}, or -1 (auto: 4)",
        )
        _require(
            self.lr_scaling in ("auto", "none", "sqrt"),  # gossiptrain.protocol.lr_scaling.MODES
            f"{s}.lr_scaling",
            f"is {self.lr_scaling!r}; choose from auto, none, sqrt",
        )
        _require(self.momentum_mode in MOMENTA, f"{s}.momentum_mode", f"is {self.momentum_mode!r}; choose from {', '.join(MOMENTA)}")
        codec = self.compression.strip().partition(":")[0]
        _require(
            codec in ("auto", "none", "fp16", "bf16", "int8", "topk"),
            f"{s}.compression",
            f"is {self.compression!r}; known codecs: auto, none, fp16, bf16, int8, topk",
        )
        _require(
            codec != "topk" or self.algorithm in _EDGE_ALGORITHMS,
            f"{s}.compression",
            f"topk sends differences against per-edge references, which only {' and '.join(_EDGE_ALGORITHMS)} keep; "
            f"use fp16, bf16 or int8 with {self.algorithm}",
        )
        if codec not in ("none", "auto"):  # parameters too (ratio=, stochastic=)
            parse_codec_spec(self.compression, f"{s}.compression")


@dataclass(frozen=True)
class MembershipConfig:
    """SWIM failure detection (with Lifeguard's refinements) and joining.

    Only ``heartbeat_interval`` (the protocol period) sets a time scale; every
    timeout is derived from it, from the swarm's size, and from round-trip
    times measured at run time, so nothing here needs tuning per network.
    """

    # SWIM's protocol period: seconds between our probes of one member (each member probes one other per period);
    # the only time scale of failure detection (stretched where measured round trips need longer: three probe timeouts)
    heartbeat_interval: float = 0.5
    indirect_probes: int = 3  # members asked to probe a member that missed its direct ack (SWIM's k)
    suspicion_mult: float = 4.0  # a suspect is dead after at least mult * max(1, log10 n) periods unrefuted
    # a lone suspicion waits up to this times suspicion_mult's timeout, shrinking to it as independent suspicions
    # confirm it (Lifeguard)
    suspicion_max_mult: float = 9.0
    # independent suspicions that shrink the timeout to its minimum (Lifeguard's K; capped by the members that
    # could confirm at all: in a swarm of 3 the one other survivor is enough)
    suspicion_confirmations: int = 3
    retransmit_mult: int = 4  # an update rides on mult * ceil(log10(n + 1)) messages
    max_piggyback: int = 8  # updates carried per probe message (bounds every message)
    min_probe_timeout: float = 0.01  # floor of the RTT-derived direct probe timeout (seconds)
    max_health: int = 8  # Lifeguard's local health multiplier: periods and timeouts stretch up to (1 + this)x
    # at most this many seconds between full-view exchanges with one member (anti-entropy; a newcomer's first ones
    # come sooner)
    sync_interval: float = 10.0
    # seconds a welcomed member may take to start (build its model; its state download comes after) before it is
    # probed or, if it never starts, dropped
    newcomer_grace: float = 15.0
    tombstone_rounds: int = 120  # periods a dead/left member is remembered (blocks stale resurrection)
    probe_dead_every: int = 4  # every this many periods, send our view to one member we think dead
    candidate_probes: int = 16  # probes a period of members heard of but not verified yet (limits.candidates)
    verdicts_per_sender: int = 8  # suspicions and deaths of others taken from one member a period; more are ignored
    report_interval: float = 2.0  # seconds between reports to the coordinator
    join_timeout: float = 2.0  # seconds to wait for an answer to one join attempt
    join_attempts: int = 5  # attempts before giving up, join_timeout seconds each
    sample_size: int = 16  # members handed to a newcomer

    def __post_init__(self) -> None:
        s = "membership"
        _require(0 < self.heartbeat_interval < math.inf, f"{s}.heartbeat_interval", "must be a positive number")
        _require(self.indirect_probes >= 0, f"{s}.indirect_probes", "must be >= 0")
        _require(1 <= self.suspicion_mult < math.inf, f"{s}.suspicion_mult", "must be >= 1")
        _require(1 <= self.suspicion_max_mult < math.inf, f"{s}.suspicion_max_mult", "must be >= 1")
        _require(self.suspicion_confirmations >= 1, f"{s}.suspicion_confirmations", "must be >= 1")
        _require(self.retransmit_mult >= 1, f"{s}.retransmit_mult", "must be >= 1")
        _require(self.max_piggyback >= 1, f"{s}.max_piggyback", "must be >= 1")
        _require(
            0 < self.min_probe_timeout < self.heartbeat_interval / 2,
            f"{s}.min_probe_timeout",
            "must be > 0 and below half of membership.heartbeat_interval",
        )
        _require(self.max_health >= 0, f"{s}.max_health", "must be >= 0")
        _require(0 < self.sync_interval < math.inf, f"{s}.sync_interval", "must be a positive number")
        _require(0 < self.newcomer_grace < math.inf, f"{s}.newcomer_grace", "must be a positive number")
        _require(self.tombstone_rounds >= 1, f"{s}.tombstone_rounds", "must be >= 1")
        _require(self.probe_dead_every >= 1, f"{s}.probe_dead_every", "must be >= 1")
        _require(self.candidate_probes >= 1, f"{s}.candidate_probes", "must be >= 1")
        _require(self.verdicts_per_sender >= 1, f"{s}.verdicts_per_sender", "must be >= 1")
        _require(self.report_interval > 0, f"{s}.report_interval", "must be > 0")
        _require(self.join_timeout > 0, f"{s}.join_timeout", "must be > 0")
        _require(self.join_attempts >= 1, f"{s}.join_attempts", "must be >= 1")
        _require(self.sample_size >= 1, f"{s}.sample_size", "must be >= 1")

    def suspicion_timeout(self, members: int) -> float:
        """Seconds a suspicion confirmed by enough independent members waits for a refutation.

        A refutation needs about log(n) periods to spread back, so the
        timeout grows with the swarm (memberlist's log10 scaling).
        """
        return self.heartbeat_interval * self.suspicion_mult * max(1.0, math.log10(members))

    def suspicion_timeout_max(self, members: int) -> float:
        """Seconds an unconfirmed suspicion waits: a lone suspector may be the one in trouble (Lifeguard)."""
        return self.suspicion_max_mult * self.suspicion_timeout(members)

    def retransmits(self, members: int) -> int:
        """Messages each membership update rides on before it is dropped from the piggyback queue."""
        return self.retransmit_mult * max(1, math.ceil(math.log10(members + 1)))

    def dead_within(self, members: int) -> float:
        """A high-probability bound on how long a crashed member stays in any live member's view.

        Some member probes it within about ln(n) + 4 periods (each period every
        member probes one other, so a given member is missed by all with
        probability about 1/e per period); the probe fails within one more; the
        suspicion reaches everyone within about 2 log2(n) periods of
        piggybacking; then the slowest (unconfirmed) suspicion timer runs out.
        """
        periods = math.ceil(math.log(members + 1)) + 5 + 2 * math.ceil(math.log2(members + 1))
        return periods * self.heartbeat_interval + self.suspicion_timeout_max(members)


@dataclass(frozen=True)
class StateConfig:
    """State transfer: a newcomer downloads a live member's model before training (gossiptrain.protocol.state_transfer)."""

    enabled: bool = True  # download when another member is alive; off: newcomers start from the initial weights
    chunk_bytes: int = 4 << 20  # bytes per chunk request (one round trip each); the same for every member
    window: int = 2  # chunk requests in flight to one donor
    request_timeout: float = 5.0  # seconds without an answer before another donor is tried (> a donor's step time)
    busy_backoff: float = 1.0  # seconds before a donor that refused for now (busy, not ready) is asked again
    max_donors: int = 6  # donor sessions tried before giving up
    max_seconds: float = 120.0  # the whole download; after it the newcomer trains from its own initial weights
    max_bytes_per_second: float = 0.0  # pace chunk requests to this rate (0: as fast as donors answer)
    donor_sessions: int = 2  # sessions a donor serves at a time; more are refused, so newcomers spread over donors
    session_timeout: float = 30.0  # a donor drops a session (and its snapshot) idle this long
    transfer_step: bool = False  # also continue the donor's step count (it then counts toward train.max_steps)
    # also download the donor's optimizer state (momentum buffers; Adam's moments), checked against the newcomer's
    # optimizer
    transfer_optimizer: bool = False

    def __post_init__(self) -> None:
        s = "state"
        _require(self.chunk_bytes >= 1024, f"{s}.chunk_bytes", f"must be >= 1024, got {self.chunk_bytes}")
        _require(self.window >= 1, f"{s}.window", f"must be >= 1, got {self.window}")
        _require(
            0 < self.request_timeout < math.inf, f"{s}.request_timeout", f"must be a positive number, got {self.request_timeout}"
        )
        _require(0 <= self.busy_backoff < math.inf, f"{s}.busy_backoff", f"must be >= 0, got {self.busy_backoff}")
        _require(self.max_donors >= 1, f"{s}.max_donors", f"must be >= 1, got {self.max_donors}")
        _require(0 < self.max_seconds < math.inf, f"{s}.max_seconds", f"must be a positive number, got {self.max_seconds}")
        _require(
            0 <= self.max_bytes_per_second < math.inf,
            f"{s}.max_bytes_per_second",
            f"must be >= 0 (0: no pacing), got {self.max_bytes_per_second}",
        )
        _require(self.donor_sessions >= 1, f"{s}.donor_sessions", f"must be >= 1, got {self.donor_sessions}")
        _require(
            0 < self.session_timeout < math.inf, f"{s}.session_timeout", f"must be a positive number, got {self.session_timeout}"
        )


@dataclass(frozen=True)
class DataConfig:
    """Which samples a peer trains: its fixed shard, or chunks of the whole dataset leased through the swarm
    (gossiptrain.protocol.leases: every peer can read all of the data; fast peers train more, a dead peer's
    chunks are taken over, each sample is trained once an epoch)."""

    mode: str = "shards"  # shards (train.shard of train.shards, fixed at join) or leased
    chunks: int = 0  # chunks per epoch when leased (0: 256, fewer so that each holds at least 128 samples)
    lease_time: float = 10.0  # a peer that trains nothing this long loses its chunks to the others
    gossip_interval: float = 0.2  # seconds between a peer's pushes of its lease table
    ahead_seconds: float = 2.0  # a peer holds claims for this long of its own pace (1 chunk at least)
    max_held: int = 16  # chunks one peer holds at once at most

    def __post_init__(self) -> None:
        s = "data"
        _require(self.mode in ("shards", "leased"), f"{s}.mode", f"is {self.mode!r}; choose from shards, leased")
        _require(self.chunks >= 0, f"{s}.chunks", f"must be >= 0 (0: automatic), got {self.chunks}")
        for name in ("lease_time", "gossip_interval", "ahead_seconds"):
            value = getattr(self, name)
            _require(0 < value < math.inf, f"{s}.{name}", f"must be a positive number of seconds, got {value}")
        _require(self.lease_time >= 5 * self.gossip_interval, f"{s}.lease_time",
                 f"must be at least 5 gossip intervals ({5 * self.gossip_interval} s): claims must spread before they expire")
        _require(self.max_held >= 1, f"{s}.max_held", f"must be >= 1, got {self.max_held}")


@dataclass(frozen=True)
class FinalConfig:
    """The end of a run (gossiptrain.protocol.finish): wait for the others, average without training, merge, leave."""

    wait_seconds: float = 10.0  # a peer whose budget is spent keeps averaging until every live member is done, this long at most
    consensus_seconds: float = 1.0  # then everyone averages this long without local steps
    merge_seconds: float = 60.0  # bound on writing the merged model (peer --final-model), and on the others waiting for it

    def __post_init__(self) -> None:
        s = "final"
        for name in ("wait_seconds", "consensus_seconds"):
            value = getattr(self, name)
            _require(0 <= value < math.inf, f"{s}.{name}", f"must be a number of seconds >= 0, got {value}")
        _require(0 < self.merge_seconds < math.inf, f"{s}.merge_seconds", f"must be a positive number, got {self.merge_seconds}")


@dataclass(frozen=True)
class RunConfig:
    """Everything a swarm agrees on. Its fingerprint identifies the run."""

    train: TrainConfig = field(default_factory=TrainConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    limits: Limits = field(default_factory=Limits)
    state: StateConfig = field(default_factory=StateConfig)
    final: FinalConfig = field(default_factory=FinalConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        _require(
            self.state.chunk_bytes <= self.limits.max_frame_bytes,
            "state.chunk_bytes",
            f"must be <= limits.max_frame_bytes ({self.limits.max_frame_bytes}): a chunk travels as one frame",
        )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @property
    def fields_given(self) -> frozenset[str]:
        """Dotted names of the fields this configuration was given, whatever their values: the keys its TOML
        file and overrides wrote (``from_toml``, ``with_overrides``, ``from_dict(given=...)``); for one built
        otherwise, the fields not at their defaults.

        What a newcomer that brings this configuration is compared on when it joins, the rest it takes from
        the swarm (``gossiptrain.protocol.joining``). Not part of the run: not in its fingerprint, nor in ``==``.
        """
        given: frozenset[str] | None = self.__dict__.get("_fields_given")
        if given is None:
            defaults = RunConfig().to_dict()
            given = frozenset(f"{section}.{name}" for section, values in self.to_dict().items()
                              for name, value in values.items() if value != defaults[section][name])
        return given

    def _record_given(self, names: Any) -> "RunConfig":
        """Record ``names`` (dotted field names) as the fields given; unknown ones raise ConfigError."""
        if not isinstance(names, (list, tuple, set, frozenset)) or not all(type(n) is str for n in names):
            raise ConfigError("the fields given must be a list of dotted field names")
        known = {f"{section}.{name}" for section, values in self.to_dict().items() for name in values}
        unknown = [repr(n) for n in names if n not in known]
        if unknown:
            raise ConfigError(f"unknown field(s) given: {', '.join(sorted(unknown)[:5])}")
        object.__setattr__(self, "_fields_given", frozenset(names))  # frozen: not a field (see fields_given)
        return self

    def fingerprint(self) -> str:
        """A short hash of the whole configuration; equal runs have equal fingerprints."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def diff(self, other: "RunConfig") -> list[str]:
        """Dotted names of the fields whose values differ, as 'name: ours vs theirs'."""
        mine, theirs = self.to_dict(), other.to_dict()
        out = []
        for section, values in mine.items():
            for name, value in values.items():
                if theirs[section][name] != value:
                    out.append(f"{section}.{name}: {value!r} vs {theirs[section][name]!r}")
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], given: Any = None) -> "RunConfig":
        """Build from nested mappings (TOML, msgpack). Unknown or ill-typed fields raise ConfigError.

        ``given``: the dotted names of the fields it was given (``fields_given``), if known.
        """
        if not isinstance(data, Mapping):
            raise ConfigError("configuration must be a table of sections")
        sections = {f.name: f.type for f in fields(cls)}
        unknown = [str(k) for k in data if k not in sections]
        if unknown:
            raise ConfigError(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(sections)}")
        kwargs = {}
        for f in fields(cls):
            section_cls = _SECTIONS[f.name]
            values = data.get(f.name, {})
            if not isinstance(values, Mapping):
                raise ConfigError(f"{f.name} must be a table of fields")
            kwargs[f.name] = _build_section(section_cls, f.name, values)
        config = cls(**kwargs)
        return config._record_given(given) if given is not None else config

    @classmethod
    def from_toml(cls, path: str | Path) -> "RunConfig":
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"cannot read configuration file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"configuration file {path} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:  # TOML is UTF-8
            bad = e.object[e.start:e.start + 1]
            raise ConfigError(f"configuration file {path} is not UTF-8 text (byte {e.start}: {bad!r})") from None
        config = cls.from_dict(data)  # checks every key: what follows names known fields only
        return config._record_given([f"{section}.{name}" for section, values in data.items() for name in values])

    def with_overrides(self, overrides: Mapping[str, Any]) -> "RunConfig":
        """A copy with dotted fields replaced, e.g. {"train.lr": 0.1}. Strings are parsed by field type.

        A budget this configuration was not given stays not given unless
        overridden, so an override of one budget alone is the only budget
        (see ``TrainConfig``). The fields overridden join ``fields_given``.
        """
        current = self.to_dict()
        data = {section: dict(values) for section, values in current.items()}
        for name in _BUDGET_DEFAULTS:
            if name not in self.train.budgets_given:
                del data["train"][name]
        for dotted, value in overrides.items():
            section, _, name = dotted.partition(".")
            if section not in current or name not in current[section]:
                raise ConfigError(f"unknown field {dotted!r}; see `gossiptrain config` for all fields")
            ftype = type(current[section][name])
            data[section][name] = _parse_value(dotted, value, ftype) if isinstance(value, str) else value
        return RunConfig.from_dict(data, given=[*self.fields_given, *overrides])


_SECTIONS: dict[str, type] = {
    "train": TrainConfig,
    "gossip": GossipConfig,
    "membership": MembershipConfig,
    "limits": Limits,
    "state": StateConfig,
    "final": FinalConfig,
    "data": DataConfig,
}


def _parse_value(name: str, text: str, ftype: type) -> Any:
    try:
        if ftype is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return ftype(text)
    except ValueError:
        raise ConfigError(f"{name} must be of type {ftype.__name__}, got {text!r}") from None


def _build_section(section_cls: type, section: str, values: Mapping[str, Any]) -> Any:
    known = {f.name: f for f in fields(section_cls)}
    unknown = [str(k) for k in values if k not in known]
    if unknown:
        raise ConfigError(
            f"unknown field(s) {', '.join(section + '.' + u for u in unknown)}; "
            f"known in [{section}]: {', '.join(known)}"
        )
    defaults = section_cls()
    kwargs = {}
    for name, value in values.items():
        expected = type(getattr(defaults, name))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not expected:
            raise ConfigError(
                f"{section}.{name} must be of type {expected.__name__}, got {type(value).__name__} {value!r}"
            )
        kwargs[name] = value
    return section_cls(**kwargs)


def describe_fields() -> str:
    """Every configuration field with its default, for `gossiptrain config` and the README."""
    lines = []
    for section, cls in _SECTIONS.items():
        lines.append(f"[{section}]")
        for f in fields(cls):
            lines.append(f"{f.name} = {json.dumps(getattr(cls(), f.name))}")
        lines.append("")
    return "\n".join(lines)
