"""The `gossiptrain` command: coordinator, peer, export, stop, demo and config.

Run flags map onto the same dotted fields as a TOML file (``--lr`` is
``train.lr``; ``--set section.field=value`` reaches any field), so a file and
flags can be mixed: flags win. Errors a user can fix print one line naming
the problem and exit with status 2. Ctrl+C or SIGTERM stops a training
peer gracefully (it leaves, writes its summary, exits 0); during a join or
the demo, Ctrl+C aborts with status 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Sequence

from gossiptrain.cli.common import EXIT_INTERRUPTED, EXIT_USAGE, setup_logging
from gossiptrain.config import RunConfig, SecurityConfig, describe_fields
from gossiptrain.errors import ConfigError, GossipError, WorkloadError

# flag -> dotted config field
_RUN_FLAGS: dict[str, tuple[str, type, str]] = {
    "--workload": ("train.workload", str, "digits, logreg, or module:attr of your own"),
    "--topology": ("gossip.topology", str, "a name or NAME:k=v,... spec; `gossiptrain topology --help`"),
    "--algorithm": ("gossip.algorithm", str, "pairwise, push-sum, neighbor or local-sgd"),
    "--compression": ("gossip.compression", str, "none, fp16, bf16, int8, topk:ratio=R (neighbor, local-sgd)"),
    "--local-steps": ("gossip.local_steps", int, "local-sgd: local steps between averaging rounds"),
    "--outer-lr": ("gossip.outer_lr", float, "local-sgd: outer learning rate (DiLoCo-style outer optimizer)"),
    "--outer-momentum": ("gossip.outer_momentum", float, "local-sgd: outer Nesterov momentum (0: none)"),
    "--staleness-weighting": ("gossip.staleness_weighting", str, "constant, or polynomial: 1/(1+s)^exponent"),
    "--staleness-bound": ("gossip.staleness_bound", int, "drop updates more than this many steps stale (0: none)"),
    "--lr": ("train.lr", float, "learning rate"),
    "--batch-size": ("train.batch_size", int, "mini-batch size"),
    "--shards": ("train.shards", int, "number of data shards (usually the number of peers)"),
    "--steps": ("train.max_steps", int, "step budget per peer (0: none)"),
    "--seconds": ("train.max_seconds", float, "time budget per peer (0: none)"),
    "--seed": ("train.seed", int, "seed of model init and shards"),
    "--partition": ("train.partition", str, "how data is split over shards: iid, dirichlet, classes-per-peer"),
    "--partition-alpha": ("train.partition_alpha", float, "Dirichlet concentration (smaller: more label skew)"),
    "--partition-classes": ("train.partition_classes", int, "classes per shard for classes-per-peer"),
}


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run configuration (shared by the swarm)")
    g.add_argument("--config", metavar="FILE", help="TOML file with [train], [gossip], [membership], [limits], [state], [final]")
    for flag, (field, ftype, help_text) in _RUN_FLAGS.items():
        g.add_argument(flag, type=ftype, metavar=ftype.__name__.upper(), help=f"{help_text} ({field})")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="any field, e.g. gossip.exchange_every_steps=2")


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
    g.add_argument("--key", metavar="FILE", help="this member's NAME.key_secret (`gossiptrain keys new`)")
    g.add_argument("--allow", metavar="DIR", help="directory of the public keys (*.key) allowed to connect")
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
    from gossiptrain.runtime.coordinator_process import run_coordinator_forever

    setup_logging(args.verbose, logging.INFO)
    config = _run_config(args)
    _check_workload(config)
    security = _security(args)

    def ready(coord: Any) -> None:
        host_port = coord.address.removeprefix("tcp://").partition("?")[0]
        print(f"coordinator listening on {coord.address} (run {config.fingerprint()})", flush=True)
        if security is None:
            print(f"join with: gossiptrain peer --join {host_port}", flush=True)
        else:
            print(
                f"join with: gossiptrain peer --join {host_port} --secure --key YOURS.key_secret --allow DIR "
                "--server-key COORDINATOR.key (this coordinator's public key; DIR must hold it too)",
                flush=True,
            )

    run_coordinator_forever(config, args.bind, ready, security)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from gossiptrain.net.keys import default_name, new_keypair

    public, secret = new_keypair(args.dir, args.name or default_name())
    print(f"public key: {public}  (copy it into the --allow DIR of every member)", flush=True)
    print(f"secret key: {secret}  (stays on this machine; pass it as --key)", flush=True)
    return 0


def cmd_peer(args: argparse.Namespace) -> int:
    import json

    from gossiptrain.train.peer_loop import PeerOptions, run_peer

    setup_logging(args.verbose, logging.WARNING)
    if args.checkpoint_dir is None:
        for flag in ("checkpoint_every", "checkpoint_every_steps", "checkpoint_keep"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --checkpoint-dir DIR")
    checkpointing = {"checkpoint_every_seconds": args.checkpoint_every, "checkpoint_every_steps": args.checkpoint_every_steps,
             "checkpoint_keep": args.checkpoint_keep}
    options = PeerOptions(
        join=args.join,
        bind=args.bind,
        advertise=args.advertise,
        metrics=args.metrics,
        expect=_explicit_run_config(args),
        shard=args.shard,
        join_attempts=args.join_attempts,
        slowdown=args.slowdown,
        threads=args.threads,
        wait_for=args.wait_for,
        progress=not args.quiet,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        resume_any_run=args.resume_any_run,
        security=_security(args),
        final_model=args.final_model,
        **{k: v for k, v in checkpointing.items() if v is not None},
    )
    stop = threading.Event()
    training = threading.Event()
    _on_stop_signals(lambda: stop.set() if training.is_set() else _interrupt())
    summary = run_peer(options, stop, on_training=training.set)
    if args.json:
        print(json.dumps(summary, separators=(",", ":")), flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gossiptrain.cli.demo import DemoOptions, format_table, run_demo, summary_json

    setup_logging(args.verbose, logging.WARNING)
    _on_stop_signals(_interrupt)
    options = DemoOptions(
        peers=args.peers, target=args.target, timeout=args.timeout, workdir=Path(args.workdir) if args.workdir else None
    )
    summary = run_demo(options)
    print(format_table(summary), flush=True)
    if args.json:
        print(summary_json(summary), flush=True)
    return 0 if summary["reached"] else 1


def cmd_simulate(args: argparse.Namespace) -> int:
    from gossiptrain.cli.simulate import run_simulate

    setup_logging(args.verbose, logging.WARNING)
    run = _run_config(args)
    if not args.config:
        # Simulated peers default to one shard each and to the simulation's duration as their budget.
        defaults: dict[str, Any] = {}
        if args.shards is None:
            defaults["train.shards"] = args.peers
        if args.steps is None:
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


def _on_stop_signals(handler: Callable[[], None]) -> None:
    """SIGTERM behaves like Ctrl+C: the handler decides between a graceful stop and an interrupt."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: handler())


