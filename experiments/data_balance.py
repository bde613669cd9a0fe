"""Issue 49: static shards against chunks leased through the swarm, on real processes and in the simulator.

**Real processes** (``--real``): a coordinator and 4 peer processes on
loopback, each a user's script on the Python API (``gossiptrain.Peer``): an
MLP 64-128-10 on the digits this repository ships, SGD lr 0.05 momentum 0.9,
batch 32, one torch thread. ``static``: each peer trains its iid shard (a
quarter of the data), reshuffled each pass. ``leased``: each iterates
``peer.sampler(1437)``, the chunks it leases (``gossiptrain.protocol.leases``).
Both read their indices one at a time and batch them, as a DataLoader does. Every peer counts how
often it trained each sample (the dataset's index) and writes the counts
with its evaluations, so the per-sample counts of the whole swarm are the
sums of the peers' last counts (a killed peer's last counts are at most one
evaluation old). Settings (``--settings``):

- ``equal``: four peers of one speed;
- ``2x``, ``4x``: peer 3 sleeps after each step so that it is 2 or 4 times slower;
- ``churn``: peers 1, 2 and 3 in turn are killed (SIGKILL) and restarted 4 s
  later (a quarter of the swarm down at a time);
- ``churn8``: 8 peers, two killed at a time (1 and 2, 3 and 4, 5 and 6) and
  restarted 4 s later, as in the churn experiment (issue 49's target).

Per run: the per-sample counts as multiples of their mean (min, max); for
leased runs the epochs the swarm finished, the chunks of finished epochs
with a sample trained fewer times than the epochs finished ("untrained"),
and the samples trained twice (the peers' own count, ``samples_trained_twice``)
as a share of the samples trained; the longest stall (the longest time
between two steps of one peer, its first step on); the time to the target (the peers' mean
test accuracy held at ``--target`` for 3 evaluations); the samples trained
in the run (the mean count: times the dataset), and the CPU time of the
peer processes per step (every thread: a step's cost to the machine, which
the machine's load does not change as it changes the samples trained in a
fixed time).

**Simulated** (``--sim``): 16 and 64 peers (``gossiptrain.sim``, the same
lease core), digits-small and charlm, speeds equal, one peer 4x slower, and
lognormal (sigma 0.5); static against leased: time to target, and for
leased the epochs, waits and samples trained twice. Per-sample counts are
not recorded in the simulator; a static shard's count is its peer's samples
trained over the shard's size.

Output in experiments/results/data_balance/: runs.csv, sim.csv, summary.md
(the commands at the top). The last line printed is one JSON object with
``count_spread_4x_static``, ``count_spread_4x_leased`` ([min, max] as
multiples of the mean, medians over seeds), ``untrained_chunks_churn``,
``trained_twice_churn`` and ``time_leased_over_static_equal`` (from the
real runs).

    python experiments/data_balance.py --real --seeds 3 --seconds 30     # about 15 minutes
    python experiments/data_balance.py --sim --sim-peers 16 --seeds 3 --out experiments/results/data_balance/sim
    python experiments/data_balance.py --quick                             # 1 seed, short: a smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # first: this folder's topologies.py must not hide the topologies package

from experiments import harness  # noqa: E402
from experiments.zoo import code_version  # noqa: E402
from gossiptrain.train.metrics import read_metrics  # noqa: E402

PEERS = 4
BATCH = 32
LR, MOMENTUM = 0.05, 0.9
EVAL_EVERY = 0.25
COUNTS_EVERY = 1.0  # seconds between a peer's writes of its per-sample counts
STARTUP = 180.0
SETTINGS = ("equal", "2x", "4x", "churn", "churn8")
SLOW = {"equal": 1.0, "2x": 2.0, "4x": 4.0, "churn": 1.0, "churn8": 1.0}  # peer 3's slowdown
PEERS_OF = {"churn8": 8}  # settings of another swarm size than PEERS
# Who is killed at each churn (SIGKILL), CHURN_EVERY s apart once all train; each comes back CHURN_DOWN s later.
KILLS = {"churn": ((1,), (2,), (3,)), "churn8": ((1, 2), (3, 4), (5, 6))}
CHURN_EVERY, CHURN_DOWN = 6.0, 4.0
MODES = ("static", "leased")
SIM_PEERS = (16, 64)
SIM_WORKLOADS = {"digits-small": 0.93, "charlm": 0.40}  # workload -> target (test accuracy; next-byte accuracy)
SIM_SPEEDS = ("equal", "4x", "lognormal")


# -- the user's script ---------------------------------------------------------------------------------------


def peer_main(args: argparse.Namespace) -> None:
    """One peer: the digits MLP on its shard or on the chunks it leases; counts and evaluations as JSON lines."""
    import gossiptrain
    from experiments.user_loop import Records, accuracy, digits
    from gossiptrain.train.partition import partition_indices

    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = digits()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    counts = torch.zeros(len(y_train), dtype=torch.int64)  # (N,) times this process trained each sample
    log = Records(args.metrics)
    with gossiptrain.Peer(model, join=args.join, bind=f"{args.host}:0", shard=args.index, optimizer=opt) as peer:
        if not args.restarted:
            peer.wait_for_peers(args.peers, timeout=STARTUP)
        if args.mode == "leased":
            indices = batches_of(leased_indices(peer, len(y_train)))
        else:
            mine = partition_indices(y_train, peer.shard, peer.num_shards, args.seed, "iid")  # (n,)
            indices = batches_of(shuffled_indices(mine, args.seed * 1000 + peer.shard))
        log.start(shard=peer.shard, mode=args.mode)
        step, next_eval, next_counts = 0, EVAL_EVERY, COUNTS_EVERY
        stall, last_step = 0.0, None  # the longest time between two steps (a peer that waits for data, say)
        while time.monotonic() - log.started < args.seconds:
            computed = time.perf_counter()
            batch = next(indices)  # (B,) dataset indices
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            peer.step()
            counts[batch] += 1
            step += 1
            now = time.perf_counter()
            stall = max(stall, now - last_step) if last_step is not None else 0.0
            last_step = now
            if args.slowdown > 1:  # a slow machine: idle, so the others keep the CPU
                time.sleep((args.slowdown - 1) * (time.perf_counter() - computed))
            elapsed = time.monotonic() - log.started
            if elapsed >= next_eval:
                acc = accuracy(model, x_test, y_test)
                log.write("eval", step=step, test_acc=acc, longest_stall_s=round(stall, 3), **lease_fields(peer))
                peer.report(loss=loss.item(), test_acc=acc)
                next_eval = elapsed + EVAL_EVERY
            if elapsed >= next_counts:
                log.write("counts", counts=counts.tolist())
                next_counts = elapsed + COUNTS_EVERY
        cpu = time.process_time()  # every thread of this process: training, the peer's network side, its leases
        log.write("done", step=step, test_acc=accuracy(model, x_test, y_test), longest_stall_s=round(stall, 3),
                  cpu_s=round(cpu, 3), **lease_fields(peer))
        log.write("counts", counts=counts.tolist())
        peer.finish()


def batches_of(indices: Iterator[int]) -> Iterator[torch.Tensor]:
    """Batches (B,) of the indices a sampler gives one at a time, as a DataLoader takes them: the same for both
    modes, so that what differs between them is where the indices come from."""
    batch: list[int] = []
    for i in indices:
        batch.append(i)
        if len(batch) == BATCH:
            yield torch.tensor(batch)
            batch = []


def leased_indices(peer: Any, samples: int) -> Iterator[int]:
    """The indices ``peer.sampler`` yields, pass after pass (one pass: one epoch of the swarm)."""
    sampler = peer.sampler(samples)
    while True:
        yield from sampler


def shuffled_indices(mine: torch.Tensor, seed: int) -> Iterator[int]:
    """This peer's shard, reshuffled each pass: a RandomSampler over it (``DataLoader(shuffle=True)``)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield from mine[torch.randperm(len(mine), generator=gen)].tolist()


