"""One lying member beside an honest swarm, against the same swarm with the same member idle (issue 17).

N honest `gossiptrain peer` processes train digits (iid shards, one torch
thread each, a common start with `--wait-for N`) with a coordinator on
127.0.0.x, as the other experiments run them (experiments/harness.py).
Before they start, one more member joins (``experiments/lying_member.py``):
it never trains and, every 0.5 s, sends every member it knows one attack:

- ``idle``: nothing (the baseline: the same swarm with the same member);
- ``made-up``: 2,000 made-up members at closed loopback ports, rising incarnations;
- ``hijack``: each honest member's id at the liar's own address, incarnation + 10^12;
- ``deaths``: each honest member declared dead, at its incarnation and at + 10^12;
- ``all``: the three at once;
- ``conn-flood``: 1,000 idle TCP connections held open to each member and the coordinator;
- ``join-flood``: 500 joins a round to the coordinator and each member, each from another claimed address;
- ``report-flood``: 500 reports a round to the coordinator under made-up ids at honest members' addresses;
- ``poison``: it averages like a peer (never trains), every model it sends scaled by 100; the swarm runs
  ``gossip.robust`` (the defence), and the baseline is the same robust swarm with the member idle (``idle-robust``).

Measured per run: the honest peers' time to a held mean test accuracy (the
harness's rule: 3 evaluations in a row), their exchanges per peer, the
largest view any honest peer reported (its ``members`` field: the real
members are N + 1), and the peak open file descriptors and resident memory
of any honest peer (sampled from /proc while it trains). The ratio is each
attack's time over the idle baseline's, medians over ``--seeds``.

Each in an open swarm and in a secure one (``--swarms``), where every
process has its own CURVE key and the liar is an admitted member gone
rogue (SECURITY.md): what it can send is the same, but ids are bound to
keys and joins must carry one. CSV and summary.md under
experiments/results/hostile/; the last line is JSON with the worst time
ratio, the largest honest view, and the peak descriptors and RSS.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from experiments.harness import (  # noqa: E402
    Point,
    Procs,
    fmt,
    fresh_dir,
    gossip_series,
    markdown_table,
    poll_run,
    publish,
    python_m,
    run_overrides,
    start_coordinator,
    time_to_target,
    write_csv,
)
from gossiptrain.train.metrics import read_metrics  # noqa: E402


def show(x: float | None, digits: int = 2) -> str:
    """A number for the tables: "-" where a run had none (a missed target)."""
    return "-" if x is None else fmt(x, digits)


ATTACKS = {
    "idle": "", "made-up": "made-up", "hijack": "hijack", "deaths": "deaths", "all": "made-up,hijack,deaths",
    "conn-flood": "conn-flood", "join-flood": "join-flood", "report-flood": "report-flood",
    "idle-robust": "", "poison": "poison",
}
#: Attacks run with ``gossip.robust`` on (the defence against poisoned models), and the baseline each is judged by.
ROBUST = {"idle-robust", "poison"}
BASELINE = {"poison": "idle-robust"}


def _proc_sample(pid: int) -> tuple[int, float]:
    """(open descriptors, resident MB) of a process, (0, 0) once it is gone."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
        return fds, rss
    except (OSError, AttributeError):
        return 0, 0.0


def _keys(workdir: Path, names: list[str]) -> dict[str, list[str]]:
    """A secure swarm's keys: a keypair per process, all public keys allowed; each one's --secure flags."""
    from gossiptrain.cli.main import main as cli

    keys, allow = workdir / "keys", workdir / "allow"
    allow.mkdir(parents=True)
    for name in names:
        if cli(["keys", "new", str(keys), "--name", name]) != 0:
            raise RuntimeError(f"gossiptrain keys new {keys} --name {name} failed")
        shutil.copy(keys / f"{name}.key", allow)
    return {name: ["--secure", "--key", str(keys / f"{name}.key_secret"), "--allow", str(allow)] for name in names}


