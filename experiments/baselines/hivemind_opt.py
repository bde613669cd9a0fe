"""hivemind baseline (optional): `hivemind.Optimizer` with local updates and parameter averaging, on 127.0.0.1.

Needs the `hivemind` extra (``pip install -e '.[hivemind]'``); nothing here
imports hivemind until a worker runs, so the module itself imports without it
and ``unavailable()`` says why it cannot run.

Worker i trains the shard, batches, model initialisation, lr, momentum and
batch size of gossip peer i (experiments/harness.py). Each worker is one
process with its own `hivemind.DHT` (and so its own p2pd daemon): worker 0
starts the DHT and writes its multiaddr to its metrics file, the others join
with it as their initial peer; every DHT listens only on
/ip4/127.0.0.1/tcp/0 (the OS picks the port) with NAT port mapping, AutoNAT
and relays off, so no packet leaves loopback. Workers wait on a DHT key
until all have built their optimizer, then start together.

``hivemind.Optimizer(use_local_updates=True)`` wraps the gossip peer's SGD:
every ``step()`` applies the worker's own gradient at once (as a gossip peer
does), reports progress to the DHT, and whenever the swarm has together
processed ``target_batch_size`` samples (an "epoch") the peers meet
(``matchmaking_time``), all-reduce their parameters in the background
(``delay_state_averaging``, with hivemind's delta rule, so local steps taken
meanwhile are kept) and go on; a round that takes longer than
``averaging_timeout`` is abandoned. A peer that falls an epoch behind
downloads the state of another (``load_state_from_peers``). Only parameters
are averaged, not momentum, as in gossip.

Straggler injection as everywhere: the slowed worker sleeps (slowdown - 1)
x the compute time of each step, compute being the forward and backward
pass plus the inner SGD step (timed inside the wrapped optimizer, so
hivemind's DHT reports and averaging are not counted, as a gossip peer's
exchanges are not). Every worker evaluates its own model every EVAL_EVERY
seconds and writes JSON lines like a gossip peer (start, eval, done, with
step and test_acc), so the swarm's accuracy is the peers' mean, read by
``harness.gossip_series`` exactly as for gossip.

Settings, tuned for this 4-peer swarm on loopback (2 shared cores; gossip
and DDP reach 0.96 in 12,000-21,000 samples, 3-11 s, so averaging has to
happen every second or two to matter). Each tried with 4 workers, worker 0
4x slower, target 0.96 held for 3 evaluations, seeds 0 and 1 (and 2 for the
closest), via ``python -m experiments.baselines.hivemind_opt swarm --seed S
--timeout 90 --min-seconds 5 --target-batch-size ...``; times to target (s)
from the start of training; averaging rounds per peer from hivemind's log
lines, counted to the end of the run (at least 5 s of training):

| | target_batch_size | matchmaking_time | averaging_timeout | request_timeout | average_state_every | seeds 0, 1, 2 | rounds / peer (seed 0) |
| --- | --- | --- | --- | --- | --- | --- | --- |
| A | 2048 | 1.0 | 5 | 0.5 | 1 | 19.96, 57.45 | 15.5 ok, 0 failed |
| B | 1024 | 0.5 | 2 | 0.25 | 1 | 43.22, 28.38 | 54.8 ok, 0.2 failed |
| **C** | **4096** | **1.0** | **3** | **0.5** | **1** | **13.20, 20.90, 5.58** | 4.8 ok, 0 failed |
| D | 2048 | 0.5 | 2 | 0.25 | 1 | 17.91, 25.24 | 13.2 ok, 0.5 failed |
| E | 8192 | 0.5 | 3 | 0.25 | 1 | 29.08, 27.96 | 5.8 ok, 2.2 failed |
| F | 4096 | 0.5 | 2 | 0.25 | 1 | 19.75, 14.75 | 6.0 ok, 3.2 failed |
| G | 16384 | 0.5 | 3 | 0.25 | 1 | 41.64, 34.72 | 3.8 ok, 3.8 failed |
| H | 1024 | 0.5 | 2 | 0.25 | 4 | 17.11, 18.55, 14.70 | 2.2 ok, 1.2 failed |
| I | 3072 | 0.75 | 3 | 0.35 | 1 | 17.43, 18.40, 24.46 | 9.5 ok, 0.2 failed |

(min_refresh_period 0.5 s, hivemind's default, in all; request_timeout is
hivemind's matchmaking request timeout, default 3 s, which it warns should
be below matchmaking_time.) What decides it, from hivemind's logs:

- Local steps wait for averaging. With ``use_local_updates`` hivemind
  1.1.12 averages with its delta rule, and every local step first waits for
  a pending background averaging round to finish ("Waiting for delayed
  updates to finish..."), so each round stops every peer for about
  matchmaking_time plus the all-reduce (0.5-1.5 s here).
- Epochs run away when target_batch_size is small. The swarm's progress is
  extrapolated from each peer's last report at its samples per second;
  while peers wait for a round nobody reports, the estimate passes the
  target, and the next epoch (and round) starts as soon as the last one
  ends. With 2048 (A, D) or 1024 (B) samples per epoch the swarm did
  30-58 rounds and a few hundred real samples per epoch (A seed 1: 47
  epochs for 14,000 samples, 173 samples/s).
- Rare averaging costs samples. The peers' mean accuracy reaches 0.96 only
  once their models have been averaged a few times (each shard is a
  quarter of digits' training set): with 8192 or 16384 (E, G) the swarm
  ran at 2,100-2,700 samples/s but needed 60,000-108,000 samples.
- A short matchmaking_time (0.5 s) formed smaller groups and failed more
  rounds (E, F, G), each failure holding the peers for up to
  averaging_timeout.

Kept: C, the lowest median (13.2 s) with no failed rounds and groups of 3-4
peers; F, H and I were within the noise of it on seeds 0 and 1 (17-18 s on
average against C's 17.1 s), and single runs on this shared machine move by
tens of percent. Setup (four DHTs and optimizers and the rendezvous, 13-30 s
here) is not counted, as for the other systems.

The processes: each worker starts a process group of its own (its DHT and
averager processes and its p2pd daemon are in it); at the end the harness
sends SIGTERM to each worker (it shuts its optimizer and DHT down), waits
STOP_GRACE seconds, then SIGKILLs whatever is left in each group and removes
the p2pd Unix sockets those daemons had. Workers also stop by themselves
after ``--max-seconds`` of training, give up on a rendezvous after
``--setup-timeout`` seconds, and kill their own group (sockets removed) if
the process that started them dies.

    python -m experiments.baselines.hivemind_opt swarm --workers 4 --slowdown 4 --seed 0 --target 0.96
    python -m experiments.baselines.hivemind_opt worker --index 0 --workers 4 --seed 0 --metrics w0.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from experiments.harness import (  # noqa: E402
    EVAL_EVERY,
    STOP_GRACE,
    Point,
    Procs,
    Run,
    Straggler,
    build_model,
    fresh_dir,
    gossip_series,
    poll_run,
    python_m,
    run_config,
    shard_batches,
    slowdown_of,
)
from gossiptrain.train.metrics import MetricsLog, read_metrics  # noqa: E402
from gossiptrain.train.workload import load_workload  # noqa: E402

SYSTEM = "hivemind"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
SETUP_TIMEOUT = 120.0  # seconds a worker waits for the others to be ready before it gives up


@dataclasses.dataclass(frozen=True)
class Settings:
    """The hivemind.Optimizer knobs this baseline exposes (the rest are hivemind's defaults)."""

    target_batch_size: int = 4096  # samples, all peers together, per epoch (one averaging round)
    matchmaking_time: float = 1.0  # seconds peers wait to form a group
    averaging_timeout: float = 3.0  # seconds before an averaging round is abandoned
    average_state_every: int = 1  # epochs between averaging rounds
    min_refresh_period: float = 0.5  # seconds between a peer's looks at the swarm's progress (ProgressTracker)
    request_timeout: float = 0.5  # seconds a matchmaking request waits (hivemind: keep it below matchmaking_time)

    def argv(self) -> list[str]:
        return [a for f in dataclasses.fields(self) for a in (f"--{f.name.replace('_', '-')}", str(getattr(self, f.name)))]

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


DEFAULT = Settings()


def unavailable() -> str | None:
    """None if hivemind imports here; otherwise one line saying why not."""
    try:
        import hivemind
    except Exception as e:  # ImportError, or a broken install (its protobuf modules, p2pd)
        return f"hivemind does not import here ({type(e).__name__}: {e}); install the extra: pip install -e '.[hivemind]'"
    return None if hasattr(hivemind, "Optimizer") else "hivemind imports but has no hivemind.Optimizer (version too old)"


# -- worker ------------------------------------------------------------------------------


class _Counts(logging.Handler):
    """Counts hivemind's own status lines (logged at INFO with verbose=True) about averaging and catching up."""

    PATTERNS = {
        "averaged": re.compile(r"Averaged parameters with (\d+) peers"),
        "averaging_failed": re.compile(r"Averaging failed"),
        "out_of_sync": re.compile(r"Peer is out of sync"),
    }

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts = {k: 0 for k in self.PATTERNS}
        self.group_sizes: list[int] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for key, pattern in self.PATTERNS.items():
            found = pattern.search(message)
            if found:
                with self._lock:
                    self.counts[key] += 1
                    if key == "averaged":
                        self.group_sizes.append(int(found.group(1)))


def _watch_parent() -> None:
    """If the process that started this worker dies, take this worker's whole process group down with it.

    The harness starts each worker in a process group of its own (so that its
    hivemind processes and p2pd can be killed together); such a group would
    outlive a harness killed with SIGKILL, or a test that kills the
    harness's group. Polls twice a second, from a daemon thread.
    """
    parent = os.getppid()
    leader = os.getpgrp() == os.getpid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        if leader:
            for path in _p2pd_sockets(os.getpgrp()):
                Path(path).unlink(missing_ok=True)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def work(args: argparse.Namespace) -> None:
    _watch_parent()
    import hivemind
    from hivemind.utils import get_dht_time

    settings = Settings.from_args(args)
    stop = threading.Event()
    training = threading.Event()

    def on_sigterm(*_: Any) -> None:
        stop.set()  # training: finish the step, write "done", shut hivemind down
        if not training.is_set():
            raise SystemExit(143)  # still setting up (inside hivemind, perhaps): leave now

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(1)  # as each gossip peer (--threads 1)

    cfg = run_config(args.workers, args.seed).train
    workload = load_workload(cfg.workload)
    model = build_model(workload, cfg)
    data = shard_batches(workload, cfg, args.index)
    straggler = Straggler(args.slowdown)
    run_id = f"gossiptrain-{cfg.workload}-seed{args.seed}"

    inner_seconds = [0.0]

    class TimedSGD(torch.optim.SGD):
        """The gossip peer's SGD; records how long its step took (the local update is compute, averaging is not)."""

        def step(self, closure: Any = None) -> Any:
            began = time.perf_counter()
            out = super().step(closure)
            inner_seconds[0] += time.perf_counter() - began
            return out

    counts = _Counts()
    for name in ("hivemind.optim.state_averager", "hivemind.optim.optimizer"):
        logging.getLogger(name).addHandler(counts)

    dht = hivemind.DHT(
        start=True, initial_peers=args.initial_peers or None, host_maddrs=[LOOPBACK],
        nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False, use_ipfs=False,
    )
    opt = None
    with MetricsLog(args.metrics) as metrics:
        try:
            maddrs = [str(m) for m in dht.get_visible_maddrs()]
            metrics.write({"event": "listening", "time": time.time(), "index": args.index, "maddrs": maddrs})
            opt = hivemind.Optimizer(
                dht=dht, run_id=run_id, batch_size_per_step=cfg.batch_size,
                target_batch_size=settings.target_batch_size,
                params=model.parameters(),
                optimizer=lambda params: TimedSGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay),
                use_local_updates=True,
                matchmaking_time=settings.matchmaking_time,
                averaging_timeout=settings.averaging_timeout,
                average_state_every=settings.average_state_every,
                tracker_opts={"min_refresh_period": settings.min_refresh_period},
                averager_opts={"request_timeout": settings.request_timeout},
                load_state_timeout=30.0,
                verbose=True,
            )
            # Rendezvous, as DDP's and the parameter server's: nobody trains alone.
            ready_key = f"{run_id}_ready"
            dht.store(ready_key, subkey=args.index, value=True, expiration_time=get_dht_time() + 3600)
            deadline = time.monotonic() + args.setup_timeout
            while not stop.is_set():
                found = dht.get(ready_key, latest=True)
                if found is not None and isinstance(found.value, dict) and len(found.value) >= args.workers:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker {args.index}: the other workers were not ready within {args.setup_timeout} s")
                time.sleep(0.05)

            step = 0
            computed = 0.0

            def record(event: str) -> None:
                result = workload.evaluate(model)
                metrics.write({
                    "event": event, "time": time.time(), "elapsed": round(time.monotonic() - started, 4), "shard": args.index,
                    "step": step, "test_acc": result.accuracy, "test_loss": result.loss, "epoch": opt.local_epoch,
                    "global_epoch": opt.tracker.global_epoch, "compute_ms": round(1e3 * computed / max(1, step), 3),
                    **counts.counts, "group_size_mean": round(statistics.mean(counts.group_sizes), 2) if counts.group_sizes else None,
                })

            training.set()
            started = time.monotonic()
            metrics.write({"event": "start", "time": time.time(), "shard": args.index, "step": 0})
            next_eval = started + args.eval_every
            while not stop.is_set() and time.monotonic() - started < args.max_seconds:
                began = time.perf_counter()
                x, y = next(data)  # (B, 64), (B,)
                loss = workload.loss(model, x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                loss.item()
                forward_backward = time.perf_counter() - began
                inner_seconds[0] = 0.0
                opt.step()  # local SGD step; progress report; averaging rounds in the background
                compute = forward_backward + inner_seconds[0]
                straggler.after_step(compute)
                computed += compute
                step += 1
                if time.monotonic() >= next_eval:
                    record("eval")
                    next_eval = time.monotonic() + args.eval_every
            record("done")
        finally:
            if opt is not None:
                opt.shutdown()
            dht.shutdown()


# -- the swarm ---------------------------------------------------------------------------


class GroupProcs(Procs):
    """Procs whose children each lead a process group: the hivemind processes and p2pd a worker starts die with it."""

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=harness.child_env(), cwd=ROOT, start_new_session=True,
            )
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        sockets = [s for _, p in self.procs for s in _p2pd_sockets(p.pid)]
        super().stop()  # SIGTERM to each worker (it shuts hivemind down), SIGKILL after STOP_GRACE
        for _, p in self.procs:
            _kill_group(p.pid)  # whatever a worker left behind: its DHT and averager processes, p2pd
        for path in sockets:
            Path(path).unlink(missing_ok=True)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def _p2pd_sockets(pgid: int) -> list[str]:
    """The Unix sockets of the p2pd daemons in process group ``pgid`` (hivemind leaves them in /tmp when killed)."""
    out = []
    for pid in _group_members(pgid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for a in argv:
            found = re.fullmatch(rb"-listen=/unix(/tmp/hivemind-[\w-]+\.sock)", a)
            if found:
                out.append(found.group(1).decode())
    return out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + STOP_GRACE
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def run_hivemind(
    workers: int, seed: int, slowdown: float, target: float, timeout: float, workdir: Path, *, min_seconds: float = 0.0,
    settings: Settings = DEFAULT, setup_timeout: float = SETUP_TIMEOUT,
) -> Run:
    """``workers`` hivemind worker processes (worker i on shard i), until the peers' mean accuracy holds the target."""
    fresh_dir(workdir)
    cfg = run_config(workers, seed).train
    began = time.time()
    metrics = [workdir / f"worker-{i}.jsonl" for i in range(workers)]

    def worker_args(i: int, initial: list[str]) -> list[str]:
        return python_m(
            "experiments.baselines.hivemind_opt", "worker", "--index", i, "--workers", workers, "--seed", seed,
            "--slowdown", slowdown_of(i, slowdown), "--metrics", metrics[i], "--max-seconds", timeout + 30,
            "--setup-timeout", setup_timeout, *settings.argv(), *[a for m in initial for a in ("--initial-peers", m)],
        )

    with GroupProcs(workdir) as procs:
        procs.start("worker-0", worker_args(0, []))
        deadline = time.monotonic() + setup_timeout
        while not (maddrs := next((r["maddrs"] for r in read_metrics(metrics[0]) if r.get("event") == "listening"), None)):
            problem = procs.failed()
            if problem or time.monotonic() > deadline:
                raise RuntimeError(problem or f"hivemind worker 0 did not start its DHT within {setup_timeout} s; see {workdir}")
            time.sleep(harness.POLL)
        for i in range(1, workers):
            procs.start(f"worker-{i}", worker_args(i, maddrs))

        def read() -> list[Point]:
            return gossip_series([read_metrics(m) for m in metrics], cfg.batch_size)[0]

        def started() -> bool:
            return all(any(r.get("event") == "start" for r in read_metrics(m)) for m in metrics)

        while not started():  # the rendezvous is setup, not training time
            problem = procs.failed()
            if problem or time.monotonic() > deadline:
                raise RuntimeError(problem or f"hivemind workers did not all start within {setup_timeout} s; see {workdir}")
            time.sleep(harness.POLL)
        points = poll_run(procs, read, target, timeout, min_seconds=min_seconds)
    per_peer = [read_metrics(m) for m in metrics]
    _, t0 = gossip_series(per_peer, cfg.batch_size)
    last = [next((r for r in reversed(recs) if r.get("event") in ("eval", "done")), {}) for recs in per_peer]
    sizes = [r["group_size_mean"] for r in last if r.get("group_size_mean")]
    extra = {
        "steps": [r.get("step", 0) for r in last],
        "epochs": [r.get("epoch") for r in last],
        "averaged_per_peer": statistics.mean(r.get("averaged", 0) for r in last),
        "averaging_failed_per_peer": statistics.mean(r.get("averaging_failed", 0) for r in last),
        "out_of_sync_per_peer": statistics.mean(r.get("out_of_sync", 0) for r in last),
        "group_size_mean": round(statistics.mean(sizes), 2) if sizes else None,
        "compute_ms_worker0": last[harness.STRAGGLER].get("compute_ms") if last else None,
        "settings": dataclasses.asdict(settings),
    }
    return Run(SYSTEM, seed, slowdown, points, target, setup_seconds=(t0 or began) - began, extra=extra)


def swarm(args: argparse.Namespace) -> None:
    """Run one swarm and print what the tuning table records."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the workers (Procs.__exit__) on SIGTERM too
    settings = Settings.from_args(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hivemind-swarm-"))
    run = run_hivemind(args.workers, args.seed, args.slowdown, args.target, args.timeout, workdir, settings=settings,
                       min_seconds=args.min_seconds)
    ttt = run.time_to_target
    print(
        f"{settings}: time to {args.target} {'not reached' if ttt is None else f'{ttt:.2f} s'}, "
        f"samples {run.samples_to_target}, {run.throughput:.0f} samples/s, final acc {run.final_acc:.3f}, "
        f"steps {run.extra['steps']}, epochs {run.extra['epochs']}, averaged/peer {run.extra['averaged_per_peer']:.1f}, "
        f"failed/peer {run.extra['averaging_failed_per_peer']:.1f}, out-of-sync/peer {run.extra['out_of_sync_per_peer']:.1f}, "
        f"group {run.extra['group_size_mean']}, setup {run.setup_seconds:.1f} s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    w = sub.add_parser("worker", help="one worker process (started by the harness)")
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--workers", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--slowdown", type=float, default=1.0)
    w.add_argument("--metrics", type=Path, required=True)
    w.add_argument("--initial-peers", action="append", default=[], help="worker 0's multiaddr (the others join through it)")
    w.add_argument("--eval-every", type=float, default=EVAL_EVERY)
    w.add_argument("--max-seconds", type=float, default=150.0, help="stop after this much training")
    w.add_argument("--setup-timeout", type=float, default=SETUP_TIMEOUT)
    Settings.add_arguments(w)
    s = sub.add_parser("swarm", help="run a whole swarm once and print its time to target (for tuning)")
    s.add_argument("--workers", type=int, default=4)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--slowdown", type=float, default=4.0)
    s.add_argument("--target", type=float, default=0.96)
    s.add_argument("--timeout", type=float, default=120.0)
    s.add_argument("--min-seconds", type=float, default=0.0)
    s.add_argument("--workdir", type=Path, help="logs and metrics (default: a new temporary folder)")
    Settings.add_arguments(s)
    args = p.parse_args(argv)
    if args.role == "worker":
        work(args)
    else:
        swarm(args)


if __name__ == "__main__":
    main()
