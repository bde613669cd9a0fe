"""The `gossiptrain` command: coordinator, peer, export, stop, demo and config.

Run flags map onto the same dotted fields as a TOML file (``--lr`` is
``train.lr``; ``--set section.field=value`` reaches any field), so a file and
flags can be mixed: flags win. A budget given alone (``--steps`` or
``--seconds``, by flag, ``--set`` or file) is the only budget. Errors a user
can fix print one line naming the problem and exit with status 2, before
anything heavy (torch, the model) starts where the flags alone show it.
Ctrl+C or SIGTERM stops a training peer gracefully (it leaves and writes its
summary); it then exits 130 after Ctrl+C, as every command does, and 0 after
SIGTERM. During a join (its state download included: a member by then
leaves as cleanly) or the demo, either aborts with status 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from gossiptrain.cli.common import (
    EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, check_join, check_output_path, setup_logging,
)
from gossiptrain.config import RunConfig, SecurityConfig, describe_fields
from gossiptrain.errors import ConfigError, GossipError, WorkloadError
from gossiptrain.net.addressing import is_wildcard, parse_host, parse_hostport, plain_address
from gossiptrain.protocol.reachability import AUTO, MODES, REACHABLE_ENV, check_mode

# flag -> dotted config field
_RUN_FLAGS: dict[str, tuple[str, type, str]] = {
    "--workload": ("train.workload", str, "digits, digits-small, logreg, charlm, or module:attr of your own"),
    "--topology": ("gossip.topology", str, "auto (the algorithm's own: push-sum one-peer-exponential, others exponential), a name or NAME:k=v,... spec; `gossiptrain topology --help`"),
    "--algorithm": ("gossip.algorithm", str, "pairwise, push-sum, neighbor or local-sgd"),
    "--momentum-mode": ("gossip.momentum_mode", str, "auto (default: the optimizer's own, as local), local, quasi-global (opt-in; pairwise runs it while the link keeps up): how SGD momentum meets averaging"),
    "--lr-scaling": ("gossip.lr_scaling", str, "auto (default: adaptive optimizers such as Adam step at sqrt(members) x lr, the rule for an n-fold batch; SGD as set), sqrt, none"),
    "--drift-gain": ("gossip.drift_gain", float, "replay merges this many times more, smoothed, against label-skew drift (0: off; -1: auto, 4)"),
    "--compression": ("gossip.compression", str, "auto (default: none, fp16 or int8, as the link calls for), none, fp16, bf16, int8, topk:ratio=R (neighbor, local-sgd)"),
    "--max-steps-ahead": ("gossip.max_steps_ahead", int, "pairwise flow control: local steps past the last merge before waiting for the exchange in flight (0: automatic)"),
    "--exchanges-in-flight": ("gossip.exchanges_in_flight", int, "pairwise: exchanges a peer keeps in flight at once, each of weight 1/(k+1) (0: automatic, as many as the link's latency takes steps, at most 3)"),
    "--local-steps": ("gossip.local_steps", int, "local-sgd: local steps between averaging rounds"),
    "--outer-lr": ("gossip.outer_lr", float, "local-sgd: outer learning rate (DiLoCo-style outer optimizer)"),
    "--outer-momentum": ("gossip.outer_momentum", float, "local-sgd: outer Nesterov momentum (0: none; at most 0.8, and outer-lr / (1 - this) at most 2)"),
    "--staleness-weighting": ("gossip.staleness_weighting", str, "constant, or polynomial: 1/(1+s)^exponent"),
    "--staleness-bound": ("gossip.staleness_bound", int, "drop updates more than this many steps stale (0: none)"),
    "--lr": ("train.lr", float, "learning rate"),
    "--lr-schedule": ("train.lr_schedule", str, "constant, or step: x0.1 after 75%% of --steps and x0.01 after 90%%"),
    "--optimizer": ("train.optimizer", str, "sgd (with --lr and train.momentum) or adam"),
    "--batch-size": ("train.batch_size", int, "mini-batch size"),
    "--shards": ("train.shards", int, "number of data shards (usually the number of peers)"),
    "--steps": ("train.max_steps", int, "step budget per peer (0: none); given alone, the only budget"),
    "--seconds": ("train.max_seconds", float, "time budget per peer in seconds (0: none); given alone, the only budget"),
    "--seed": ("train.seed", int, "seed of model init and shards"),
    "--partition": ("train.partition", str, "how data is split over shards: iid, dirichlet, dirichlet-even, classes-per-peer"),
    "--partition-alpha": ("train.partition_alpha", float, "Dirichlet concentration (smaller: more label skew)"),
    "--partition-classes": ("train.partition_classes", int, "classes per shard for classes-per-peer"),
    "--data": ("data.mode", str, "shards (each peer its shard, fixed) or leased (chunks of the whole dataset, leased through the swarm: fast peers train more, a dead peer's chunks are taken over; every peer must read all the data)"),
}


#: How a default reads where the value alone would mislead.
_DEFAULT_NOTES = {"--steps": "2000, or 0 when only a time budget is given", "--seconds": "0: none"}

#: The run-flag defaults `gossiptrain peer --help` shows: a peer runs the swarm's configuration.
PEER_RUN_DEFAULTS = {flag: "as the swarm runs" for flag in _RUN_FLAGS}
_PEER_RUN_FLAGS = (
    "A peer runs the swarm's configuration. Given any of these, it expects that run and is refused by a swarm "
    "running anything else in a field given (a flag, --set or a key of the --config file, whatever its value, "
    "a default's too); the fields it does not set it takes from the swarm."
)


def _add_run_flags(
    p: argparse.ArgumentParser, defaults: Mapping[str, str] | None = None, description: str | None = None
) -> None:
    """The run flags, each with its field and default in --help; ``defaults`` overrides what a flag's default reads."""
    config = RunConfig().to_dict()
    g = p.add_argument_group("run configuration (shared by the swarm)", description)
    g.add_argument("--config", metavar="FILE",
                   help="TOML file with [train], [gossip], [membership], [limits], [state], [final] (default: none; "
                   "`gossiptrain config` prints every field's default)")
    for flag, (field, ftype, help_text) in _RUN_FLAGS.items():
        section, _, name = field.partition(".")
        shown = (defaults or {}).get(flag) or _DEFAULT_NOTES.get(flag) or str(config[section][name])
        g.add_argument(flag, type=ftype, metavar=ftype.__name__.upper(), help=f"{help_text} ({field}; default {shown})")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any field, e.g. gossip.exchange_every_steps=2 (repeatable; default: none)")