def run_attack(attack: str, seed: int, args: argparse.Namespace, workdir: Path, swarm: str = "open") -> dict[str, Any]:
    fresh_dir(workdir)
    n = args.peers
    overrides = run_overrides(n, seed, max_seconds=args.timeout + 30)
    if attack in ROBUST:
        overrides["gossip.robust"] = "true"
    peak = {"fds": 0, "rss_mb": 0.0}
    flags: dict[str, list[str]] = {}
    if swarm == "secure":  # the liar is an admitted member with a key of its own
        flags = _keys(workdir, ["coordinator", "liar", *(f"peer-{i}" for i in range(n))])
    with Procs(workdir) as procs:
        join = start_coordinator(procs, overrides, extra=flags.get("coordinator", ()))
        lies = ATTACKS[attack] or "none"
        liar = procs.start("liar", python_m(
            "experiments.lying_member", "--join", join, "--bind", "127.0.0.250:0", "--lies", lies,
            "--seconds", args.timeout + 120, *(a for a in flags.get("liar", []) if a != "--secure"),
        ))
        deadline = time.monotonic() + 120
        while "lying" not in (workdir / "liar.log").read_text(errors="replace"):
            if liar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the liar did not start; see {workdir / 'liar.log'}")
            time.sleep(0.1)
        honest = [
            procs.start(f"peer-{i}", python_m(
                "gossiptrain", "peer", "--join", join, "--bind", f"127.0.0.{10 + i}:0", "--quiet", "--threads", 1,
                "--shard", i, "--wait-for", n, "--metrics", workdir / f"peer-{i}.jsonl", *flags.get(f"peer-{i}", []),
            ))
            for i in range(n)
        ]

        def read() -> list[Point]:
            for p in honest:
                fds, rss = _proc_sample(p.pid)
                peak["fds"], peak["rss_mb"] = max(peak["fds"], fds), max(peak["rss_mb"], rss)
            return gossip_series([read_metrics(workdir / f"peer-{i}.jsonl") for i in range(n)], 32)[0]

        points = poll_run(procs, read, args.target, args.timeout)
    per_peer = [read_metrics(workdir / f"peer-{i}.jsonl") for i in range(n)]
    last = [next((r for r in reversed(recs) if r.get("event") in ("eval", "done")), {}) for recs in per_peer]
    views = [r["members"] for recs in per_peer for r in recs if "members" in r]
    return {
        "swarm": swarm,
        "attack": attack,
        "seed": seed,
        "time_to_target_s": time_to_target(points, args.target),
        "final_acc": round(points[-1].acc, 4) if points else None,
        "exchanges_per_peer": round(statistics.mean(r.get("exchanges", 0) for r in last), 1),
        "gossip_refused_per_peer": round(statistics.mean(r.get("gossip_refused", 0) for r in last), 1),
        "members_dead_max": max((r.get("members_dead", 0) for r in last), default=0),
        "largest_view": max(views, default=0),
        "peak_fds": peak["fds"],
        "peak_rss_mb": round(peak["rss_mb"], 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=4, help="honest peers (default 4)")
    ap.add_argument("--attacks", nargs="+", default=None, choices=list(ATTACKS), help="default: all but poison")
    ap.add_argument("--seeds", type=int, default=3)
    # 0.95, not the 0.97: at 0.97 the idle baseline itself took 17-52 s or missed (a plateau near it), so
    # ratios over it measured noise.
    ap.add_argument("--target", type=float, default=0.95, help="held mean test accuracy (default 0.95)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds of training before a run gives up")
    ap.add_argument("--swarms", nargs="+", default=["open", "secure"], choices=["open", "secure"])
    ap.add_argument("--quick", action="store_true", help="1 seed, idle and all only, 30 s: a smoke test")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.chosen = args.attacks  # as asked, for the command line in the summary
    if args.attacks is None:  # poison needs robust mode and baselines of its own: its own run (--attacks poison)
        args.attacks = [a for a in ATTACKS if a not in ROBUST]
    if args.quick:
        args.seeds, args.attacks, args.timeout, args.target = 1, ["idle", "all"], 30.0, 0.9
    if "idle" not in args.attacks:
        args.attacks = ["idle", *args.attacks]
    if "poison" in args.attacks and "idle-robust" not in args.attacks:
        args.attacks.insert(args.attacks.index("poison"), "idle-robust")
    out = harness.results_dir("hostile", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for swarm in args.swarms:
        for seed in range(args.seeds):
            for attack in args.attacks:
                row = run_attack(attack, seed, args, out / "runs" / f"{swarm}-{attack}-{seed}", swarm)
                print(f"{swarm} seed {seed} {attack:12s} time {show(row['time_to_target_s'])} s, view {row['largest_view']}, "
                      f"fds {row['peak_fds']}, refused {row['gossip_refused_per_peer']}", flush=True)
                rows.append(row)
    write_csv(out / "hostile.csv", rows)

    def of(swarm: str, attack: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["swarm"] == swarm and r["attack"] == attack]

    def median(swarm: str, attack: str, key: str) -> float | None:
        values = [r[key] for r in of(swarm, attack) if r[key] is not None]
        return statistics.median(values) if values else None

    table, ratios = [], []
    for swarm in args.swarms:
        for attack in args.attacks:
            base = median(swarm, BASELINE.get(attack, "idle"), "time_to_target_s")
            t = median(swarm, attack, "time_to_target_s")
            missed = sum(1 for r in of(swarm, attack) if r["time_to_target_s"] is None)
            ratio = t / base if t is not None and base else None
            if attack not in ("idle", "idle-robust"):
                ratios.append(ratio if ratio is not None and not missed else float("inf"))
            table.append([
                swarm, attack, show(t), show(ratio), f"{missed}/{args.seeds}", show(median(swarm, attack, "exchanges_per_peer"), 1),
                max(r["largest_view"] for r in of(swarm, attack)),
                max(r["peak_fds"] for r in of(swarm, attack)),
                show(max(r["peak_rss_mb"] for r in of(swarm, attack)), 0),
                max(r["members_dead_max"] for r in of(swarm, attack)),
            ])
    chosen = "" if args.chosen is None else " --attacks " + " ".join(args.chosen)
    lines = [
        "# One lying member beside an honest swarm",
        "",
        f"{args.peers} honest peers (digits, iid, `--wait-for {args.peers}`) and one member that never trains; target "
        f"{args.target} held, medians of {args.seeds} seeds; real members: {args.peers + 1}. In the secure swarm the "
        "liar is an admitted member with a key of its own. "
        f"Command: `python experiments/hostile.py{' --quick' if args.quick else ''} --seeds {args.seeds}{chosen}`.",
        "",
        *markdown_table(
            ["swarm", "attack", "time to target (s)", "over idle", "missed", "exchanges/peer", "largest view", "peak fds",
             "peak RSS MB", "honest deaths seen"],
            table,
        ),
    ]
    finite = [r for r in ratios if r is not None]
    return publish(out, lines, {
        "worst_time_ratio": round(max(finite), 3) if finite else None,
        "largest_honest_view": max(r["largest_view"] for r in rows),
        "real_members": args.peers + 1,
        "peak_fds": max(r["peak_fds"] for r in rows),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in rows), 1),
    })


if __name__ == "__main__":
    sys.exit(main())
