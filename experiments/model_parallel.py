"""Issue 48: what a rank of a split peer holds and sends, and how split peers learn against DDP peers and single workers.

Part ``memory`` (the first measurements): two peers of 2 ranks each hold the
charlm transformer (``peers.charlm:transformer``, 4,115,008 parameters in 114
tensors) split by FSDP2 (``fully_shard`` on every layer and the root; gloo on
CPU), train a few AdamW steps on their own text and average their pieces
rank by rank over each rank's own socket (``gossiptrain.runtime.split_group``).
Each rank measures, from the tensors it holds (storage bytes, not shapes):
its parameters plus its optimizer's state, and the bytes its socket sent per
exchange. The single-worker peer is measured the same way in this process.

Part ``loss``: the same model trained by four swarms of 4 processes through
``Peer`` (``experiments/model_parallel_ranks.py``: 2 peers x 2 FSDP2 ranks,
2 peers x 2 pipeline stages, 2 peers x 2 DDP ranks, 4 peers x 1 rank), the
same samples per round, AdamW, a coordinator each; at equal samples (a fixed
number of steps) and at equal time (a fixed number of seconds), each peer's
model gathered from its pieces and evaluated on the validation text here.

    python experiments/model_parallel.py [--part memory|loss|both] [--quick] [--seeds N] [--steps N] [--seconds S]
        [--modes samples,time] [--defaults] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from gossiptrain.net.addressing import free_loopback_port  # noqa: E402
from gossiptrain.state.local_tensors import local  # noqa: E402

WORKLOAD = "peers.charlm:transformer"
STEPS, BATCH = 3, 8


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of the storages this rank holds for its parameters and for its optimizer's state (each counted once)."""
    def storages(tensors: Any) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                s = local(t).untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    state = [v for per_param in optimizer.state.values() for v in per_param.values()]
    return storages(model.parameters()), storages(state)


def train_steps(workload: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: int, steps: int) -> None:
    inputs, targets = workload.train_shard(shard, 2, 0)
    for i in range(steps):
        optimizer.zero_grad()
        workload.loss(model, inputs[i * BATCH:(i + 1) * BATCH], targets[i * BATCH:(i + 1) * BATCH]).backward()
        optimizer.step()


