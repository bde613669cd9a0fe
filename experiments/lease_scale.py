"""Issue 49 at scale: the lease protocol with 64 to 1,024 members, uneven paces and churn, in virtual time.

``gossiptrain.sim`` runs the same lease core inside whole simulated peers
(``experiments/data_balance.py --sim``), but a 1,024-peer swarm that trains
real models does not fit this machine's ten minutes (issue 52). What leases
change at scale is the protocol's own behaviour: do the members stay busy,
does every chunk get trained once, what does the table cost on the wire. So
this study runs the lease machines alone (``gossiptrain.testing.lease_swarm``:
the real ``Leases`` core, members that train at a pace in samples per
virtual second, gossip with 1-20 ms delays, a membership that sees a crash
after 1 s) on a dataset of 50,000 samples (CIFAR-10's training set) cut
into the default 256 chunks an epoch. Mean pace 200 samples per second,
batch 32.

Settings (``--settings``):

- ``4x``: every fourth member 4x slower than the others;
- ``lognormal``: paces drawn lognormal, sigma 0.5 (a spread of about 4x
  between the 5th and 95th percentile);
- ``churn``: lognormal paces, and every 2 s a tenth of the live members
  crash (no goodbye: their claims lapse) while as many newcomers join 1 s
  later (a restarted peer has a new id).

Per run: the epochs the swarm finished; **utilization**, the samples
trained over what the members' paces allowed while they were up (1.0: no
member ever waited for a chunk); **pace share**, each member's samples over
its pace x time up, min and max over members (1.0 each: every member trained
in proportion to its speed); chunks below the floor with a sample nobody
trained (must be 0); samples trained twice as a share of all; bytes and
messages per member per second; wall and CPU seconds of the run. Medians of
``--seeds`` seeds. Output: experiments/results/lease_scale/{runs.csv,
summary.md}; the last line printed is one JSON object.

    python experiments/lease_scale.py --members 64,256       # about 20 minutes
    python experiments/lease_scale.py --members 1024 --seeds 1 --out experiments/results/lease_scale/1024   # 20 minutes
    python experiments/lease_scale.py --quick               # 32 members, 1 seed, 2 s: a smoke test
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from experiments.zoo import code_version  # noqa: E402
from gossiptrain.protocol.leases import ChunkPlan, LeaseSettings, default_chunks  # noqa: E402
from gossiptrain.testing.lease_swarm import LeaseSwarm  # noqa: E402

SAMPLES = 50_000
PACE = 200.0  # samples per virtual second, the mean
BATCH = 32
SETTINGS = ("4x", "lognormal", "churn")
MEMBERS = (64, 256, 1024)
SECONDS = {64: 10.0, 256: 6.0, 1024: 4.0}  # virtual seconds per run: 64 members about 5 s of wall time, 256 about 2 min, 1,024 about 6 min
CHURN_EVERY, CHURN_SHARE, CHURN_BACK = 2.0, 0.1, 1.0


def paces(setting: str, members: int, rng: random.Random) -> list[float]:
    if setting == "4x":
        return [PACE / 4 if i % 4 == 3 else PACE for i in range(members)]
    return [PACE * rng.lognormvariate(0.0, 0.5) for _ in range(members)]


def one_run(setting: str, members: int, seed: int, seconds: float) -> dict[str, Any]:
    """One swarm of ``members`` for ``seconds`` virtual seconds; the row of runs.csv."""
    started, cpu = time.perf_counter(), time.process_time()
    rng = random.Random(seed)
    plan = ChunkPlan(SAMPLES, default_chunks(SAMPLES), seed)
    swarm = LeaseSwarm(plan, LeaseSettings(), seed=seed, batch=BATCH)
    up_since: dict[str, float] = {}
    up_for: dict[str, float] = {}

    def join(pace: float) -> None:
        m = swarm.add(pace)
        up_since[m.id] = swarm.now

    def churn() -> None:
        live = [m for m in swarm.up()]
        victims = rng.sample(live, max(1, round(CHURN_SHARE * len(live))))
        for m in victims:
            swarm.crash(m.id)
            up_for[m.id] = swarm.now - up_since.pop(m.id)
        back = [PACE * rng.lognormvariate(0.0, 0.5) for _ in victims]
        swarm.at(swarm.now + CHURN_BACK, lambda: [join(p) for p in back])

    for p in paces(setting, members, rng):
        join(p)
    if setting == "churn":
        t = CHURN_EVERY
        while t < seconds:
            swarm.at(t, churn)
            t += CHURN_EVERY
    swarm.run(seconds)
    for mid, since in up_since.items():
        up_for[mid] = seconds - since
    everyone = list(swarm.members.values())
    trained = {m.id: m.leases.stats.samples_trained for m in everyone}
    allowed = {m.id: m.pace * up_for[m.id] for m in everyone}
    # Members up for under 2 s trained at most a few chunks: their share says more about rounding than balance.
    shares = [trained[m] / allowed[m] for m in trained if up_for[m] >= 2.0 and allowed[m] > 0]
    total = sum(trained.values())
    floor = swarm.floor()
    member_seconds = sum(up_for.values())
    return {
        "setting": setting, "members": members, "seed": seed, "seconds": seconds,
        "epochs": round(floor / plan.chunks, 2),
        "utilization": round(total / sum(allowed.values()), 4),
        "share_min": round(min(shares), 3), "share_max": round(max(shares), 3),
        "untrained_below_floor": len(swarm.untrained_below(floor)),
        "trained_twice": round(sum(m.leases.stats.samples_trained_twice for m in everyone) / max(1, total), 5),
        "taken_over": sum(m.leases.stats.chunks_taken_over for m in everyone),
        "bytes_per_member_s": round(swarm.sent_bytes / member_seconds),
        "messages_per_member_s": round(swarm.messages / member_seconds, 2),
        "wall_s": round(time.perf_counter() - started, 1), "cpu_s": round(time.process_time() - cpu, 1),
    }


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarise(rows: list[dict[str, Any]], command: str) -> tuple[list[str], dict[str, Any]]:
    lines = [
        "# Issue 49 at scale: the lease protocol alone, 64 to 1,024 members",
        "",
        f"Command: `{command}` ({code_version()}, {time.strftime('%Y-%m-%d')})",
        "",
        f"`gossiptrain.testing.lease_swarm` (the real lease core; members train at a pace, gossip with 1-20 ms "
        f"delays): {SAMPLES:,} samples, {default_chunks(SAMPLES)} chunks an epoch, mean pace {PACE:g} samples/s, "
        f"batch {BATCH}. Medians over seeds (each seed's value in the csv). Utilization: samples trained over "
        "pace x time up; pace share: a member's samples over its pace x time up (members up 2 s or more), the "
        "lowest and highest.",
        "",
    ]
    table = []
    headline: dict[str, Any] = {}
    for members in sorted({r["members"] for r in rows}):
        for setting in SETTINGS:
            runs = [r for r in rows if r["members"] == members and r["setting"] == setting]
            if not runs:
                continue
            table.append([
                members, setting, len(runs), runs[0]["seconds"], median(runs, "epochs"),
                f"{median(runs, 'utilization'):.3f}", f"{median(runs, 'share_min'):.2f} / {median(runs, 'share_max'):.2f}",
                max(r["untrained_below_floor"] for r in runs), f"{median(runs, 'trained_twice'):.5f}",
                median(runs, "taken_over"), f"{median(runs, 'bytes_per_member_s') / 1e3:.1f}",
                median(runs, "messages_per_member_s"), median(runs, "wall_s"), median(runs, "cpu_s"),
            ])
            headline[f"{setting}_{members}"] = {
                "utilization": median(runs, "utilization"), "share": [median(runs, "share_min"), median(runs, "share_max")],
                "untrained": max(r["untrained_below_floor"] for r in runs), "trained_twice": median(runs, "trained_twice"),
            }
    lines += harness.markdown_table(
        ["members", "setting", "runs", "virtual s", "epochs", "utilization", "pace share min / max",
         "untrained chunks (max)", "trained twice", "chunks taken over", "kB / member / s", "messages / member / s",
         "wall s", "CPU s"], table)
    return lines, headline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default=",".join(map(str, MEMBERS)))
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.0, help="virtual seconds per run (default: by size)")
    ap.add_argument("--quick", action="store_true", help="32 members, 1 seed, 2 virtual s (a smoke test)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the chunk owners are scored in small tensor ops: one thread is fastest
    sizes = [32] if args.quick else [int(x) for x in args.members.split(",")]
    seeds = 1 if args.quick else args.seeds
    settings = harness.chosen(args.settings, SETTINGS, "setting")
    out = harness.results_dir("lease_scale", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for members in sizes:
        seconds = args.seconds or (2.0 if args.quick else SECONDS.get(members, 10.0))
        for setting in settings:
            for seed in range(seeds):
                row = one_run(setting, members, seed, seconds)
                rows.append(row)
                print(f"{members} members, {setting}, seed {seed}: utilization {row['utilization']:.3f}, share "
                      f"{row['share_min']:.2f}-{row['share_max']:.2f}, untrained {row['untrained_below_floor']}, "
                      f"epochs {row['epochs']} ({row['wall_s']} s)", flush=True)
                harness.write_csv(out / "runs.csv", rows)
    command = "python experiments/lease_scale.py " + " ".join(sys.argv[1:])
    lines, headline = summarise(rows, command.strip())
    return harness.publish(out, lines, headline)


if __name__ == "__main__":
    raise SystemExit(main())
