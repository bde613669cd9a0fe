"""`gossiptrain demo`: a real swarm on this machine, end to end, with a verdict.

A coordinator runs in this process; each peer is its own OS process
(`gossiptrain peer`), exactly as on separate machines, all on 127.0.0.1.
They train the digits MLP until the peers' mean test accuracy reaches the
target (or the time cap passes), then are stopped with SIGTERM, leave
cleanly, and the demo prints one row per peer. Exit status 0 means the
target was reached.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gossiptrain.config import RunConfig
from gossiptrain.runtime.coordinator_process import BackgroundCoordinator
from gossiptrain.train.metrics import read_metrics
from gossiptrain.train.model_spec import workload_spec
from gossiptrain.train.progress import Progress


@dataclass(frozen=True)
class DemoOptions:
    peers: int = 4
    target: float = 0.95  # mean test accuracy of the peers that ends the run
    timeout: float = 180.0  # seconds before giving up
    workdir: Path | None = None  # metrics and logs of each peer (default: a temporary folder)
    config: RunConfig | None = None  # the run (default: digits, exponential topology, pairwise)
    host: str = "127.0.0.1"


def demo_config(peers: int, timeout: float) -> RunConfig:
    """Digits on ``peers`` shards; the step budget is off and a time budget backs up the demo's own stop."""
    return RunConfig().with_overrides(
        {"train.shards": peers, "train.max_steps": 0, "train.max_seconds": timeout + 30, "train.eval_every_seconds": 0.5}
    )


def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the demo and return its summary (``reached`` says whether the target was met)."""
    config = options.config or demo_config(options.peers, options.timeout)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="gossiptrain-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    progress = Progress(out if out.isatty() else sys.stderr)
    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []
    held: list[float] = []
    with BackgroundCoordinator(config, bind=f"{options.host}:0", spec=workload_spec(config)) as coord:
        kept = "" if options.workdir else "; removed at the end unless the demo fails"
        print(f"coordinator at {coord.address}; starting {options.peers} peers (logs and metrics in {workdir}{kept})", file=out)
        try:
            for i in range(options.peers):
                log_file = open(workdir / f"peer-{i}.log", "wb")
                logs.append(log_file)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "gossiptrain", "peer", "--join", coord.address.removeprefix("tcp://"),
                         "--metrics", str(workdir / f"peer-{i}.jsonl"), "--quiet"],
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    )
                )
            failure = _wait_for_target(procs, workdir, options, started, progress)
            # What held: the peers' mean over their last evaluations, read before they are stopped (stopping
            # evaluates once more, mid-step: a model between merges may read a point or so lower).
            held = [h[-1]["test_acc"] for h in (_evals(workdir / f"peer-{i}.jsonl") for i in range(options.peers)) if h]
        finally:
            _stop_all(procs)
            for f in logs:
                f.close()
    progress.finish()
    seconds = time.monotonic() - started
    rows = [_final_record(workdir / f"peer-{i}.jsonl") for i in range(options.peers)]
    accs = [r["test_acc"] for r in rows if r.get("test_acc") is not None]
    final_acc = sum(accs) / len(accs) if accs else 0.0
    reached = failure is None and len(held) == options.peers  # the target held over HOLD_EVALS evaluations
    mean_acc = sum(held) / len(held) if reached else final_acc
    summary = {
        "reached": reached,
        "target": options.target,
        "mean_test_acc": round(mean_acc, 4),
        "final_mean_test_acc": round(final_acc, 4),  # evaluated as the peers were stopped
        "seconds": round(seconds, 2),
        "peers": rows,
        "workdir": str(workdir),
        "failure": failure,
    }
    if options.workdir is None and reached:  # a temporary folder: kept only when there is a failure to read about
        shutil.rmtree(workdir, ignore_errors=True)
        summary["workdir"] = None
    return summary


def _wait_for_target(
    procs: list[subprocess.Popen[bytes]], workdir: Path, options: DemoOptions, started: float, progress: Progress
) -> str | None:
    """Poll the peers' metrics until the mean accuracy reaches the target; return a failure reason or None."""
    while True:
        elapsed = time.monotonic() - started
        for i, p in enumerate(procs):
            if p.poll() is not None:
                tail = (workdir / f"peer-{i}.log").read_text(errors="replace")[-2000:]
                return f"peer {i} exited early with status {p.returncode}:\n{tail}"
        history = [_evals(workdir / f"peer-{i}.jsonl") for i in range(len(procs))]
        reporting = [h for h in history if h]
        if reporting:
            mean = sum(h[-1]["test_acc"] for h in reporting) / len(reporting)
            steps = sum(h[-1]["step"] for h in reporting)
            progress.update(
                f"{elapsed:6.1f} s | peers reporting {len(reporting)}/{len(procs)} | mean test acc {mean:.3f} "
                f"(target {options.target}) | total steps {steps}"
            )
            if len(reporting) == len(procs) and _held(history, options.target):
                return None
        if elapsed > options.timeout:
            return f"mean test accuracy did not reach {options.target} within {options.timeout:.0f} s"
        time.sleep(0.25)


