"""`gossiptrain simulate`: a whole swarm in this process, in virtual time.

Ctrl+C stops the run and still writes what it computed: the rows sampled so
far to ``--out`` and the summary (``--json`` too), marked interrupted with
the virtual time reached; then the command exits 130.

Before building anything it estimates the run's peak memory from the peer
count and the workload's model size (views grow with the swarm: n^2 in all),
prints it, and refuses (exit 2) above ``--max-memory`` (default: the memory
available now).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gossiptrain.cli import memory
from gossiptrain.cli.common import EXIT_INTERRUPTED
from gossiptrain.config import RunConfig
from gossiptrain.errors import ConfigError
from gossiptrain.net.transport.sim import LinkProfile
from gossiptrain.sim.faults import PartitionSpec, load_trace
from gossiptrain.train.progress import Progress

if TYPE_CHECKING:  # the simulator's modules (its cluster pulls in torch): imported when a simulation runs, not for --help
    from gossiptrain.sim.sim_config import SimConfig, SimResult


DEFAULT_STEP_TIME = 0.05  # virtual seconds per local step when --step-time is not given

STEP_TIME_HELP = (
    "virtual seconds one local step costs at speed 1 (default 0.05: a fixed, modelled step time, the same on "
    "every machine, so a seed gives the same run anywhere; the steps are real torch steps, only their duration "
    "is modelled). 'measured' times a real step of the workload here (median of 20) and charges that instead: "
    "faithful to this machine, but a tiny step (logreg: well under 1 ms) makes every peer take thousands of steps "
    "per virtual second, and wall time grows with peers x steps (the README's 64-peer example: some 85 minutes "
    "on 2 cores, against under a minute with the default)"
)


def _step_time(text: str) -> float | None:
    """``--step-time``: seconds, or 'measured' (None: the cluster measures a real step)."""
    if text.strip().lower() == "measured":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of seconds nor 'measured'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 seconds")
    return value


def _peers(text: str) -> int:
    """``--peers``: a whole number >= 1, refused under its own name (it also sets train.shards, one each)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of peers, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a number of peers (>= 1), got {value}")
    return value


