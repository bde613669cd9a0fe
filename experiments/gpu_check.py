"""GPU check: two peers gossip a 4.27M-parameter model that lives on CUDA; prints exchange throughput and step time.

A coordinator in this process and two ``Peer``s, each on its own thread
with its own training loop, train ``peers.charlm:large`` (a GRU of 4,266,240
parameters, 17 MB in float32) with Adam on its own shard, the model on
``cuda:0`` and ``cuda:1`` (both on ``cuda:0`` with one GPU). Everything
device-specific is in ``gossiptrain.state.host_buffers``: snapshots go to
pinned host buffers with asynchronous copies, received tensors are moved to
the model's device, merges run there. Per peer it prints the step time
(forward, backward, optimizer, synchronised), the safe point's time
(``peer.step()``: merges applied, the next exchange's snapshot), exchanges
per second (completed + served), MB/s on the wire (sent + received), the
smoothed round trip, and the exchange buffers the peer allocated after
warm-up and at the end (equal: the steady state allocated nothing).

Without CUDA it prints one line saying so and exits with status 2 (0 means
it ran; 1, an error), so that a script running it on every machine can tell
"nothing to check here" from a failure. Results (results.csv, summary.md)
go to experiments/results/gpu_check/ (``--quick``: a scratch folder); the
last line printed is the headline as JSON.

    python experiments/gpu_check.py [--seconds 20] [--compression none|fp16|int8] [--batch 32]
    python experiments/gpu_check.py --quick    # 10 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

NO_CUDA = 2  # exit status where CUDA is absent
WARM_UP = 5.0  # seconds of training before the buffers are counted (the pools fill in the first exchanges)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="training time per peer, warm-up included")
    parser.add_argument("--quick", action="store_true", help="10 seconds (smoke test)")
    parser.add_argument("--out", type=Path, help="results folder (default: experiments/results/gpu_check; --quick: a scratch folder)")
    parser.add_argument("--compression", default="none", help="gossip.compression (none, fp16, int8, auto)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cpu", action="store_true", help="run the same on CPU (to check this script where there is no GPU)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda}): nothing to check")
        return NO_CUDA
    from experiments import harness
    from gossiptrain.config import RunConfig
    from gossiptrain.runtime.coordinator_process import BackgroundCoordinator

    if args.quick:
        args.seconds = 10.0
    out = harness.results_dir("gpu_check", args.out, args.quick)

    config = RunConfig().with_overrides({
        "train.workload": "external", "train.shards": 2, "gossip.compression": args.compression, "state.enabled": False,
    })
    if args.cpu:
        devices, names = [torch.device("cpu")] * 2, "none (--cpu)"
    else:
        count = torch.cuda.device_count()
        devices = [torch.device("cuda", i % count) for i in range(2)]
        names = ", ".join(torch.cuda.get_device_name(d) for d in sorted(set(devices), key=str))
    print(f"gpu_check: GPUs used: {names}; peers on {', '.join(map(str, devices))}; compression {args.compression}", flush=True)
    coordinator = BackgroundCoordinator(config, bind="127.0.0.1:0")
    results: list[dict[str, Any]] = [{} for _ in devices]
    errors: list[BaseException] = []
    try:
        join = coordinator.address.removeprefix("tcp://")
        threads = [
            threading.Thread(target=_guarded, args=(run_peer, errors, i, devices[i], join, args, results[i]), name=f"peer-{i}")
            for i in range(len(devices))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        coordinator.close()
    if errors:
        raise errors[0]
    lines = [
        f"peer {i} on {r['device']}: step {r['step_ms']:.1f} ms, safe point {r['safepoint_ms']:.2f} ms, "
        f"{r['exchanges_per_s']:.1f} exchanges/s, {r['mb_per_s']:.0f} MB/s on the wire, round trip {r['rtt_ms']:.1f} ms, "
        f"exchange buffers {r['buffers_after_warm_up']} after warm-up, {r['buffers_at_end']} at the end"
        for i, r in enumerate(results)
    ]
    print("\n".join(lines), flush=True)
    harness.write_csv(out / "results.csv", [{"peer": i, **r} for i, r in enumerate(results)])
    (out / "summary.md").write_text(
        f"# GPU check: two peers, peers.charlm:large on {', '.join(map(str, devices))}\n\n{names}; compression "
        f"{args.compression}; batch {args.batch}; {args.seconds:g} s per peer, the first {WARM_UP:g} s not counted.\n\n"
        + "".join(f"- {line}\n" for line in lines)
        + f"\nRegenerate: `python experiments/gpu_check.py --seconds {args.seconds:g} --compression {args.compression}`\n"
    )
    print(harness.headline({
        "step_ms": [round(r["step_ms"], 2) for r in results], "exchanges_per_s": [round(r["exchanges_per_s"], 2) for r in results],
        "mb_per_s": [round(r["mb_per_s"], 1) for r in results],
        "buffers_steady": all(r["buffers_after_warm_up"] == r["buffers_at_end"] for r in results),
    }))
    return 0


def _guarded(fn: Any, errors: list[BaseException], *args: Any) -> None:
    try:
        fn(*args)
    except BaseException as e:  # the main thread re-raises it
        errors.append(e)


def run_peer(index: int, device: torch.device, join: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """One peer's training loop: ``args.seconds`` of Adam steps on its shard, ``peer.step()`` after each."""
    from gossiptrain.runtime.peer import Peer
    from gossiptrain.state.host_buffers import synchronize
    from gossiptrain.train.workload import batches
    from peers.charlm import large

    workload = large()
    model = workload.build_model(0).to(device)  # the same start on both peers
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    inputs, targets = workload.train_shard(index, 2, 0)
    data = batches(inputs, targets, args.batch, index)
    with Peer(model, join=join, bind="127.0.0.1:0", shard=index, transfer_state=False, seed=index) as peer:
        peer.wait_for_peers(2, timeout=60)
        steps: list[float] = []
        safepoints: list[float] = []
        began = time.monotonic()
        warm: dict[str, Any] | None = None
        warm_at = began
        while time.monotonic() - began < args.seconds:
            x, y = (t.to(device, non_blocking=True) for t in next(data))
            t0 = time.perf_counter()
            optimizer.zero_grad()
            workload.loss(model, x, y).backward()
            optimizer.step()
            synchronize(device)  # the step's kernels are done: its time, not its launch
            t1 = time.perf_counter()
            peer.step()
            t2 = time.perf_counter()
            if warm is None and time.monotonic() - began >= WARM_UP:
                warm, warm_at = peer.stats(), time.monotonic()
            elif warm is not None:
                steps.append(t1 - t0)
                safepoints.append(t2 - t1)
        end, elapsed = peer.stats(), time.monotonic() - warm_at
    if warm is None or not steps:
        raise RuntimeError(f"peer {index}: --seconds {args.seconds} leaves no time after the {WARM_UP} s warm-up")
    exchanges = (end["completed"] + end["served"]) - (warm["completed"] + warm["served"])
    wire = (end["bytes_sent"] + end["bytes_received"]) - (warm["bytes_sent"] + warm["bytes_received"])
    out.update({
        "device": str(device), "steps": len(steps), "step_ms": 1000 * statistics.median(steps),
        "safepoint_ms": 1000 * statistics.median(safepoints), "exchanges_per_s": exchanges / elapsed,
        "mb_per_s": wire / elapsed / 1e6, "rtt_ms": end["rtt_ms"], "buffers_after_warm_up": warm["buffers"],
        "buffers_at_end": end["buffers"], "timeouts": end["timeouts"], "rejected": end["rejected"],
    })


if __name__ == "__main__":
    sys.exit(main())