#: The target must hold for the peers' mean over this many consecutive evaluations:
#: one noisy crossing early in training is not convergence.
HOLD_EVALS = 3


def _held(history: list[list[dict[str, Any]]], target: float) -> bool:
    """Whether the mean test accuracy over peers reached ``target`` in each of the last HOLD_EVALS evaluations."""
    if any(len(h) < HOLD_EVALS for h in history):
        return False
    return all(sum(h[-k]["test_acc"] for h in history) / len(history) >= target for k in range(1, HOLD_EVALS + 1))


def _evals(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(path) if r.get("event") in ("eval", "done")]


def _latest_eval(path: Path) -> dict[str, Any] | None:
    records = _evals(path)
    return records[-1] if records else None


def _final_record(path: Path) -> dict[str, Any]:
    records = read_metrics(path)
    done = [r for r in records if r.get("event") == "done"]
    last = done[-1] if done else (_latest_eval(path) or {})
    keys = ("peer", "shard", "test_acc", "f1", "step", "exchanges", "bytes_sent", "members", "elapsed")
    return {k: last.get(k) for k in keys}


def _stop_all(procs: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """SIGTERM everyone (they leave cleanly), then SIGKILL whoever is still there after ``grace``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def format_table(summary: dict[str, Any]) -> str:
    header = f"{'peer':<13}{'shard':>6}{'test acc':>10}{'F1':>8}{'steps':>8}{'exchanges':>11}{'MB sent':>10}"
    lines = [header, "-" * len(header)]
    for r in summary["peers"]:
        acc = f"{r['test_acc']:.4f}" if r.get("test_acc") is not None else "-"
        f1 = f"{r['f1']:.4f}" if r.get("f1") is not None else "-"
        mb = f"{(r.get('bytes_sent') or 0) / 1e6:.1f}"
        lines.append(
            f"{str(r.get('peer')):<13}{str(r.get('shard')):>6}{acc:>10}{f1:>8}{str(r.get('step')):>8}"
            f"{str(r.get('exchanges')):>11}{mb:>10}"
        )
    verdict = "reached" if summary["reached"] else "NOT reached"
    lines.append(
        f"mean test accuracy {summary['mean_test_acc']:.4f} ({verdict}: target {summary['target']}) "
        f"in {summary['seconds']:.1f} s"
    )
    if summary.get("failure"):
        lines.append(f"failure: {summary['failure']}")
    if summary.get("workdir"):
        lines.append(f"curves: gossiptrain plot {summary['workdir']}/peer-*.jsonl --out {summary['workdir']}/run.png")
    else:
        lines.append("curves: run with --workdir DIR to keep the metrics, then gossiptrain plot DIR/peer-*.jsonl --out run.png")
    return "\n".join(lines)


def summary_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, separators=(",", ":"))