def rank_main(peer: str, rank: int, port: int, out: Path, exchanges: int) -> None:
    """One rank of peer A (asks) or B (serves): FSDP2, a few AdamW steps, then ``exchanges`` piece exchanges."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gossiptrain.runtime.loop_thread import LoopThread
    from gossiptrain.runtime.split_group import SplitGroup
    from gossiptrain.train.workload import load_workload

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    workload = load_workload(WORKLOAD)
    model = workload.build_model(1 if peer == "A" else 2)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    train_steps(workload, model, optimizer, 0 if peer == "A" else 1, STEPS)
    params, state = held_bytes(model, optimizer)
    loop = LoopThread(f"mp-{peer}{rank}").start()
    host = f"127.0.0.{70 + 2 * (peer == 'B') + rank}"
    group = SplitGroup(dist.group.WORLD, model, me=peer, host=host, fingerprint="model-parallel", loop=loop,
                       timeout=30.0, clock=time.monotonic)
    if rank == 0:
        (out / f".{peer}.addr").write_text(group.link.address)
        (out / f".{peer}.addr").rename(out / f"{peer}.addr")
    partner = None
    if (peer, rank) == ("A", 0):
        waited = time.monotonic() + 120
        while not (out / "B.addr").exists():
            if time.monotonic() > waited:
                raise SystemExit("peer B's leader never wrote its address (see B0.log)")
            time.sleep(0.05)
        partner = group.meet((out / "B.addr").read_text())
    sent_before = group.link.transport.stats.bytes_sent
    done = out / "A.done"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        more = group.stats.committed + len(group.exchanges.in_flight) < exchanges  # (proposed before one is decided)
        group.safe_point(partner if partner is not None and more else None)
        if peer == "A":
            finished = group.stats.committed >= exchanges and not group.busy
        else:
            finished = done.exists() and not group.exchanges.held
        if all(group.group.all_json(finished)):
            break
        time.sleep(0.01)
    if (peer, rank) == ("A", 0):
        done.write_text("")
    count = group.stats.committed if peer == "A" else group.stats.applied
    copies = group.exchanges.copy_bytes  # the frozen copy partners are answered from
    record = {"peer": peer, "rank": rank, "param_bytes": params, "optimizer_bytes": state, "copy_bytes": copies,
              "sent_bytes": group.link.transport.stats.bytes_sent - sent_before, "exchanges": count,
              "aborted": group.stats.aborted, "refused": group.stats.refused}
    (out / f"{peer}-{rank}.json").write_text(json.dumps(record))
    group.close()
    loop.stop()
    dist.destroy_process_group()


def whole_peer() -> dict[str, int]:
    """A single-worker peer, measured the same way: the unsplit model after the same AdamW steps."""
    from gossiptrain.train.workload import load_workload

    workload = load_workload(WORKLOAD)
    model = workload.build_model(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    train_steps(workload, model, optimizer, 0, STEPS)
    params, state = held_bytes(model, optimizer)
    return {"param_bytes": params, "optimizer_bytes": state, "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def memory_part(args: argparse.Namespace, out: Path) -> tuple[list[str], dict[str, Any]]:
    """Part ``memory``: the table of what each rank holds and sends; its lines and headline numbers."""
    exchanges = 1 if args.quick else args.exchanges
    work = harness.fresh_dir(out / "runs")
    for stale in list(work.glob("*.json")) + list(work.glob("*.addr")) + list(work.glob("*.done")):
        stale.unlink()
    started = time.monotonic()
    with harness.Procs(work) as procs:
        ports = {"A": free_loopback_port(), "B": free_loopback_port()}
        for peer in "AB":
            for rank in (0, 1):
                procs.start(f"{peer}{rank}", harness.python_m("experiments.model_parallel", "--out", work, "--rank", peer, rank,
                                                     ports[peer]) + (["--quick"] if args.quick else ["--exchanges", str(exchanges)]))
        while not procs.all_exited():
            failed = procs.failed()
            if failed:
                raise SystemExit(failed)
            time.sleep(0.2)
        failed = procs.failed()
        if failed:
            raise SystemExit(failed)
    ranks = [json.loads((work / f"{p}-{r}.json").read_text()) for p in "AB" for r in (0, 1)]
    whole = whole_peer()
    rows, worst_held, worst_sent = [], 0.0, 0.0
    for rec in ranks:
        held = (rec["param_bytes"] + rec["optimizer_bytes"]) / (whole["param_bytes"] + whole["optimizer_bytes"])
        asked = rec["peer"] == "A"
        per_exchange = rec["sent_bytes"] / max(1, rec["exchanges"]) / whole["model_bytes"]
        worst_held, worst_sent = max(worst_held, held), max(worst_sent, per_exchange)
        rows.append([f"{rec['peer']} (FSDP2 x 2, {'asks' if asked else 'serves'})", rec["rank"],
                     f"{rec['param_bytes'] / 1e6:.2f}", f"{rec['optimizer_bytes'] / 1e6:.2f}", f"{held:.3f}",
                     f"{rec['copy_bytes'] / 1e6:.2f}",
                     rec["exchanges"], f"{rec['sent_bytes'] / max(1, rec['exchanges']) / 1e6:.2f}", f"{per_exchange:.3f}"])
    rows.append(["one worker, the whole model", "-", f"{whole['param_bytes'] / 1e6:.2f}",
                 f"{whole['optimizer_bytes'] / 1e6:.2f}", "1.000", f"{whole['model_bytes'] / 1e6:.2f}", "-",
                 f"{whole['model_bytes'] / 1e6:.2f}", "1.000"])
    lines = [
        "## What a rank of a split peer holds and sends, against a single-worker peer",
        "",
        f"Part `memory` ({time.monotonic() - started:.0f} s, {exchanges} exchanges).",
        "",
        f"charlm transformer ({WORKLOAD}, {whole['model_bytes'] // 4:,} parameters, float32), AdamW after {STEPS} steps of "
        f"batch {BATCH}; 2 peers of 2 ranks, FSDP2 on gloo, averaging their pieces rank by rank (A asks, B serves). "
        "Held: storage bytes of the rank's parameters and of its optimizer's state, measured on the tensors. Sent: "
        "bytes the rank's own socket sent, per exchange (requests or replies, and the leaders' small messages), "
        "against the whole model's bytes. Both at rest, between steps: FSDP2 gathers each layer's parameters "
        "for a moment in forward and backward, which is not counted. Copy: the frozen copy of the piece that "
        "partners are answered from (a single-worker pairwise peer keeps one of its model too).",
        "",
        *harness.markdown_table(["peer", "rank", "params (MB)", "optimizer state (MB)", "held / one worker's", "copy (MB)",
                         "exchanges", "sent per exchange (MB)", "sent / model bytes"], rows),
    ]
    return lines, {"held_ratio_max": round(worst_held, 3), "sent_ratio_max": round(worst_sent, 3), "exchanges": exchanges}


ARMS = ("fsdp", "pipeline", "ddp", "single")
MODES = ("samples", "time")
ARM_WORDS = {"fsdp": "2 peers x 2 FSDP2 ranks", "pipeline": "2 peers x 2 pipeline stages",
             "ddp": "2 peers x 2 DDP ranks", "single": "4 peers x 1 rank"}


def loss_run(arm: str, mode: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One swarm of ``arm`` (``experiments/model_parallel_ranks.py``) to a number of steps or of seconds; each peer's
    model gathered from its pieces and evaluated here. Returns the run's row."""
    from experiments.model_parallel_ranks import PEERS, run_fields
    from gossiptrain.protocol.pieces import PieceEntry, PieceLayout, gather
    from gossiptrain.train.workload import load_workload
    from safetensors.torch import load_file

    steps, seconds = (args.steps, 0.0) if mode == "samples" else (0, args.seconds)
    ranks = 1 if arm == "single" else 2
    with harness.Procs(work) as procs:
        join = harness.start_coordinator(procs, run_fields(arm, args.defaults))
        for peer in range(PEERS[arm]):
            init = f"tcp://127.0.0.1:{free_loopback_port()}"
            for rank in range(ranks):
                procs.start(f"p{peer}r{rank}", harness.python_m(
                    "experiments.model_parallel_ranks", arm, peer, rank, join, init, work / f"p{peer}r{rank}.json", seed,
                    steps, seconds, args.batch, args.lr, *(["defaults"] if args.defaults else [])))
        deadline = time.monotonic() + 600
        names = [f"p{p}r{r}" for p in range(PEERS[arm]) for r in range(ranks)]
        while not all((work / f"{n}.json").exists() for n in names):
            if (problem := procs.failed()) is not None:
                raise SystemExit(problem)
            if time.monotonic() > deadline:
                raise SystemExit(f"{arm} seed {seed}: not done within 600 s (logs in {work})")
            time.sleep(0.2)
    workload = load_workload(WORKLOAD)
    losses, records = [], [json.loads((work / f"{n}.json").read_text()) for n in names]
    for peer in range(PEERS[arm]):
        held = range(ranks if arm in ("fsdp", "pipeline") else 1)  # the ranks whose pieces make the model
        files = [load_file(str(work / f"p{peer}r{r}.json.safetensors")) for r in held]
        by_rank = {(x["peer"], x["rank"]): x for x in records}
        layout = PieceLayout(arm if arm in ("fsdp", "pipeline") else "whole", tuple(  # as each rank wrote its piece
            tuple(PieceEntry(e[0], e[1], tuple(e[2]), e[3]) for e in by_rank[(peer, r)]["entries"]) for r in held))
        model = workload.build_model(seed)
        model.load_state_dict(gather(layout, files))
        losses.append(workload.evaluate(model).loss)
    leaders = [r for r in records if r["rank"] == 0]
    return {"arm": arm, "mode": mode, "seed": seed, "val_loss": sum(losses) / len(losses), "peer_losses": losses,
            "samples": sum(r["samples"] for r in leaders), "seconds": max(r["seconds"] for r in leaders),
            "exchanges": sum(r["completed"] for r in leaders) / len(leaders)}