# -- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gossiptrain", description="Asynchronous gossip training for PyTorch: no master, peers average with neighbours."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("coordinator", help="bootstrap a swarm: answer joins with an id, the run config and members")
    p.add_argument("--bind", default="127.0.0.1:7070", metavar="HOST:PORT", help="where to listen (default 127.0.0.1:7070)")
    _add_security_flags(p, peer=False)
    _add_run_flags(p)
    p.set_defaults(func=cmd_coordinator)

    p = sub.add_parser("peer", help="join a swarm and train")
    p.add_argument("--join", required=True, metavar="HOST:PORT", help="the coordinator or any live peer")
    p.add_argument("--bind", metavar="HOST:PORT", help="where to listen (default: the advertised host, port 0)")
    p.add_argument("--advertise", metavar="HOST", help="host others reach us at (default: our address on the route to --join)")
    p.add_argument("--metrics", metavar="FILE", help="append metrics as JSON lines")
    p.add_argument("--shard", type=int, help="train this shard instead of the least covered one")
    p.add_argument("--join-attempts", type=int, metavar="N", help="join attempts before giving up (default 5, 2 s each)")
    p.add_argument("--slowdown", type=float, default=1.0, metavar="FACTOR",
                   help="emulate a slow machine: idle (FACTOR-1) x each step's compute time (experiments)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for this peer (default 1)")
    p.add_argument("--wait-for", type=int, default=0, metavar="N",
                   help="train only once N members (this one included) are in the swarm: a start line (default 0: at once)")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    p.add_argument("--final-model", metavar="FILE",
                   help="at the end of the run (budget or `gossiptrain stop`), write the swarm's merged model here "
                   "(safetensors + FILE.json)")
    _add_security_flags(p, peer=True)
    g = p.add_argument_group("checkpoints (safetensors + JSON; see README)")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here, periodically and when the peer stops")
    g.add_argument("--checkpoint-every", type=float, metavar="SECONDS", help="seconds between checkpoints (default 60; 0: none)")
    g.add_argument("--checkpoint-every-steps", type=int, metavar="N", help="also save every N local steps (default 0: no)")
    g.add_argument("--checkpoint-keep", type=int, metavar="K", help="checkpoints kept in DIR (default 3)")
    g.add_argument("--resume", metavar="DIR",
                   help="start from the newest intact checkpoint in DIR: model, optimizer, step (and its shard unless --shard)")
    g.add_argument("--resume-any-run", action="store_true", help="with --resume: accept a checkpoint of a different run")
    _add_run_flags(p)
    p.set_defaults(func=cmd_peer)

    p = sub.add_parser("demo", help="coordinator + 4 peer processes on 127.0.0.1 training digits to 0.95")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--target", type=float, default=0.95, help="mean test accuracy to reach (default 0.95)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds before giving up (default 180)")
    p.add_argument("--workdir", metavar="DIR", help="keep metrics and logs here")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.set_defaults(func=cmd_demo)

    from gossiptrain.cli.export import add_parsers as add_export_parsers
    from gossiptrain.cli.simulate import add_parser as add_simulate_parser
    from gossiptrain.cli.topology import add_parser as add_topology_parser

    add_export_parsers(sub, lambda parser, peer: _add_security_flags(parser, peer=peer), _security)

    add_simulate_parser(sub, _add_run_flags).set_defaults(func=cmd_simulate)
    add_topology_parser(sub)

    p = sub.add_parser("config", help="print every configuration field with its default (TOML)")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("keys", help="CURVE keypairs for secure swarms (--secure; see SECURITY.md)")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    k = keys.add_parser("new", help="write DIR/NAME.key (public, to share) and DIR/NAME.key_secret (mode 0600)")
    k.add_argument("dir", metavar="DIR", help="directory for the two files (created if missing)")
    k.add_argument("--name", help="file name stem (default: this host's name); use 'coordinator' for the coordinator")
    k.set_defaults(func=cmd_keys)

    for name, sp in sub.choices.items():
        if name not in ("config", "topology"):
            sp.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
