"""Parameter-server baseline: one server process holds the model; workers push gradients and pull parameters.

Over pyzmq (a ROUTER on the server, a DEALER per worker, on 127.0.0.1 with
an OS-picked port). Every message is a msgpack header frame plus at most
one raw float32 frame (the flattened gradient or parameters). Nothing else
is ever decoded: headers are unpacked with small length bounds and no
bin/ext types and checked against a schema, a tensor frame must have
exactly the model's byte size, and a bad message is dropped and counted.
No pickle anywhere.

- ``sync``: each round the server waits for one gradient from every worker,
  averages them and takes one optimizer step (the same update as DDP), then
  sends the new parameters to all workers.
- ``async``: the server applies each gradient as it arrives (one optimizer
  step per gradient, with lr / workers: the same step per sample as the
  sync server) and sends the new parameters back to that worker only.

The server's optimizer is a gossip peer's (SGD, the run's lr and momentum).
Worker i computes its gradient on the shard and batches of gossip peer i;
the straggler sleeps (slowdown - 1) x the compute time of that step
(forward, backward and flattening the gradient) before pushing, as a gossip
peer does. The server evaluates its model every ``--eval-every`` seconds
and writes JSON lines: listening (its address), start, eval (elapsed,
samples, test_acc).

    python -m experiments.baselines.param_server server --mode sync --workers 4 --seed 0 --metrics server.jsonl
    python -m experiments.baselines.param_server worker --index 0 --workers 4 --server tcp://127.0.0.1:PORT --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from experiments.harness import Straggler, build_model, flat_views, run_config, sgd, shard_batches
from gossiptrain.train.metrics import MetricsLog
from gossiptrain.train.workload import load_workload

log = logging.getLogger("param_server")

HELLO, GRAD, PARAMS = "hello", "grad", "params"
#: Header fields by kind; every value is a non-negative int.
SCHEMA: dict[str, tuple[str, ...]] = {HELLO: ("worker",), GRAD: ("worker", "version"), PARAMS: ("version",)}
MAX_HEADER_BYTES = 256
MAX_INDEX = 1 << 20


class BadMessage(Exception):
    """A message that is not this protocol: dropped and counted, never fatal."""


def header(kind: str, **values: int) -> bytes:
    return msgpack.packb({"kind": kind, **values}, use_bin_type=True)


def parse(frames: list[zmq.Frame], nbytes: int) -> tuple[dict[str, Any], memoryview | None]:
    """The validated header and tensor frame (``nbytes`` of float32) of one message."""
    if not 1 <= len(frames) <= 2:
        raise BadMessage(f"{len(frames)} frames")
    raw = frames[0].buffer
    if raw.nbytes > MAX_HEADER_BYTES:
        raise BadMessage("header too long")
    try:
        h = msgpack.unpackb(raw, raw=False, max_str_len=16, max_bin_len=0, max_ext_len=0, max_array_len=0, max_map_len=4)
    except Exception as e:  # msgpack raises many types for bad bytes; all mean a bad message
        raise BadMessage(f"header is not msgpack within bounds: {e}") from None
    if not isinstance(h, dict) or h.get("kind") not in SCHEMA or set(h) != {"kind", *SCHEMA[h["kind"]]}:
        raise BadMessage("header does not match the schema")
    for key in SCHEMA[h["kind"]]:
        if type(h[key]) is not int or not 0 <= h[key] < (1 << 62):
            raise BadMessage(f"{key} is not a non-negative int")
    needs_tensor = h["kind"] in (GRAD, PARAMS)
    if needs_tensor != (len(frames) == 2):
        raise BadMessage("tensor frame missing or unexpected")
    tensor = frames[1].buffer if needs_tensor else None
    if tensor is not None and tensor.nbytes != nbytes:
        raise BadMessage(f"tensor frame has {tensor.nbytes} bytes, expected {nbytes}")
    return h, tensor


def copy_into(dst: torch.Tensor, frame: memoryview) -> None:
    """Copy a float32 frame into ``dst`` (N,) through numpy: received bytes are read-only, never aliased."""
    dst.numpy()[:] = np.frombuffer(frame, dtype=np.float32)


# -- server ------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    cfg = run_config(args.workers, args.seed).train
    workload = load_workload(cfg.workload)
    model = build_model(workload, cfg)
    flat = flat_views(model)  # (N,) the parameters, one buffer
    nbytes = flat.numel() * 4
    grads = [torch.zeros_like(p) for p in model.parameters()]
    flat_grad = torch.cat([g.reshape(-1) for g in grads])  # (N,)
    offset = 0
    for p, g in zip(model.parameters(), grads):
        p.grad = flat_grad[offset : offset + g.numel()].view_as(p)  # gradients live in flat_grad too
        offset += g.numel()
    if args.mode == "async":
        # One step per batch-32 gradient with lr / workers: the same step per sample as the sync
        # server and DDP (lr x the mean of `workers` gradients) and as gossip's mean model (each
        # peer moves lr x its gradient; the mean of the peers moves lr / workers x each).
        # With the full lr, stale gradients and momentum 0.9 make it diverge here.
        cfg = dataclasses.replace(cfg, lr=cfg.lr / args.workers)
    opt = sgd(model.parameters(), cfg)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, nbytes + 4096)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    bad = 0
    with MetricsLog(args.metrics) as metrics:
        metrics.write({"event": "listening", "time": time.time(), "address": f"tcp://127.0.0.1:{port}", "params": flat.numel()})
        identities: dict[int, bytes] = {}
        while len(identities) < args.workers:  # rendezvous: everyone starts from version 0 together
            identity, *frames = sock.recv_multipart(copy=False)
            try:
                h, _ = parse(frames, nbytes)
            except BadMessage:
                bad += 1
                continue
            if h["kind"] == HELLO and h["worker"] < args.workers:
                identities[h["worker"]] = identity.bytes
        started = time.monotonic()
        metrics.write({"event": "start", "time": time.time(), "mode": args.mode, "workers": args.workers})
        version = 0
        applied = 0  # gradients applied (each of one batch)

        def send_params(to: list[bytes]) -> None:
            snapshot = flat.numpy().tobytes()  # one copy per version, shared by every send (zero-copy)
            for ident in to:
                sock.send_multipart([ident, header(PARAMS, version=version), snapshot], copy=False)

        send_params(list(identities.values()))
        next_eval = started + args.eval_every
        pending: set[int] = set()  # sync: workers whose gradient this round is in
        round_sum = torch.zeros_like(flat)
        by_identity = {v: k for k, v in identities.items()}
        while True:
            identity, *frames = sock.recv_multipart(copy=False)
            worker = by_identity.get(identity.bytes)
            try:
                h, tensor = parse(frames, nbytes)
                if h["kind"] != GRAD or worker is None or h["worker"] != worker or tensor is None:
                    raise BadMessage("not a gradient from a known worker")
            except BadMessage as e:
                bad += 1
                log.debug("dropped a message: %s", e)
                continue
            if args.mode == "async":
                copy_into(flat_grad, tensor)
                opt.step()
                version += 1
                applied += 1
                send_params([identity.bytes])
            else:
                if worker in pending:  # one gradient per worker per round
                    bad += 1
                    continue
                copy_into(flat_grad, tensor)
                round_sum.add_(flat_grad)
                pending.add(worker)
                if len(pending) == args.workers:
                    torch.div(round_sum, args.workers, out=flat_grad)  # the mean gradient, as DDP's all-reduce
                    opt.step()
                    version += 1
                    applied += args.workers
                    round_sum.zero_()
                    pending.clear()
                    send_params(list(identities.values()))
            if time.monotonic() >= next_eval:
                result = workload.evaluate(model)
                metrics.write({
                    "event": "eval", "time": time.time(), "elapsed": round(time.monotonic() - started, 4),
                    "version": version, "samples": applied * cfg.batch_size, "test_acc": result.accuracy,
                    "test_loss": result.loss, "dropped": bad,
                })
                next_eval = time.monotonic() + args.eval_every


# -- worker ------------------------------------------------------------------------------


def work(args: argparse.Namespace) -> None:
    cfg = run_config(args.workers, args.seed).train
    workload = load_workload(cfg.workload)
    model = build_model(workload, cfg)
    flat = flat_views(model)  # (N,)
    nbytes = flat.numel() * 4
    params = list(model.parameters())
    flat_grad = torch.empty_like(flat)  # (N,)
    data = shard_batches(workload, cfg, args.index)
    straggler = Straggler(args.slowdown)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, nbytes + 4096)
    sock.connect(args.server)
    sock.send(header(HELLO, worker=args.index))
    while True:
        try:
            h, tensor = parse(sock.recv_multipart(copy=False), nbytes)
        except BadMessage as e:
            log.warning("dropped a message from the server: %s", e)
            continue
        if h["kind"] != PARAMS or tensor is None:
            continue
        copy_into(flat, tensor)  # pull
        began = time.perf_counter()
        x, y = next(data)  # (B, 64), (B,)
        loss = workload.loss(model, x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=flat_grad)  # type: ignore[union-attr]
        straggler.after_step(time.perf_counter() - began)
        # Zero-copy send: flat_grad is next written after the server's reply, so after this has gone out.
        sock.send_multipart([header(GRAD, worker=args.index, version=h["version"]), memoryview(flat_grad.numpy())], copy=False)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--mode", choices=("sync", "async"), required=True)
    s.add_argument("--workers", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--eval-every", type=float, default=0.25)
    s.add_argument("--metrics", type=Path, required=True)
    w = sub.add_parser("worker")
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--workers", type=int, required=True)
    w.add_argument("--server", required=True, help="tcp://127.0.0.1:PORT")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--slowdown", type=float, default=1.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as each gossip peer (--threads 1)
    if args.role == "server":
        serve(args)
    else:
        work(args)


if __name__ == "__main__":
    main()