def add_parser(sub: Any, add_run_flags: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """The `simulate` sub-command's flags; the caller sets what it runs."""
    p = sub.add_parser("simulate", help="run a swarm of simulated peers in virtual time, in this process")
    p.add_argument("--peers", type=_peers, default=8, help="number of peers (default 8)")
    p.add_argument("--duration", type=float, default=60.0, help="virtual seconds to simulate (default 60)")
    p.add_argument("--step-time", type=_step_time, default=DEFAULT_STEP_TIME, metavar="SECONDS|measured", help=STEP_TIME_HELP)
    p.add_argument("--exchange-time", type=float, default=0.0, metavar="SECONDS",
                   help="computation charged per exchange operation (snapshot or merge); default 0")
    p.add_argument("--step-jitter", type=float, default=0.0, metavar="CV",
                   help="spread of a step's time: coefficient of variation of a gamma distribution (default 0: all alike)")
    p.add_argument("--step-sigma", type=float, default=0.0, metavar="SIGMA",
                   help="heavy-tailed step times instead: lognormal with this sigma, mean 1 (e.g. 0.5)")
    p.add_argument("--eval-time", type=float, default=0.0, metavar="SECONDS",
                   help="computation charged per test-set evaluation, every train.eval_every_seconds; default 0")
    p.add_argument("--cores", type=float, default=0.0, help="cores the peers share (default 0: one each)")
    p.add_argument("--wait-for", type=int, default=0, metavar="N",
                   help="as `peer --wait-for`: peers train once N members are in their view (default 0: at once)")
    p.add_argument("--stragglers", metavar="FRACTION[:SLOWDOWN]", default="0", help="e.g. 0.25:4 slows a quarter of the peers 4x")
    p.add_argument("--latency", type=float, default=LinkProfile.latency, help="one-way link latency, seconds")
    p.add_argument("--bandwidth", type=float, default=LinkProfile.bandwidth, help="link bandwidth, bytes per second")
    p.add_argument("--loss", type=float, default=0.0, help="probability a message is lost")
    p.add_argument("--split", action="append", default=[], metavar="START:HEAL[:FRACTION]",
                   help="a network partition: cut the swarm in two from START to HEAL (virtual seconds)")
    p.add_argument("--churn", type=float, default=0.0, metavar="RATE", help="crashes per virtual second across the swarm (Poisson)")
    p.add_argument("--churn-downtime", type=float, default=5.0, metavar="SECONDS", help="how long a crashed peer stays down")
    p.add_argument("--churn-trace", metavar="CSV", help="crash/join events: lines 'time,peer,event'")
    p.add_argument("--membership-only", action="store_true", help="no training: only the membership protocol")
    p.add_argument("--one-by-one-steps", action="store_true",
                   help="take every peer's local step on its own (default: the steps every peer has under way are "
                        "computed in one stacked call where the models allow, the same parameters up to float "
                        "rounding and faster at many peers)")
    p.add_argument("--rogue", metavar="PEERS[:SCALE]", default="",
                   help="peers (comma-separated indexes) that send valid parameters scaled by SCALE (default 100)")
    p.add_argument("--behind-nat", metavar="PEERS", default="",
                   help="peers (comma-separated indexes) nobody can dial: they train as client-mode members, reached "
                        "only over connections they open (as behind NAT)")
    p.add_argument("--relays", metavar="PEERS", default="",
                   help="peers (comma-separated indexes) that relay between those behind NAT, as `peer --relay`")
    p.add_argument("--no-coordinator-relay", action="store_true",
                   help="the coordinator relays nothing, as `coordinator --no-relay`")
    p.add_argument("--system", choices=["gossip", "ddp", "ps-sync", "ps-async"], default="gossip",
                   help="what to simulate on the same compute and links: the swarm (default), DDP with a ring "
                        "all-reduce, or a parameter server, synchronous or asynchronous")
    p.add_argument("--restart-cost", type=float, default=30.0, metavar="SECONDS",
                   help="ddp, ps-sync: virtual seconds a crashed worker costs the job (timeout, restart, reload; default 30)")
    p.add_argument("--checkpoint-every", type=float, default=0.0, metavar="SECONDS",
                   help="ddp, ps-sync: a restart resumes from a checkpoint this old at most (default 0: every step)")
    p.add_argument("--allreduce", choices=["ring", "halving-doubling", "best"], default="ring",
                   help="ddp: the all-reduce's algorithm (default ring; best: the faster for the model's size)")
    p.add_argument("--target", type=float, default=0.0, help="stop once the mean test accuracy reaches this")
    p.add_argument("--sample-every", type=float, default=1.0, help="virtual seconds between samples")
    p.add_argument("--sim-seed", type=int, help="seed of the simulated world: faults, network, ids (default: --seed)")
    p.add_argument("--out", metavar="FILE", help="write the time series: .csv or .jsonl")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write the series as TensorBoard scalars, DIR/peer-<n> per peer, at virtual time (needs tensorboard; default: none)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--max-memory", type=memory.max_memory, metavar="SIZE", help=memory.MAX_MEMORY_HELP)
    add_run_flags(p)
    return p


def peer_indexes(text: str, problem: str) -> tuple[int, ...]:
    """Comma-separated peer indexes ("" for none); ConfigError(``problem``) if one is not a number."""
    try:
        return tuple(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        raise ConfigError(problem) from None


def sim_config(args: argparse.Namespace, run: RunConfig) -> SimConfig:
    from gossiptrain.sim.sim_config import SimConfig

    fraction, _, slowdown = args.stragglers.partition(":")
    try:
        stragglers, factor = float(fraction), float(slowdown or 4.0)
    except ValueError:
        raise ConfigError(f"--stragglers {args.stragglers!r} must look like FRACTION[:SLOWDOWN], e.g. 0.25:4") from None
    indexes, _, scale = args.rogue.partition(":")
    rogue = peer_indexes(indexes, f"--rogue {args.rogue!r} must look like PEERS[:SCALE], e.g. 0,3:100")
    try:
        rogue_scale = float(scale or 100.0)
    except ValueError:
        raise ConfigError(f"--rogue {args.rogue!r} must look like PEERS[:SCALE], e.g. 0,3:100") from None
    return SimConfig(
        behind_nat=peer_indexes(args.behind_nat, f"--behind-nat {args.behind_nat!r} must be peer indexes, e.g. 0,3"),
        relays=peer_indexes(args.relays, f"--relays {args.relays!r} must be peer indexes, e.g. 1,2"),
        coordinator_relay=not args.no_coordinator_relay,
        rogue=rogue,
        rogue_scale=rogue_scale,
        peers=args.peers,
        run=run,
        duration=args.duration,
        seed=run.train.seed if args.sim_seed is None else args.sim_seed,
        step_time=args.step_time,
        exchange_time=args.exchange_time,
        step_jitter=args.step_jitter,
        step_sigma=args.step_sigma,
        system=args.system,
        restart_cost=args.restart_cost,
        checkpoint_every=args.checkpoint_every,
        allreduce=args.allreduce,
        eval_time=args.eval_time,
        cores=args.cores,
        wait_for=args.wait_for,
        stragglers=stragglers,
        slowdown=factor,
        link=LinkProfile(latency=args.latency, bandwidth=args.bandwidth, loss=args.loss),
        partitions=tuple(PartitionSpec.parse(p) for p in args.split),
        churn_rate=args.churn,
        churn_downtime=args.churn_downtime,
        churn_trace=load_trace(args.churn_trace) if args.churn_trace else (),
        sample_every=args.sample_every,
        membership_only=args.membership_only,
        target_accuracy=args.target,
        batch_steps=not args.one_by_one_steps,
    )


class LiveLine:
    """The live status line: virtual progress, wall time, the time left, who is live and what their views hold.

    The time left is the virtual time still to go at the rate (wall seconds
    per virtual second) measured from the first sample on: start-up (loading
    the workload, the peers' joins) is not part of the rate.
    """

    def __init__(self, duration: float, peers: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.duration = duration
        self.peers = peers
        self.clock = clock
        self.started = clock()
        self._first: tuple[float, float] | None = None  # (virtual, wall elapsed) at the first sample

    def left(self, now: float, elapsed: float) -> float | None:
        """Estimated wall seconds to the end, or None before there is a rate."""
        if self._first is None:
            self._first = (now, elapsed)
        v0, w0 = self._first
        if now > v0 and elapsed > w0:
            rate = (elapsed - w0) / (now - v0)
        elif now > 0:
            rate = elapsed / now  # one sample so far: start-up included, an overestimate
        else:
            return None
        return max(0.0, self.duration - now) * rate

    def render(self, now: float, rows: list[dict[str, Any]], elapsed: float | None = None) -> str:
        elapsed = self.clock() - self.started if elapsed is None else elapsed
        left = self.left(now, elapsed)
        done = min(1.0, now / self.duration)
        bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
        eta = f" | ~{_duration(left)} left" if left is not None else ""
        accs = [r["test_acc"] for r in rows if "test_acc" in r]
        acc = f" | mean acc {sum(accs) / len(accs):.3f}" if accs else ""
        live = sum(r.get("members_live", r["members"]) for r in rows) / len(rows) if rows else 0.0
        stale = sum(r.get("members_stale", 0) for r in rows) / len(rows) if rows else 0.0
        return (
            f"[{bar}] virtual {now:7.1f}/{self.duration:.0f} s | wall {elapsed:6.1f} s{eta} | "
            f"live {sum(r.get('workers', 1) for r in rows)}/{self.peers} | view {live:.1f} live + {stale:.1f} stale{acc}"
        )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def run_simulate(args: argparse.Namespace, run: RunConfig) -> int:
    """Simulate ``run`` as the flags describe; print the summary (and the JSON line with --json).

    Ctrl+C writes what was computed (series and summary, marked interrupted) and returns 130.
    """
    progress = Progress(plain_every=10.0)
    check_memory(args, run, progress)  # before anything is built: the config's topology check samples the graph
    from gossiptrain.sim.cluster import SimInterrupted, simulate

    config = sim_config(args, run)
    if args.tensorboard:  # before the run, not after minutes of it
        from gossiptrain.train.tensorboard import check_available

        check_available("--tensorboard")
    line = LiveLine(config.duration, config.peers)

    def on_sample(now: float, rows: list[dict[str, Any]]) -> None:
        progress.update(line.render(now, rows))

    def on_started(count: int) -> None:
        elapsed = line.clock() - line.started
        if progress.live or elapsed >= 2.0:  # a big swarm's start is shown; a small one's leaves the log to the samples
            progress.update(f"starting peers: {count}/{config.peers} | wall {elapsed:6.1f} s")

    try:
        result, interrupted = simulate(config, on_sample, on_started), False
    except SimInterrupted as e:
        result, interrupted = e.result, True
    progress.finish()
    if args.out:
        write_rows(result, Path(args.out))
    if args.tensorboard:
        from gossiptrain.train.tensorboard import write_simulated

        write_simulated(result.rows, args.tensorboard)
    print(format_summary(result), flush=True)
    if args.json:
        print(json.dumps(result.summary, separators=(",", ":")), flush=True)
    return EXIT_INTERRUPTED if interrupted else 0


def check_memory(args: argparse.Namespace, run: RunConfig, progress: Progress) -> int:
    """Estimate the run's peak memory, say it (a line on stderr), and refuse above --max-memory (ConfigError, exit 2).

    The estimate's largest part needs only the peer count (every view ends up holding every member), so a
    swarm far too big is refused before the workload is even loaded; otherwise one model is built to size it.
    """
    from gossiptrain.sim.sim_config import memory_estimate

    limit, default = memory.limit(args)
    kind = dict(membership_only=args.membership_only, system=args.system)
    what = f"simulating {args.peers} peers" + (" (membership only)" if args.membership_only else f" of {run.train.workload}")
    memory.check(what, memory_estimate(args.peers, run, 0, **kind), limit, default, "use fewer --peers")
    model = 0 if args.membership_only else _model_bytes(run)
    need = memory_estimate(args.peers, run, model, **kind)
    memory.check(what, need, limit, default, "use fewer --peers")
    sized = f" ({memory.size(model)} model)" if model else ""
    have = "" if limit is None or limit == float("inf") else f" ({memory.size(limit)} {'available now' if default else '--max-memory'})"
    progress.line(f"{what}{sized}: about {memory.size(need)} of memory at most, estimated{have}; starting")
    return need


def _model_bytes(run: RunConfig) -> int:
    """One copy of the workload's parameters and buffers, from a model built for the purpose (before the run's own)."""
    from gossiptrain.train.workload import load_workload

    model = load_workload(run.train.workload).build_model(run.train.seed)
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def write_rows(result: SimResult, path: Path) -> None:
    """The time series as CSV (one column per key seen) or JSON lines, chosen by the file's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        with open(path, "w", encoding="utf-8") as fh:
            for row in result.rows:
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")
        return
    if path.suffix != ".csv":
        raise ConfigError(f"--out {path}: use a .csv or .jsonl file name")
    columns: list[str] = []
    for row in result.rows:
        columns += [k for k in row if k not in columns]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(result.rows)


def format_summary(result: SimResult) -> str:
    s = result.summary
    lines = []
    if s.get("interrupted"):
        lines.append(
            f"interrupted at virtual {s['virtual_seconds']:.1f} of {s.get('duration', float('nan')):.0f} s: "
            f"what follows (and --out) covers the {len(result.rows)} rows sampled until then"
        )
    lines += [
        f"simulated {s['virtual_seconds']:.1f} virtual s of {s['peers']} peers in {s['wall_seconds']:.1f} wall s "
        f"(step time {s['step_time'] * 1000:.2f} ms, seed {s['seed']})",
        f"live peers at the end: {s['live_peers']}, crashes: {s['crashes']}",
    ]
    if s.get("mean_members_live") is not None:
        lines.append(
            f"mean view: {_num(s['mean_members_live'], '.1f')} live peers (itself included) + "
            f"{_num(s.get('mean_members_stale'), '.1f')} stale entries (crashed incarnations not yet declared dead, "
            f"ids whose join answer was lost)"
        )
    if s.get("system", "gossip") != "gossip":
        lines.append(_synchronous_line(s))
    elif "mean_test_acc" in s and s["mean_test_acc"] is not None:
        ttt = f", reached the target at {s['time_to_target']:.1f} s" if s.get("time_to_target") is not None else ""
        lines.append(
            f"mean test accuracy {_num(s['mean_test_acc'], '.4f')}, mean steps {_num(s['mean_step'], '.0f')}, "
            f"exchanges per peer {_num(s['exchanges_per_peer'], '.0f')}, "
            f"consensus distance {_num(s['consensus_distance'], '.4g')}{ttt}"
        )
    staleness = _staleness_line(result)
    if staleness:
        lines.append(staleness)
    if s.get("log_warnings"):  # a simulated fault's expected events: counted here, each one logged only with -v
        kinds = ", ".join(f"{n} x \"{what} ...\"" for what, n in s["log_warnings"].items())
        lines.append(f"warnings of the simulated peers, by kind (-v logs each, in virtual time): {kinds}")
    return "\n".join(lines)


def _synchronous_line(s: dict[str, Any]) -> str:
    """A synchronous baseline's summary: one model, so its accuracy, steps, pace and restarts."""
    ttt = f", reached the target at {s['time_to_target']:.1f} s" if s.get("time_to_target") is not None else ""
    pace = f", {s['steps_per_second']:.1f} steps/s" if s.get("steps_per_second") else ""
    comm = f" ({100 * s['comm_share']:.0f}% communication)" if s.get("comm_share") is not None else ""
    stale = f", mean staleness {s['staleness_mean']:.1f} updates" if s.get("staleness_mean") is not None else ""
    return (
        f"{s['system']}: test accuracy {_num(s.get('mean_test_acc'), '.4f')}, steps per worker "
        f"{_num(s.get('mean_step'), '.0f')}{pace}{comm}{stale}, restarts {s.get('restarts', 0)}{ttt}"
    )


def _last_mean(result: SimResult, key: str) -> float | None:
    """Mean of ``key`` over the honest peers' last samples (missing and NaN values skipped)."""
    if not result.rows:
        return None
    last = result.rows[-1]["time"]
    values = [
        float(r[key]) for r in result.rows
        if r["time"] == last and not r.get("rogue") and isinstance(r.get(key), (int, float)) and r[key] == r[key]
    ]
    return sum(values) / len(values) if values else None


def _staleness_line(result: SimResult) -> str:
    """Mean staleness with what it means and what is normal (text only: the JSON keeps its numbers)."""
    staleness = _last_mean(result, "staleness_mean")
    if staleness is None:
        return ""
    rtt_ms, step_time = _last_mean(result, "rtt_ms"), result.summary.get("step_time") or 0.0
    trip = f"; an exchange round trip is {rtt_ms / (step_time * 1000):.1f} steps here" if rtt_ms and step_time else ""
    return (
        f"mean staleness {staleness:.1f} steps over the run (how many local steps a peer was ahead of the sender of an update it "
        f"merged; 0: in step{trip})\n"
        "  typical: up to about one round trip among equally fast peers (plus their start offsets); stragglers make "
        "it grow through the run (a peer N times slower falls 1 - 1/N steps behind per step of the others), so tens "
        "to hundreds of steps are normal with them"
    )


def _num(value: float | None, spec: str) -> str:
    """A summary number, or "n/a" where no peer had one (all diverged to NaN, say)."""
    return "n/a" if value is None else format(value, spec)