def lease_fields(peer: Any) -> dict[str, Any]:
    stats = peer.stats()
    return {k: stats[k] for k in ("lease_epoch", "samples_trained", "samples_trained_twice", "chunks_taken_over", "lease_waits")
            if k in stats}


# -- real runs -----------------------------------------------------------------------------------------------


def real_run(setting: str, mode: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    harness.fresh_dir(work)
    peers = PEERS_OF.get(setting, PEERS)
    overrides = {"train.workload": "external", "train.shards": peers, "train.seed": seed}
    names = [f"peer-{i}" for i in range(peers)]

    def start(procs: harness.Procs, i: int, join: str, restarted: bool = False, seconds: float = args.seconds) -> Any:
        return procs.start(f"{names[i]}{'-again' if restarted else ''}-{time.monotonic_ns()}", child(
            "--role", "peer", "--join", join, "--index", i, "--peers", peers, "--host", f"127.0.0.{20 + i}",
            "--mode", mode, "--seed", seed, "--seconds", seconds, "--metrics", work / f"{names[i]}.jsonl",
            "--slowdown", SLOW[setting] if i == 3 else 1.0, *(["--restarted"] if restarted else [])))

    began = time.perf_counter()
    with harness.Procs(work) as procs:
        join = harness.start_coordinator(procs, overrides)
        running = {i: start(procs, i, join) for i in range(peers)}
        if setting in KILLS:
            # Kill in turn once all train; each comes back CHURN_DOWN s later for the rest of the run.
            harness.poll_run(procs, lambda: [], None, STARTUP, done=lambda: all(
                (work / f"{n}.jsonl").exists() and '"start"' in (work / f"{n}.jsonl").read_text() for n in names))
            t0 = time.monotonic()
            for k, victims in enumerate(KILLS[setting]):
                time.sleep(max(0.0, t0 + CHURN_EVERY * (k + 1) - time.monotonic()))
                for i in victims:
                    running[i].send_signal(signal.SIGKILL)
                time.sleep(CHURN_DOWN)
                left = args.seconds - (time.monotonic() - t0)
                if left > 2:
                    for i in victims:
                        running[i] = start(procs, i, join, restarted=True, seconds=left)
        deadline = time.monotonic() + args.seconds + STARTUP
        while any(p.poll() is None for p in running.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
    per_peer = [read_metrics(work / f"{n}.jsonl") for n in names]
    row = {"setting": setting, "mode": mode, "seed": seed, **summarise(per_peer, mode, seed, args.target)}
    row["wall_s"] = round(time.perf_counter() - began, 1)
    return row


def summarise(per_peer: list[list[dict[str, Any]]], mode: str, seed: int, target: float) -> dict[str, Any]:
    from gossiptrain.runtime.leased_data import plan_for
    from gossiptrain.config import DataConfig

    evals = [[r for r in recs if r.get("event") in ("eval", "done")] for recs in per_peer]
    points, _ = harness.gossip_series(evals_with_start(per_peer), BATCH)
    total = torch.zeros(0, dtype=torch.int64)
    twice = trained = 0
    for recs in per_peer:
        # Each incarnation's last counts (a restarted peer starts counting from zero again).
        for incarnation in split_incarnations(recs):
            last = next((r["counts"] for r in reversed(incarnation) if r.get("event") == "counts"), None)
            if last is not None:
                c = torch.tensor(last)
                total = c if total.numel() == 0 else total + c
            stats = next((r for r in reversed(incarnation) if "samples_trained" in r), None)
            if stats is not None:
                twice += stats.get("samples_trained_twice", 0)
                trained += stats["samples_trained"]
    mean = float(total.float().mean()) if total.numel() else math.nan
    row: dict[str, Any] = {
        "time_to_target_s": harness.time_to_target(points, target),
        "count_min": round(float(total.min()) / mean, 3) if total.numel() else None,
        "count_max": round(float(total.max()) / mean, 3) if total.numel() else None,
        "mean_count": round(mean, 2),
        "final_acc": round(statistics.mean(e[-1]["test_acc"] for e in evals if e), 4),
        "longest_stall_s": max((r.get("longest_stall_s", 0.0) for e in evals for r in e), default=None),
    }
    done = [r for recs in per_peer for r in recs if r.get("event") == "done" and "cpu_s" in r]
    if done:  # CPU per step, over the peers that finished: what a step costs the machine, whatever its load
        row["cpu_ms_per_step"] = round(1e3 * sum(r["cpu_s"] for r in done) / max(1, sum(r["step"] for r in done)), 3)
    if mode == "leased":
        epochs = max((r.get("lease_epoch", 0) for e in evals for r in e), default=0)
        plan = plan_for(len(total), DataConfig(), seed)
        # A sample trained fewer times than the epochs finished missed one: its chunk of epoch 0 stands for the
        # chunk (a chunk's samples differ per epoch; what is counted is samples, named by their first chunk).
        low = {c for c in range(plan.chunks) for i in plan.indices(c) if total[i] < epochs} if epochs else set()
        row.update(epochs=epochs, untrained_chunks=len(low), trained_twice=round(twice / max(1, trained), 4))
    return row


def split_incarnations(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for r in records:
        if r.get("event") == "start" or not out:
            out.append([])
        out[-1].append(r)
    return out


def evals_with_start(per_peer: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    return [[r for r in recs if r.get("event") in ("start", "eval", "done")] for recs in per_peer]


# -- simulated runs ------------------------------------------------------------------------------------------


def sim_run(peers: int, workload: str, speeds: str, mode: str, seed: int, duration: float, chunks: int = 0) -> dict[str, Any]:
    import random

    from gossiptrain.config import RunConfig
    from gossiptrain.sim.cluster import simulate
    from gossiptrain.sim.sim_config import SimConfig

    target = SIM_WORKLOADS[workload]
    run = RunConfig().with_overrides({"train.workload": workload, "train.shards": peers, "train.seed": seed,
                                      "data.mode": "leased" if mode == "leased" else "shards", "data.chunks": chunks,
                                      "train.max_steps": 0, "train.max_seconds": 0})
    rng = random.Random(seed)
    factors = {"equal": [1.0] * peers, "4x": [1.0] * (peers - 1) + [4.0],
               "lognormal": [max(1.0, math.exp(rng.gauss(0, 0.5))) for _ in range(peers)]}[speeds]
    began = time.perf_counter()
    res = simulate(SimConfig(peers=peers, run=run, duration=duration, seed=seed, speeds=tuple(factors),
                             step_time=0.004 if workload == "digits-small" else 0.01, sample_every=0.25))
    last: dict[Any, dict[str, Any]] = {}
    for r in res.rows:
        if "peer" in r:
            last[r["peer"]] = r
    times = sorted({r["time"] for r in res.rows if "test_acc" in r})
    reached = None
    for k, t in enumerate(times):
        window = times[k : k + 3]
        if len(window) == 3 and all(mean_acc(res.rows, w) >= target for w in window):
            reached = t
            break
    row: dict[str, Any] = {"peers": peers, "workload": workload, "speeds": speeds, "mode": mode, "seed": seed, "chunks": chunks,
                           "time_to_target_s": reached, "wall_s": round(time.perf_counter() - began, 1)}
    steps = [r.get("step", 0) for r in last.values()]
    row["steps_median"] = statistics.median(steps) if steps else 0
    if mode == "leased" and last:
        trained = sum(r.get("samples_trained", 0) for r in last.values())
        row.update(epochs=max(r.get("lease_epoch", 0) for r in last.values()),
                   trained_twice=round(sum(r.get("samples_trained_twice", 0) for r in last.values()) / max(1, trained), 4),
                   waits=int(sum(r.get("lease_waits", 0) for r in last.values())))
    else:  # a shard's count: its peer's steps over the mean (iid shards of equal size)
        mean = statistics.mean(steps) if steps else math.nan
        row.update(count_min=round(min(steps) / mean, 3), count_max=round(max(steps) / mean, 3))
    return row


def mean_acc(rows: list[dict[str, Any]], t: float) -> float:
    accs = [r["test_acc"] for r in rows if r.get("time") == t and "test_acc" in r]
    return statistics.mean(accs) if accs else 0.0


# -- the tables ---------------------------------------------------------------------------------------------


def child(*args: Any) -> list[str]:
    return harness.python_m("experiments.data_balance", *args)


def med(values: list[Any]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def dash(x: float | None, digits: int) -> str:
    return "-" if x is None else harness.fmt(x, digits)


def real_table(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    out = ["| setting | peers | mode | runs | time to target (s), each seed | count min / max (x mean) | epochs | untrained chunks | trained twice | longest stall (s) | final acc | samples trained (x dataset) | CPU ms / step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    med_of: dict[tuple[str, str], dict[str, Any]] = {}
    for setting in SETTINGS:
        for mode in MODES:
            rs = [r for r in rows if r["setting"] == setting and r["mode"] == mode]
            if not rs:
                continue
            times = [r.get("time_to_target_s") for r in rs]
            m = {"time": harness.spread(times)[0], "min": med([r.get("count_min") for r in rs]),
                 "max": med([r.get("count_max") for r in rs]), "untrained": med([r.get("untrained_chunks") for r in rs]),
                 "twice": med([r.get("trained_twice") for r in rs]),
                 "stall": max((r["longest_stall_s"] for r in rs if r.get("longest_stall_s") is not None), default=None)}
            med_of[setting, mode] = m
            out.append(f"| {setting} | {PEERS_OF.get(setting, PEERS)} | {mode} | {len(rs)} | {harness.fmt_seconds(m['time'])}: "
                       f"{', '.join(harness.fmt_seconds(t) for t in times)} | {harness.fmt(m['min'])} / {harness.fmt(m['max'])} | "
                       f"{med([r.get('epochs') for r in rs]) if mode == 'leased' else '-'} | "
                       f"{m['untrained'] if mode == 'leased' else '-'} | {m['twice'] if mode == 'leased' else '-'} | "
                       f"{'-' if m['stall'] is None else harness.fmt(m['stall'])} | "
                       f"{harness.fmt(med([r.get('final_acc') for r in rs]), 3)} | "
                       f"{dash(med([r.get('mean_count') for r in rs]), 0)} | "
                       f"{dash(med([r.get('cpu_ms_per_step') for r in rs]), 3)} |")

    def pair(setting: str, mode: str) -> list[float | None] | None:
        m = med_of.get((setting, mode))
        return [m["min"], m["max"]] if m else None

    eq_s, eq_l = med_of.get(("equal", "static")), med_of.get(("equal", "leased"))
    ratio = None
    if eq_s and eq_l and eq_s["time"] and eq_l["time"] and math.isfinite(eq_s["time"]) and math.isfinite(eq_l["time"]):
        ratio = round(eq_l["time"] / eq_s["time"], 3)
    head: dict[str, Any] = {"count_spread_4x_static": pair("4x", "static"), "count_spread_4x_leased": pair("4x", "leased")}
    for setting in ("churn", "churn8"):
        churn = med_of.get((setting, "leased"))
        head.update({f"untrained_chunks_{setting}": churn["untrained"] if churn else None,
                     f"trained_twice_{setting}": churn["twice"] if churn else None,
                     f"longest_stall_{setting}": churn["stall"] if churn else None})
    head["time_leased_over_static_equal"] = ratio
    return out, head


def sim_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| peers | workload | speeds | mode | time to target (s), median | steps per peer, median | count min / max (static) | epochs | trained twice | waits |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["peers"], r["workload"], r["speeds"], r["mode"]) for r in rows})
    for peers, workload, speeds, mode in keys:
        rs = [r for r in rows if (r["peers"], r["workload"], r["speeds"], r["mode"]) == (peers, workload, speeds, mode)]
        t = harness.spread([r["time_to_target_s"] for r in rs])[0]
        counts = f"{harness.fmt(med([r.get('count_min') for r in rs]))} / {harness.fmt(med([r.get('count_max') for r in rs]))}" if mode == "static" else "-"
        out.append(f"| {peers} | {workload} | {speeds} | {mode} | {harness.fmt_seconds(t)} | "
                   f"{med([r.get('steps_median') for r in rs])} | {counts} | "
                   f"{med([r.get('epochs') for r in rs]) if mode == 'leased' else '-'} | "
                   f"{med([r.get('trained_twice') for r in rs]) if mode == 'leased' else '-'} | "
                   f"{med([r.get('waits') for r in rs]) if mode == 'leased' else '-'} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="runner")
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--sim", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--sim-seconds", type=float, default=10.0)
    parser.add_argument("--sim-peers", default=",".join(map(str, SIM_PEERS)))
    parser.add_argument("--sim-workloads", default=",".join(SIM_WORKLOADS))
    parser.add_argument("--sim-speeds", default=",".join(SIM_SPEEDS))
    parser.add_argument("--sim-chunks", type=int, default=0, help="data.chunks of simulated leased runs (0: the default)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--out", type=Path)
    # a peer's own arguments
    for name in ("--join", "--host", "--mode", "--metrics"):
        parser.add_argument(name)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--peers", type=int, default=PEERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--restarted", action="store_true")
    args = parser.parse_args()
    if args.role == "peer":
        args.metrics = Path(args.metrics)
        peer_main(args)
        return 0
    if args.quick:
        args.real, args.sim, args.seeds, args.seconds, args.sim_seconds = True, True, 1, 8.0, 4.0
        args.settings, args.sim_peers, args.sim_workloads, args.sim_speeds = "equal,4x", "16", "digits-small", "4x"
    if not (args.real or args.sim):
        args.real = args.sim = True
    out = harness.results_dir("data_balance", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/data_balance.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = ["# Issue 49: static shards against leased chunks", "",
             f"Command: `{command}` ({code_version()}, {time.strftime('%Y-%m-%d')})", ""]
    headline: dict[str, Any] = {}
    if args.real:
        rows = []
        for seed in range(args.seeds):
            for setting in args.settings.split(","):
                for mode in MODES:
                    row = real_run(setting, mode, seed, args, out / "work" / f"{setting}-{mode}-{seed}")
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        harness.write_csv(out / "runs.csv", rows)
        table, headline = real_table(rows)
        lines += ["## Real peers on loopback, digits", "", *table, ""]
    if args.sim:
        rows = []
        for seed in range(args.seeds):
            for peers in map(int, args.sim_peers.split(",")):
                for workload in args.sim_workloads.split(","):
                    for speeds in args.sim_speeds.split(","):
                        for mode in MODES:
                            row = sim_run(peers, workload, speeds, mode, seed, args.sim_seconds, args.sim_chunks)
                            print(json.dumps(row), flush=True)
                            rows.append(row)
        harness.write_csv(out / "sim.csv", rows)
        lines += ["## Simulated", "", *sim_table(rows), ""]
    return harness.publish(out, lines, headline)


if __name__ == "__main__":
    sys.exit(main())