def _count(kind: str, least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least``, refused with the value named (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {kind} (>= {least}), got {value}")
        return value

    return parse


def _number(kind: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: a float for which ``ok`` holds, refused with the value named (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text}")
        return value

    return parse


def _run_config(args: argparse.Namespace) -> RunConfig:
    config = RunConfig.from_toml(args.config) if args.config else RunConfig()
    overrides: dict[str, Any] = {}
    for flag, (field, _, _) in _RUN_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides[field] = value
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} must look like FIELD=VALUE, e.g. train.lr=0.1")
        overrides[key.strip()] = value.strip()
    return config.with_overrides(overrides) if overrides else config


def _explicit_run_config(args: argparse.Namespace) -> RunConfig | None:
    """The run a peer expects, only if the user described one."""
    given = args.config or args.set or any(getattr(args, f.lstrip("-").replace("-", "_")) is not None for f in _RUN_FLAGS)
    return _run_config(args) if given else None


def _check_workload(config: RunConfig) -> None:
    """Fail at start, not in every peer after it joins, if the workload cannot be loaded."""
    from gossiptrain.train.workload import EXTERNAL, load_workload

    if config.train.workload != EXTERNAL:
        try:
            load_workload(config.train.workload)
        except WorkloadError as e:
            raise ConfigError(f"train.workload: {e}") from None


# -- commands ----------------------------------------------------------------------------


def _add_security_flags(p: argparse.ArgumentParser, peer: bool) -> None:
    g = p.add_argument_group("security (CURVE; see SECURITY.md)")
    g.add_argument("--secure", action="store_true", help="encrypt, and admit only members whose public key is in --allow")
    g.add_argument("--key", metavar="FILE", help="this member's NAME.key_secret (`gossiptrain keys new`; required with --secure)")
    g.add_argument("--allow", metavar="DIR",
                   help="directory of the public keys (*.key) allowed to connect (required with --secure)")
    if peer:
        g.add_argument("--server-key", metavar="FILE",
                       help="public key (NAME.key) of the --join target (default: DIR/coordinator.key of --allow)")


def _security(args: argparse.Namespace) -> SecurityConfig | None:
    """The CURVE settings the flags describe, or None for an open swarm."""
    flags = [f for f in ("key", "allow", "server_key") if getattr(args, f, None)]
    if not args.secure:
        if flags:
            raise ConfigError(f"--{flags[0].replace('_', '-')} takes effect only with --secure")
        return None
    if not args.key:
        raise ConfigError("--secure needs --key FILE: this member's NAME.key_secret (make one: gossiptrain keys new DIR --name NAME)")
    if not args.allow:
        raise ConfigError("--secure needs --allow DIR: a directory with the public key (NAME.key) of every member allowed in")
    return SecurityConfig(args.key, args.allow, getattr(args, "server_key", None))


def cmd_coordinator(args: argparse.Namespace) -> int:
    parse_hostport(args.bind, "--bind")  # what the flags alone show to be wrong fails before anything heavy starts
    config = _run_config(args)
    security = _security(args)
    from gossiptrain.runtime.coordinator_process import run_coordinator_forever
    from gossiptrain.train.model_spec import workload_spec
    from gossiptrain.train.workload import EXTERNAL

    setup_logging(args.verbose, logging.INFO)
    _check_workload(config)
    spec = workload_spec(config)  # a named workload's model: joins with another are refused from the first

    metrics: list[Any] = []  # the Prometheus exporter, once the coordinator is up
    if args.prometheus is not None:
        from gossiptrain.train.prometheus import check_available, parse_listen

        listen_at = parse_listen(args.prometheus)
        check_available()

    def ready(coord: Any) -> None:
        host_port = plain_address(coord.address).removeprefix("tcp://")
        where = ""
        bound, port = parse_hostport(host_port)
        if is_wildcard(bound):  # bound to every interface: not an address to dial
            host_port = f"HOST:{port}"
            families = ", IPv4 or IPv6" if bound == "::" else ""  # [::] takes IPv4 too (IPv4-mapped)
            where = f" (HOST: any address of this machine the peers can reach{families})"
        print(f"coordinator listening on {coord.address} (run {config.fingerprint()})", flush=True)
        if args.prometheus is not None:
            from gossiptrain.train.prometheus import PrometheusExporter, coordinator_families

            collect = coordinator_families(lambda: {**coord.stats.to_dict(), **coord.finish.stats.to_dict()},
                                           lambda: coord.member_count)
            metrics.append(PrometheusExporter(*listen_at, collect=collect))
            print(f"Prometheus metrics at {metrics[0].url}", flush=True)
        if config.train.workload != EXTERNAL and not config.train.max_steps and not config.train.max_seconds:
            print("no budget (train.max_steps and train.max_seconds are 0): the peers train until "
                  "`gossiptrain stop`", flush=True)
        if config.train.workload == EXTERNAL:  # a CLI peer has no model of its own to bring: the Python API
            secured = "" if security is None else ", security=SecurityConfig(YOURS.key_secret, DIR, COORDINATOR.key)"
            print(f'join with: gossiptrain.Peer(model, join="{host_port}"{secured}) in your own training loop '
                  f"(--workload external: peers bring their own model, `gossiptrain peer` has none){where}", flush=True)
        elif security is None:
            print(f"join with: gossiptrain peer --join {host_port}{where}", flush=True)
        else:
            print(
                f"join with: gossiptrain peer --join {host_port} --secure --key YOURS.key_secret --allow DIR "
                f"--server-key COORDINATOR.key (this coordinator's public key; DIR must hold it too){where}",
                flush=True,
            )

    try:
        run_coordinator_forever(config, args.bind, ready, security, spec, relay=args.relay)
    finally:
        for exporter in metrics:
            exporter.close()
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from gossiptrain.net.keys import default_name, new_keypair

    public, secret = new_keypair(args.dir, args.name or default_name())
    print(f"public key: {public}  (copy it into the --allow DIR of every member)", flush=True)
    print(f"secret key: {secret}  (stays on this machine; pass it as --key)", flush=True)
    return 0


def cmd_peer(args: argparse.Namespace) -> int:
    import json

    from gossiptrain.train.metrics import check_metrics_path

    # What the flags alone show to be wrong fails here, in milliseconds: before torch is imported.
    check_join(args.join)
    if args.bind:
        parse_hostport(args.bind, "--bind")
    if args.advertise:
        parse_host(args.advertise, "--advertise")
    if args.checkpoint_dir is None:
        for flag in ("checkpoint_every", "checkpoint_every_steps", "checkpoint_keep"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --checkpoint-dir DIR")
    if args.checkpoint_dir is not None:
        check_output_path(args.checkpoint_dir, "--checkpoint-dir", directory=True)
    if args.metrics:
        check_metrics_path(args.metrics, "--metrics")
    if args.tensorboard:
        from pathlib import Path

        from gossiptrain.train.tensorboard import check_available

        check_available("--tensorboard")
        check_metrics_path(Path(args.tensorboard) / "events", "--tensorboard")
    if args.prometheus:
        from gossiptrain.train import prometheus

        prometheus.parse_listen(args.prometheus)
        prometheus.check_available("--prometheus")
    expect = _explicit_run_config(args)
    security = _security(args)

    from gossiptrain.train.peer_loop import PeerOptions, run_peer

    setup_logging(args.verbose, logging.WARNING)
    checkpointing = {"checkpoint_every_seconds": args.checkpoint_every, "checkpoint_every_steps": args.checkpoint_every_steps,
             "checkpoint_keep": args.checkpoint_keep}
    options = PeerOptions(
        join=args.join,
        bind=args.bind,
        advertise=args.advertise,
        metrics=args.metrics,
        tensorboard=args.tensorboard,
        prometheus=args.prometheus,
        expect=expect,
        shard=args.shard,
        join_attempts=args.join_attempts,
        slowdown=args.slowdown,
        threads=args.threads,
        wait_for=args.wait_for,
        progress=not args.quiet,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        resume_any_run=args.resume_any_run,
        security=security,
        final_model=args.final_model,
        reachable=check_mode(args.reachable, f"--reachable (or ${REACHABLE_ENV})"),
        relay=args.relay,
        shard_model=args.shard_model,
        **{k: v for k, v in checkpointing.items() if v is not None},
    )
    from gossiptrain.train.peer_workers import WorkerFailed, Workers, start_other_workers, wait_for_workers

    workers, children = Workers.from_environment(), []
    if workers is not None and workers.rank > 0:  # one of the other workers: rank 0 decides for the group
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        options = replace(options, workers=workers, progress=False)
        try:
            run_peer(options)
        except WorkerFailed as e:
            print(f"gossiptrain peer: error: {e}", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_OK
    if workers is None and args.nproc_per_peer > 1:
        workers, children = start_other_workers(args.argv, args.nproc_per_peer)
    options = replace(options, workers=workers)
    stop = threading.Event()
    training = threading.Event()
    interrupted = threading.Event()  # Ctrl+C (SIGINT), not SIGTERM: the exit status says which stopped us

    def on_signal(signum: int) -> None:
        if not training.is_set():
            _interrupt()  # during the join: abort
        if signum == signal.SIGINT:
            interrupted.set()
        stop.set()  # training: leave gracefully, write the summary

    try:
        with _on_stop_signals(on_signal):
            summary = run_peer(options, stop, on_training=training.set)
    except WorkerFailed as e:
        print(f"gossiptrain peer: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        failed = [i + 1 for i, rc in enumerate(wait_for_workers(children, timeout=0 if stop.is_set() else 30)) if rc != 0]
    if failed:
        print(f"gossiptrain peer: worker(s) {', '.join(map(str, failed))} of this peer failed", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(summary, separators=(",", ":")), flush=True)
    return EXIT_INTERRUPTED if interrupted.is_set() else EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gossiptrain.cli.demo import DemoOptions, format_table, run_demo, summary_json

    setup_logging(args.verbose, logging.WARNING)
    options = DemoOptions(
        peers=args.peers, target=args.target, timeout=args.timeout, workdir=Path(args.workdir) if args.workdir else None
    )
    with _on_stop_signals(lambda signum: _interrupt()):
        summary = run_demo(options)
    print(format_table(summary), flush=True)
    if args.json:
        print(summary_json(summary), flush=True)
    return 0 if summary["reached"] else 1


def cmd_simulate(args: argparse.Namespace) -> int:
    from gossiptrain.cli.simulate import run_simulate

    setup_logging(args.verbose, logging.WARNING, wall_time=False)  # the simulated peers' records say their virtual time
    run = _run_config(args)
    if not args.config:
        # Simulated peers default to one shard each and to the simulation's duration as their budget.
        defaults: dict[str, Any] = {}
        if args.shards is None:
            defaults["train.shards"] = args.peers
        if "max_steps" not in run.train.budgets_given:  # not by --steps, nor by --set train.max_steps=N
            defaults["train.max_steps"] = 0
        run = run.with_overrides(defaults) if defaults else run
    if not args.membership_only:
        _check_workload(run)
    return run_simulate(args, run)


def cmd_config(args: argparse.Namespace) -> int:
    print(describe_fields(), end="")
    return 0


def _interrupt() -> None:
    raise KeyboardInterrupt


@contextmanager
def _on_stop_signals(handler: Callable[[int], None]) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM call ``handler(signum)``; it decides between a graceful stop and an interrupt.

    The previous handlers are back afterwards (``main`` may run in a process that goes on).
    """
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: handler(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# -- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gossiptrain", description="Asynchronous gossip training for PyTorch: no master, peers average with neighbours."
    )
    from gossiptrain import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the package's version (gossiptrain VERSION) and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("coordinator", help="bootstrap a swarm: answer joins with an id, the run config and members")
    p.add_argument("--bind", default="127.0.0.1:7070", metavar="HOST:PORT", help="where to listen (default 127.0.0.1:7070)")
    p.add_argument("--prometheus", metavar="[HOST:]PORT",
                   help="serve /metrics for Prometheus there: joins, reports, queries, members (host 127.0.0.1 unless "
                   "given; needs prometheus-client; default: none)")
    p.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                   help="pass exchanges between peers behind NAT, which cannot reach each other, within "
                   "limits.relay_bytes_per_second (default: on; in a secure swarm the peers seal what passes for "
                   "each other, and the coordinator cannot read it)")
    _add_security_flags(p, peer=False)
    _add_run_flags(p)
    p.set_defaults(func=cmd_coordinator)

    p = sub.add_parser("peer", help="join a swarm and train")
    p.add_argument("--join", required=not os.environ.get("GOSSIPTRAIN_JOIN"), default=os.environ.get("GOSSIPTRAIN_JOIN") or None,
                   metavar="HOST:PORT", help="the coordinator or any live peer (default: $GOSSIPTRAIN_JOIN; required without it)")
    p.add_argument("--bind", metavar="HOST:PORT", help="where to listen (default: the advertised host, port 0)")
    p.add_argument("--advertise", metavar="HOST",
                   help="host others reach us at, IPv6 with or without brackets (default: our address on the route "
                   "to --join)")
    p.add_argument("--reachable", choices=MODES, default=os.environ.get(REACHABLE_ENV) or AUTO,
                   help="whether the others can dial us at the advertised address: auto has the member answering our "
                   "join dial us back; if it cannot, we print one line and train as a client-mode member (behind NAT: "
                   "every connection opened by us); yes and no take your word for it (default: "
                   f"${REACHABLE_ENV}, else auto)")
    p.add_argument("--relay", action="store_true",
                   help="pass messages between peers behind NAT (client-mode members, which cannot reach each other), "
                   "within limits.relay_bytes_per_second and limits.relay_burst_bytes; clients spread over the peers "
                   "that relay, and use the coordinator while there are none (default: off; ignored behind NAT)")
    p.add_argument("--metrics", metavar="FILE",
                   help="append metrics as JSON lines to FILE, creating missing directories (default: none)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write them as TensorBoard scalars, one run per peer: DIR/<peer id> (needs tensorboard; default: none)")
    p.add_argument("--prometheus", metavar="[HOST:]PORT",
                   help="serve /metrics for Prometheus there (host 127.0.0.1 unless given; port 0: any free one; "
                   "needs prometheus-client; default: none)")
    p.add_argument("--shard", type=_count("a shard index", 0), metavar="I",
                   help="train shard I (0 to shards-1) (default: the least covered one)")
    p.add_argument("--join-attempts", type=_count("a number of attempts", 1), metavar="N",
                   help="join attempts before giving up (default 5: 2 s each for a member that does not answer, "
                   "about 0.5 s each while nothing listens)")
    p.add_argument("--slowdown", type=float, default=1.0, metavar="FACTOR",
                   help="emulate a slow machine: idle (FACTOR-1) x each step's compute time (experiments; default 1: no)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="torch threads for this peer (default 1)")
    p.add_argument("--nproc-per-peer", type=_count("a number of worker processes", 1), default=1, metavar="N",
                   help="N worker processes as one swarm member, training with DDP (gloo) among themselves; rank 0 "
                   "joins, the others follow it (default 1; under torchrun, its WORLD_SIZE)")
    p.add_argument("--shard-model", choices=("fsdp", "pipeline"), default=None,
                   help="split the model across the N workers instead of DDP: fsdp (FSDP2 shards) or pipeline (the "
                   "model's stages, e.g. peers.charlm:transformer); each worker averages its own piece with the same "
                   "worker of a partner. Needs --nproc-per-peer N (or torchrun) and the run's --workload or --config "
                   "(default: none, DDP)")
    p.add_argument("--wait-for", type=int, default=0, metavar="N",
                   help="train only once N members (this one included) are ready to train (joined, state downloaded): "
                   "a start line that releases them together (default 0: at once)")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    p.add_argument("--final-model", metavar="FILE",
                   help="at the end of the run (budget or `gossiptrain stop`), write the swarm's merged model here "
                   "(safetensors + FILE.json; with --shard-model: this peer's own model after the final consensus, "
                   "its ranks' pieces gathered; default: none)")
    _add_security_flags(p, peer=True)
    g = p.add_argument_group("checkpoints (safetensors + JSON; see README)")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save checkpoints here, periodically and when the peer stops (default: none)")
    g.add_argument("--checkpoint-every", type=float, metavar="SECONDS", help="seconds between checkpoints (default 60; 0: none)")
    g.add_argument("--checkpoint-every-steps", type=int, metavar="N", help="also save every N local steps (default 0: no)")
    g.add_argument("--checkpoint-keep", type=int, metavar="K", help="checkpoints kept in DIR (default 3)")
    g.add_argument("--resume", metavar="DIR",
                   help="start from the newest intact checkpoint in DIR: model, optimizer, step (and its shard unless --shard) "
                   "(default: none, start afresh)")
    g.add_argument("--resume-any-run", action="store_true", help="with --resume: accept a checkpoint of a different run")
    _add_run_flags(p, PEER_RUN_DEFAULTS, _PEER_RUN_FLAGS)
    p.set_defaults(func=cmd_peer)

    p = sub.add_parser("demo", help="coordinator + 4 peer processes on 127.0.0.1 training digits to 0.95")
    p.add_argument("--peers", type=_count("a number of peers", 1), default=4, metavar="N",
                   help="peer processes to start, one shard each (default 4)")
    p.add_argument("--target", type=_number("an accuracy in (0, 1]", lambda v: 0 < v <= 1), default=0.95,
                   help="mean test accuracy to reach (default 0.95)")
    p.add_argument("--timeout", type=_number("a positive number of seconds", lambda v: 0 < v < float("inf")), default=180.0,
                   metavar="SECONDS", help="seconds before giving up (default 180)")
    p.add_argument(
        "--workdir", metavar="DIR",
        help="keep metrics and logs here (default: a temporary directory, removed after a run that reached its target)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.set_defaults(func=cmd_demo)

    from gossiptrain.cli.dashboard import add_parser as add_dashboard_parser
    from gossiptrain.cli.export import add_parsers as add_export_parsers
    from gossiptrain.cli.launch import add_parsers as add_launch_parsers
    from gossiptrain.cli.plot import add_parser as add_plot_parser
    from gossiptrain.cli.simulate import add_parser as add_simulate_parser
    from gossiptrain.cli.status import add_parser as add_status_parser
    from gossiptrain.cli.topology import add_parser as add_topology_parser

    add_export_parsers(sub, lambda parser, peer: _add_security_flags(parser, peer=peer), _security)
    add_status_parser(sub, lambda parser, peer: _add_security_flags(parser, peer=peer), _security)
    add_dashboard_parser(sub, lambda parser, peer: _add_security_flags(parser, peer=peer), _security)

    simulated = {"--shards": "--peers (one shard each)", "--steps": "0: none, the simulation's --duration ends the run"}
    add_simulate_parser(sub, lambda parser: _add_run_flags(parser, simulated)).set_defaults(func=cmd_simulate)
    add_topology_parser(sub)
    add_plot_parser(sub)
    add_launch_parsers(sub)

    p = sub.add_parser("config", help="print every configuration field with its default (TOML)")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("keys", help="CURVE keypairs for secure swarms (--secure; see SECURITY.md)")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    k = keys.add_parser("new", help="write DIR/NAME.key (public, to share) and DIR/NAME.key_secret (mode 0600)")
    k.add_argument("dir", metavar="DIR", help="directory for the two files (created if missing)")
    k.add_argument("--name", help="file name stem (default: this host's name); use 'coordinator' for the coordinator")
    k.set_defaults(func=cmd_keys)

    for name, sp in sub.choices.items():
        if name not in ("config", "topology", "plot"):
            sp.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a peer's other workers run (--nproc-per-peer)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except GossipError as e:
        print(f"gossiptrain {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def console_main() -> None:
    """The ``gossiptrain`` command: ``main``, then exit at once.

    Everything is closed and written by then; what is left is the
    interpreter's teardown of torch and hundreds of thousands of objects,
    which took 5-30 s on a loaded machine and made Ctrl+C or SIGTERM look
    ignored. Streams are flushed, then the process ends.
    """
    rc = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":  # pragma: no cover
    console_main()
