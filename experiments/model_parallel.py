"""Issue 48, first measurements: what a rank of a split peer holds and sends, against a single-worker peer.

Two peers of 2 ranks each hold the charlm transformer (``peers.charlm:transformer``,
4,115,008 parameters in 114 tensors) split by FSDP2 (``fully_shard`` on every
layer and the root; gloo on CPU), train a few AdamW steps on their own
text and average their pieces rank by rank over each rank's own socket
(``gossiptrain.runtime.split_group``). Each rank measures, from the
tensors it holds (storage bytes, not shapes): its parameters plus its
optimizer's state, and the bytes its socket sent per exchange. The
single-worker peer is measured the same way in this process: the unsplit
model after the same AdamW steps, and an exchange's model bytes.

Not yet here (issue 48's experiment asks for them): the pipeline and DDP
peers, 4 peers of 1 rank, and validation loss at equal samples and time;
they need a split peer that joins a swarm (``Peer``), which is not built.

    python experiments/model_parallel.py [--quick] [--exchanges N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
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
        group.safe_point(partner if partner is not None and group.stats.committed < exchanges else None)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one exchange (a smoke test)")
    parser.add_argument("--exchanges", type=int, default=5, help="exchanges A asks B for (default 5)")
    parser.add_argument("--out", type=Path, help="output folder (default experiments/results/model_parallel)")
    parser.add_argument("--rank", nargs=3, metavar=("PEER", "RANK", "PORT"), help=argparse.SUPPRESS)  # a child
    args = parser.parse_args(argv)
    out = harness.results_dir("model_parallel", args.out, args.quick)
    exchanges = 1 if args.quick else args.exchanges
    if args.rank:
        rank_main(args.rank[0], int(args.rank[1]), int(args.rank[2]), out, exchanges)
        return 0
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
    command = "python experiments/model_parallel.py" + (" --quick" if args.quick else f" --exchanges {exchanges}")
    lines = [
        "# Issue 48: what a rank of a split peer holds and sends, against a single-worker peer",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {time.monotonic() - started:.0f} s).",
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
    return harness.publish(out, lines, {"held_ratio_max": round(worst_held, 3), "sent_ratio_max": round(worst_sent, 3),
                                "exchanges": exchanges})


if __name__ == "__main__":
    raise SystemExit(main())
