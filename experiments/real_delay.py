"""50 ms each way on every link, on real network stacks: real `gossiptrain` processes, their real TCP and ZeroMQ.

This machine's kernel has no `tc netem`, so the delay is made in user space:
each member (the coordinator and 4 peers) stands behind its own
``gossiptrain.testing.delay_proxy.DelayProxy``, which passes every byte on
``--delay`` seconds later, each way, in order. A peer binds 127.0.5.i and
advertises the proxy's host 127.0.4.i on the same port, so everything sent
to it (joins, probes, exchanges, state) crosses its proxy, and every round
trip between two members takes 2 x delay more. The baseline runs through
the same proxies with no delay, so both pay the same relaying.

4 peers, digits-small (``--workload``: digits is the issue's own, a
1.1M-parameter MLP), 3 classes per peer (label-skewed), started as they
join; time from the first peer's start to a mean test accuracy of
``--target`` held for 3 evaluations (experiments/harness.py), seeds 0 to
``--seeds`` - 1; at `--slowdown` 1 (this machine's own step, a few ms: a
round trip is tens of steps) and at larger ones (each step idles
FACTOR - 1 times its compute, as a slower model's step would take).
With ``--jitter J`` each chunk a proxy passes on waits up to J more, at
random, never overtaking the one before it (what netem's jitter does to
one connection's bytes, as TCP delivers them).

With ``--loss P`` the delayed runs also lose P of their packets each way
on every link (the kernel has no netem for that either): the whole run
moves into a network namespace of its own, whose loopback carries
Ethernet-sized packets (MTU 1500, no segmentation offload:
``Namespace.wire_sized``), where ``iptables`` drops P of the packets to
and from the proxies at random, and TCP sends them again,
as it would over a lossy link (the simulated form,
experiments/latency_loss.py, drops whole messages instead). The baseline
runs lose nothing. Needs root and iptables.

With ``--soak SECONDS`` it is one run (seed 0, the first slowdown) on the
delayed (and lossy) link, trained that long past the target: the
issue's "no false deaths over 10 minutes of training". Every row counts
what the peers' membership saw: deaths (every one false: nobody fails),
suspicions (each refuted or then a death) and the smallest view after the
first 10 s.

Output: experiments/results/real_delay/ (another ``--workload``: its
WORKLOAD/ folder; ``--jitter J``: jitter-J/ under either; ``--loss P``:
loss-P/ under any of those; ``--soak``: soak/ under any; `--quick`: a
scratch folder): runs.csv and
summary.md; the last line printed is a JSON object
{"delay_over_none_by_slowdown": {FACTOR: ratio of medians}, "steps_per_s_by_slowdown": {...},
"deaths", "suspicions", "smallest_view"} (the membership counts over every delayed run).

    python experiments/real_delay.py             # slowdowns 1 and 20, 3 seeds (about 2 minutes here)
    python experiments/real_delay.py --loss 0.01 # the same with 1% of packets lost each way (root, iptables)
    python experiments/real_delay.py --loss 0.01 --slowdowns 20 --soak 600   # 10 minutes of training
    python experiments/real_delay.py --quick     # slowdown 20, 1 seed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.train.metrics import read_metrics  # noqa: E402
from gossiptrain.testing import netns  # noqa: E402
from gossiptrain.testing.delay_proxy import DelayProxy  # noqa: E402

PEERS = 4
PROXIES = "127.0.4.0/24"  # where the proxies listen: every message between members crosses one of them
SKEW = {"train.partition": "classes-per-peer", "train.partition_classes": 3}
WORKLOAD = "digits-small"  # --workload: digits is the issue's own (a 1.1M-parameter MLP, steps of tens of ms here)


@contextlib.contextmanager
def lossy(loss: float) -> Iterator[dict[str, int]]:
    """``loss`` of the packets to and from every proxy dropped at random, each way, while inside (in the run's
    own namespace: ``--loss``). A message crosses one proxy, so every link loses ``loss`` each way. Yields a dict
    whose "dropped" is the packets dropped, once out."""
    rules = [netns.random_drop(loss, "-o", "lo", side, PROXIES) for side in ("-d", "-s")] if loss else []
    seen = {"dropped": 0}
    for rule in rules:
        subprocess.run(["iptables", "-A", *rule], check=True, capture_output=True)
    try:
        yield seen
    finally:
        if rules:
            seen["dropped"] = netns.random_drops()
        for rule in rules:
            subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)


def one_run(seed: int, delay: float, slowdown: float, target: float, timeout: float, workdir: Path,
            gossip: dict[str, object] | None = None, loss: float = 0.0, min_seconds: float = 0.0,
            workload: str = WORKLOAD, jitter: float = 0.0) -> dict[str, object]:
    """A coordinator and PEERS peers, each behind a proxy of ``delay`` (losing ``loss`` of the packets: ``lossy``);
    the time to the target, the step rate, and what membership saw (deaths, suspicions, the smallest view).

    ``gossip``: more fields of the run's configuration (e.g. {"gossip.max_steps_ahead": 8}). ``min_seconds``:
    train at least that long, the target reached or not (a soak).
    """
    harness.fresh_dir(workdir)
    overrides = {**harness.run_overrides(PEERS, seed, max_seconds=max(timeout, min_seconds) + 60), **SKEW,
                 "train.workload": workload, **(gossip or {})}
    batch_size = RunConfig().with_overrides(overrides).train.batch_size
    with lossy(loss) as lost, harness.Procs(workdir) as procs, contextlib.ExitStack() as proxies:
        front = proxies.enter_context(DelayProxy("127.0.4.100", delay, jitter=jitter, seed=seed))
        front.set_target(harness.start_coordinator(procs, overrides))
        for i in range(PEERS):
            proxy = proxies.enter_context(DelayProxy(f"127.0.4.{i + 1}", delay, jitter=jitter, seed=seed * PEERS + i + 1))
            proxy.set_target(f"127.0.5.{i + 1}:{proxy.port}")
            extra = ["--slowdown", slowdown] if slowdown > 1 else []
            procs.start(f"peer-{i}", harness.python_m(
                "gossiptrain", "peer", "--join", front.address, "--bind", f"127.0.5.{i + 1}:{proxy.port}",
                "--advertise", f"127.0.4.{i + 1}", "--quiet", "--threads", 1, "--shard", i,
                "--metrics", workdir / f"peer-{i}.jsonl", *extra,
            ))

        def read() -> list[harness.Point]:
            return harness.gossip_series([read_metrics(workdir / f"peer-{i}.jsonl") for i in range(PEERS)], batch_size)[0]

        points = harness.poll_run(procs, read, target, max(timeout, min_seconds), min_seconds=min_seconds)
    per_peer = [read_metrics(workdir / f"peer-{i}.jsonl") for i in range(PEERS)]
    last = [next((r for r in reversed(recs) if r.get("event") in ("eval", "done")), {}) for recs in per_peer]
    elapsed = max((p.elapsed for p in points), default=0.0)
    steps = [r.get("step", 0) for r in last]
    views = [r["members"] for recs in per_peer for r in recs if r.get("event") == "eval" and r.get("elapsed", 0) >= 10]
    return {
        "seed": seed, "delay_s": delay, "loss": loss, "slowdown": slowdown,
        "time_to_target_s": harness.time_to_target(points, target),
        "final_acc": round(points[-1].acc, 4) if points else None,
        "steps_per_s": round(statistics.mean(steps) / elapsed, 1) if elapsed else None,
        "rtt_ms": round(statistics.median(r.get("rtt_ms", 0.0) for r in last), 1),
        "trained_s": round(elapsed, 1),
        "deaths": sum(r.get("members_dead", 0) for r in last),  # every one false: nobody fails
        "suspicions": sum(r.get("suspicions", 0) for r in last),
        "smallest_view": min(views, default=None),  # after the first 10 s
        "packets_dropped": lost["dropped"],
    }


def in_own_namespace(argv: list[str]) -> int:
    """Run this script again, with ``argv``, inside a network namespace of its own (``--loss``: the packets are
    dropped there, so the machine's own firewall is never touched); its exit status."""
    if (why := netns.why_not("iptables", need="packet loss (iptables in a network namespace)")) is not None:
        print(f"--loss {why}", file=sys.stderr)
        return 2
    with netns.Namespace(netns.unique_name("gt-real-delay")) as ns:
        ns.wire_sized("lo")  # 1% of wire packets, not of 64 KB segments (Namespace.drop_at_random)
        return ns.run([sys.executable, str(Path(__file__).resolve()), *argv, "--in-namespace"], check=False).returncode


def link_words(delay: float, loss: float, jitter: float = 0.0) -> str:
    return (f"{delay * 1000:g} ms each way" + (f" (up to {jitter * 1000:g} ms more, at random)" if jitter else "")
            + (f" and {loss:.0%} of packets lost each way" if loss else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.05, help="seconds each way on every link (default 0.05)")
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="seconds each chunk may wait beyond --delay, at random, in order (default 0)")
    ap.add_argument("--loss", type=float, default=0.0,
                    help="share of packets lost each way on every delayed link (root and iptables; default 0)")
    ap.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 20.0])
    ap.add_argument("--workload", default=WORKLOAD, help=f"what the peers train (default {WORKLOAD}; digits: the issue's)")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds of training a run may take (default 120)")
    ap.add_argument("--soak", type=float, default=0.0,
                    help="instead: one delayed run (seed 0, the first slowdown) trained this many seconds")
    ap.add_argument("--quick", action="store_true", help="slowdown 20, 1 seed")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)  # --loss: already moved into one
    args = ap.parse_args()
    if not 0.0 <= args.loss < 1.0:
        ap.error(f"--loss is a share of packets in [0, 1), got {args.loss:g}")
    if args.loss and not args.in_namespace:
        return in_own_namespace(sys.argv[1:])
    if args.quick:
        args.seeds, args.slowdowns = 1, [20.0]
    out = harness.results_dir("real_delay", args.out, args.quick)
    if args.out is None and not args.quick:  # each setting its own folder, beside the default's
        out = (out / (args.workload if args.workload != WORKLOAD else "") / (f"jitter-{args.jitter:g}" if args.jitter else "")
               / (f"loss-{args.loss:g}" if args.loss else ""))
    if args.soak:
        out = out / "soak"
    args.command = " ".join(["python experiments/real_delay.py", *(a for a in sys.argv[1:] if a != "--in-namespace")])
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    work = Path(tempfile.mkdtemp(prefix="gossiptrain-real-delay-"))  # the processes' logs and metrics
    link = link_words(args.delay, args.loss, args.jitter)
    if args.soak:
        return soak(args, out, work, link, began)
    rows = []
    for slowdown in args.slowdowns:
        for seed in range(args.seeds):
            for delay in (0.0, args.delay):  # interleaved: the machine's load drifts alike for both
                row = one_run(seed, delay, slowdown, args.target, args.timeout, work / f"s{slowdown:g}-seed{seed}-d{delay:g}",
                              loss=args.loss if delay else 0.0, workload=args.workload, jitter=args.jitter if delay else 0.0)
                print(json.dumps(row), flush=True)
                rows.append(row)
    harness.write_csv(out / "runs.csv", rows)

    def med(slowdown: float, delay: float, key: str) -> float | None:
        values = [r[key] for r in rows if r["slowdown"] == slowdown and r["delay_s"] == delay]
        return statistics.median(values) if values and all(v is not None for v in values) else None  # type: ignore[type-var]

    ratios, rates = {}, {}
    lines = ["# Link delay on real network stacks (user-space delay proxies)", "",
             f"Regenerate: `{args.command}`. "
             f"4 `gossiptrain peer` processes and a coordinator, each behind a proxy: {link} (a round trip "
             f"{2 * args.delay * 1000:g} ms more), against the same proxies passing every byte at once; {args.workload}, 3 "
             f"classes per peer; seconds from the first peer's start to a mean test accuracy of {args.target} held for 3 "
             f"evaluations; seeds 0-{args.seeds - 1}; one 2-core machine shared by all.", "",
             "| slowdown | steps/s per peer (no delay) | no delay (s) | delayed (s) | delayed / none (medians) |",
             "| --- | --- | --- | --- | --- |"]
    for slowdown in args.slowdowns:
        times = {d: [r["time_to_target_s"] for r in rows if r["slowdown"] == slowdown and r["delay_s"] == d]
                 for d in (0.0, args.delay)}
        a, b = med(slowdown, 0.0, "time_to_target_s"), med(slowdown, args.delay, "time_to_target_s")
        ratio = round(b / a, 3) if a and b is not None else None
        ratios[f"{slowdown:g}"], rates[f"{slowdown:g}"] = ratio, med(slowdown, 0.0, "steps_per_s")
        shown = {d: ", ".join("-" if v is None else f"{v:.2f}" for v in vs) for d, vs in times.items()}  # type: ignore[str-format]
        lines.append(f"| {slowdown:g} | {rates[f'{slowdown:g}']} | {shown[0.0]} | {shown[args.delay]} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    delayed = [r for r in rows if r["delay_s"]]
    seen = membership_seen(delayed)
    headline = {"delay_over_none_by_slowdown": ratios, "steps_per_s_by_slowdown": rates, **seen}
    views = "no run trained 10 s" if seen["smallest_view"] is None else f"smallest view after 10 s {seen['smallest_view']} of {PEERS}"
    lines += ["", f"Membership on the delayed links, all runs: {seen['deaths']} deaths (every one false: nobody fails), "
              f"{seen['suspicions']} suspicions, {views}.", "",
              f"Wall time: {time.time() - began:.0f} s. `-`: not reached within {args.timeout:g} s.", "",
              f"Headline: {json.dumps(headline)}"]
    return harness.publish(out, lines, headline)


def membership_seen(rows: list[dict[str, object]]) -> dict[str, object]:
    """Deaths and suspicions summed over ``rows``, and their smallest view."""
    views = [r["smallest_view"] for r in rows if r["smallest_view"] is not None]
    return {"deaths": sum(int(r["deaths"]) for r in rows), "suspicions": sum(int(r["suspicions"]) for r in rows),  # type: ignore[call-overload]
            "smallest_view": min(views) if views else None}  # type: ignore[type-var]


def soak(args: argparse.Namespace, out: Path, work: Path, link: str, began: float) -> int:
    """``--soak``: one delayed (and lossy) run trained ``args.soak`` seconds; what membership saw meanwhile."""
    slowdown = args.slowdowns[0]
    row = one_run(0, args.delay, slowdown, args.target, args.timeout, work / "soak", loss=args.loss, min_seconds=args.soak,
                  workload=args.workload, jitter=args.jitter)
    print(json.dumps(row), flush=True)
    harness.write_csv(out / "runs.csv", [row])
    seen = membership_seen([row])
    headline = {"trained_s": row["trained_s"], "time_to_target_s": row["time_to_target_s"], **seen}
    lines = ["# A soak on real network stacks: no false deaths?", "",
             f"Regenerate: `{args.command}`. 4 `gossiptrain peer` processes and a coordinator, each behind a proxy: "
             f"{link}; {args.workload}, 3 classes per peer, seed 0, slowdown {slowdown:g}.", "",
             f"Trained {row['trained_s']} s (the target {args.target} after {row['time_to_target_s']} s); the peers "
             f"declared **{seen['deaths']}** members dead (nobody failed: every death would be false), took up "
             f"{seen['suspicions']} suspicions, and every view held at least {seen['smallest_view']} of {PEERS} "
             f"after the first 10 s. Round trip (median of the peers' last): {row['rtt_ms']} ms.", "",
             f"Wall time: {time.time() - began:.0f} s.", "", f"Headline: {json.dumps(headline)}"]
    return harness.publish(out, lines, headline)


if __name__ == "__main__":
    sys.exit(main())