def loss_part(args: argparse.Namespace, out: Path) -> tuple[list[str], dict[str, Any]]:
    """Part ``loss``: every arm at equal samples and at equal time, over seeds; the table's lines and headline."""
    arms = harness.chosen(args.arms, ARMS, "arm")
    seeds = 1 if args.quick else args.seeds
    if args.quick:
        args.steps, args.seconds = min(args.steps, 4), min(args.seconds, 3.0)
    started = time.monotonic()
    runs = []
    modes = harness.chosen(args.modes, MODES, "mode")
    for mode in modes:
        for arm in arms:
            for seed in range(seeds):
                work = out / "runs" / "loss" / f"{arm}-{mode}-seed{seed}"
                work.mkdir(parents=True, exist_ok=True)
                for stale in work.iterdir():
                    stale.unlink()
                runs.append(loss_run(arm, mode, seed, args, work))
                r = runs[-1]
                print(f"model_parallel: {arm} {mode} seed {seed}: val loss {r['val_loss']:.4f}, {r['samples']} samples, "
                      f"{r['seconds']:.1f} s, {r['exchanges']:.0f} exchanges per peer", flush=True)
    harness.write_csv(out / "loss_runs.csv", [{k: v for k, v in r.items() if k != "peer_losses"} for r in runs])
    rows, medians = [], {}
    for mode in modes:
        for arm in arms:
            mine = [r for r in runs if r["arm"] == arm and r["mode"] == mode]
            med = statistics.median(r["val_loss"] for r in mine)
            medians[(arm, mode)] = med
            rows.append([ARM_WORDS[arm], "equal samples" if mode == "samples" else "equal time", f"{med:.4f}",
                         ", ".join(f"{r['val_loss']:.4f}" for r in mine),
                         f"{statistics.median(r['samples'] for r in mine):,.0f}",
                         f"{statistics.median(r['seconds'] for r in mine):.1f}",
                         f"{statistics.median(r['exchanges'] for r in mine):.0f}"])
    ratios = {f"{arm}_vs_ddp_{mode}": round(medians[(arm, mode)] / medians[("ddp", mode)], 4)
              for arm in ("fsdp", "pipeline") for mode in ("samples", "time")
              if (arm, mode) in medians and ("ddp", mode) in medians}
    lines = [
        "## Validation loss: split peers against DDP peers and single workers",
        "",
        f"Part `loss` ({time.monotonic() - started:.0f} s). charlm transformer ({WORKLOAD}), AdamW lr {args.lr:g} "
        f"(weight decay 0.01), every swarm 4 processes on this 2-core machine and {4 * args.batch} windows of 64 bytes "
        f"per round of steps (a rank of FSDP2 or DDP: {args.batch}; a pipeline peer: {2 * args.batch} in 2 "
        f"micro-batches; a single worker: {args.batch}). "
        + "; ".join(({"samples": f"Equal samples: {args.steps} steps per peer",
                      "time": f"equal time: {args.seconds:g} s of training"}[m] for m in modes)) + ". "
        + ("Every arm runs the defaults (`--defaults`): split peers run drift correction, the square-root rule, the "
           "stability guard, flow control and automatic compression per piece, as whole-model peers run them for the "
           "whole model. " if args.defaults else
           "Every arm runs plain averaging (`gossip.lr_scaling=none`, `gossip.drift_gain=0`, `gossip.compression=none`, "
           "`gossip.momentum_mode=local`, `gossip.guard=false`), so that only the layout differs. ")
        + "Validation loss (nats per byte) of each "
        "peer's model after the final phase, gathered from its pieces, averaged over the peers; medians over "
        f"{seeds} seed(s). Exchanges: per peer, those it asked for and applied (a peer also applies those it served).",
        "",
        *harness.markdown_table(["swarm", "at", "val loss", "each seed", "samples", "training s", "exchanges"], rows),
        "",
        "Ratios to DDP (target: FSDP2 and pipeline within 2% at equal samples): "
        + ", ".join(f"{k} {v:.4f}" for k, v in ratios.items()) + ".",
    ]
    return lines, {"val_loss": {f"{a}_{m}": round(v, 4) for (a, m), v in medians.items()}, **ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("memory", "loss", "both"), default="both", help="what to measure (default both)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: one exchange; loss: one seed, few steps")
    parser.add_argument("--exchanges", type=int, default=5, help="memory: exchanges A asks B for (default 5)")
    parser.add_argument("--seeds", type=int, default=3, help="loss: seeds per arm (default 3)")
    parser.add_argument("--steps", type=int, default=150, help="loss: steps per peer at equal samples (default 150)")
    parser.add_argument("--seconds", type=float, default=45.0, help="loss: seconds of training at equal time (default 45)")
    parser.add_argument("--batch", type=int, default=8, help="loss: windows per rank and step (default 8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="loss: AdamW's rate (default 0.001)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"loss: comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="loss: comma-separated, of samples (equal samples), time (equal time) (default both)")
    parser.add_argument("--defaults", action="store_true",
                        help="loss: every arm runs the defaults, not plain averaging (default: plain, only the layout differs)")
    parser.add_argument("--out", type=Path, help="output folder (default experiments/results/model_parallel)")
    parser.add_argument("--rank", nargs=3, metavar=("PEER", "RANK", "PORT"), help=argparse.SUPPRESS)  # a child
    args = parser.parse_args(argv)
    out = harness.results_dir("model_parallel", args.out, args.quick)
    if args.rank:
        rank_main(args.rank[0], int(args.rank[1]), int(args.rank[2]), out, 1 if args.quick else args.exchanges)
        return 0
    given = " ".join(a for a in (argv if argv is not None else sys.argv[1:]) if a)
    lines = ["# Issue 48: split peers (FSDP2, pipeline) against DDP peers and single workers",
             "", f"Command: `python experiments/model_parallel.py {given}`".rstrip() + f" ({time.strftime('%Y-%m-%d')}).", ""]
    headline: dict[str, Any] = {}
    if args.part in ("memory", "both"):
        more, numbers = memory_part(args, out)
        lines += more + [""]
        headline.update(numbers)
    if args.part in ("loss", "both"):
        more, numbers = loss_part(args, out)
        lines += more
        headline.update(numbers)
    return harness.publish(out, lines, headline)


if __name__ == "__main__":
    raise SystemExit(main())
