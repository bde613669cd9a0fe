"""50 ms each way on every link, on real network stacks: real `gossiptrain` processes, their real TCP and ZeroMQ.

This machine's kernel has no `tc netem`, so the delay is made in user space:
each member (the coordinator and 4 peers) stands behind its own
``gossiptrain.testing.delay_proxy.DelayProxy``, which passes every byte on
``--delay`` seconds later, each way, in order. A peer binds 127.0.5.i and
advertises the proxy's host 127.0.4.i on the same port, so everything sent
to it (joins, probes, exchanges, state) crosses its proxy, and every round
trip between two members takes 2 x delay more. The baseline runs through
the same proxies with no delay, so both pay the same relaying.

4 peers, digits-small, 3 classes per peer (label-skewed), started as they
join; time from the first peer's start to a mean test accuracy of
``--target`` held for 3 evaluations (experiments/harness.py), seeds 0 to
``--seeds`` - 1; at `--slowdown` 1 (this machine's own step, a few ms: a
round trip is tens of steps) and at larger ones (each step idles
FACTOR - 1 times its compute, as a slower model's step would take).
Loss is not emulated (TCP recovers it by retransmitting; the simulated
form, experiments/latency_loss.py, drops whole messages instead).

Output: experiments/results/real_delay/ (`--quick`: a scratch folder):
runs.csv and summary.md; the last line printed is a JSON object
{"delay_over_none_by_slowdown": {FACTOR: ratio of medians}, "steps_per_s_by_slowdown": {...}}.

    python experiments/real_delay.py             # slowdowns 1 and 20, 3 seeds (about 2 minutes here)
    python experiments/real_delay.py --quick     # slowdown 20, 1 seed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.train.metrics import read_metrics  # noqa: E402
from gossiptrain.testing.delay_proxy import DelayProxy  # noqa: E402

PEERS = 4
SKEW = {"train.workload": "digits-small", "train.partition": "classes-per-peer", "train.partition_classes": 3}


def one_run(seed: int, delay: float, slowdown: float, target: float, timeout: float, workdir: Path,
            gossip: dict[str, object] | None = None) -> dict[str, object]:
    """A coordinator and PEERS peers, each behind a proxy of ``delay``; the time to the target and the step rate.

    ``gossip``: more fields of the run's configuration (e.g. {"gossip.max_steps_ahead": 8}).
    """
    harness.fresh_dir(workdir)
    overrides = {**harness.run_overrides(PEERS, seed, max_seconds=timeout + 60), **SKEW, **(gossip or {})}
    batch_size = RunConfig().with_overrides(overrides).train.batch_size
    with harness.Procs(workdir) as procs, contextlib.ExitStack() as proxies:
        front = proxies.enter_context(DelayProxy("127.0.4.100", delay))
        front.set_target(harness.start_coordinator(procs, overrides))
        for i in range(PEERS):
            proxy = proxies.enter_context(DelayProxy(f"127.0.4.{i + 1}", delay))
            proxy.set_target(f"127.0.5.{i + 1}:{proxy.port}")
            extra = ["--slowdown", slowdown] if slowdown > 1 else []
            procs.start(f"peer-{i}", harness.python_m(
                "gossiptrain", "peer", "--join", front.address, "--bind", f"127.0.5.{i + 1}:{proxy.port}",
                "--advertise", f"127.0.4.{i + 1}", "--quiet", "--threads", 1, "--shard", i,
                "--metrics", workdir / f"peer-{i}.jsonl", *extra,
            ))

        def read() -> list[harness.Point]:
            return harness.gossip_series([read_metrics(workdir / f"peer-{i}.jsonl") for i in range(PEERS)], batch_size)[0]

        points = harness.poll_run(procs, read, target, timeout)
    per_peer = [read_metrics(workdir / f"peer-{i}.jsonl") for i in range(PEERS)]
    last = [next((r for r in reversed(recs) if r.get("event") in ("eval", "done")), {}) for recs in per_peer]
    elapsed = max((p.elapsed for p in points), default=0.0)
    steps = [r.get("step", 0) for r in last]
    return {
        "seed": seed, "delay_s": delay, "slowdown": slowdown,
        "time_to_target_s": harness.time_to_target(points, target),
        "final_acc": round(points[-1].acc, 4) if points else None,
        "steps_per_s": round(statistics.mean(steps) / elapsed, 1) if elapsed else None,
        "rtt_ms": statistics.median(r.get("rtt_ms", 0.0) for r in last),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.05, help="seconds each way on every link (default 0.05)")
    ap.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 20.0])
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds of training a run may take (default 120)")
    ap.add_argument("--quick", action="store_true", help="slowdown 20, 1 seed")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.slowdowns = 1, [20.0]
    out = harness.results_dir("real_delay", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    began = time.time()
    work = Path(tempfile.mkdtemp(prefix="gossiptrain-real-delay-"))  # the processes' logs and metrics
    for slowdown in args.slowdowns:
        for seed in range(args.seeds):
            for delay in (0.0, args.delay):  # interleaved: the machine's load drifts alike for both
                row = one_run(seed, delay, slowdown, args.target, args.timeout, work / f"s{slowdown:g}-seed{seed}-d{delay:g}")
                print(json.dumps(row), flush=True)
                rows.append(row)
    harness.write_csv(out / "runs.csv", rows)

    def med(slowdown: float, delay: float, key: str) -> float | None:
        values = [r[key] for r in rows if r["slowdown"] == slowdown and r["delay_s"] == delay]
        return statistics.median(values) if values and all(v is not None for v in values) else None  # type: ignore[type-var]

    ratios, rates = {}, {}
    lines = ["# Link delay on real network stacks (user-space delay proxies)", "",
             f"Regenerate: `python experiments/real_delay.py`. 4 `gossiptrain peer` processes and a coordinator, each "
             f"behind a proxy delaying every byte {args.delay * 1000:g} ms each way (a round trip {2 * args.delay * 1000:g} ms "
             "more); digits-small, 3 classes per peer; seconds from the first peer's start to a mean test accuracy of "
             f"{args.target} held for 3 evaluations; seeds 0-{args.seeds - 1}; one 2-core machine shared by all.", "",
             "| slowdown | steps/s per peer (no delay) | no delay (s) | delay (s) | delay / none (medians) |",
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
    headline = {"delay_over_none_by_slowdown": ratios, "steps_per_s_by_slowdown": rates}
    lines += ["", f"Wall time: {time.time() - began:.0f} s. `-`: not reached within {args.timeout:g} s.", "",
              f"Headline: {json.dumps(headline)}"]
    return harness.publish(out, lines, headline)


if __name__ == "__main__":
    sys.exit(main())
