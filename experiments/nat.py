"""Peers behind NAT against the same swarm on public hosts: 4 peers, label-skewed shards, real network stacks.

Two worlds of Linux network namespaces (``gossiptrain.testing.netns``), run
alternately for each seed:

- ``public``: a coordinator and 4 peers, each on its own host of one Lan;
- ``nat``: a coordinator and 2 peers on public hosts, and 2 peers each
  behind its own home router doing ``iptables MASQUERADE`` (nobody can dial
  them: they find out when they join and train as client-mode members,
  over connections they open, and average with each other through the
  coordinator's relay; README "Behind NAT");
- ``nat-no-relay`` (with ``--worlds``): the same with the coordinator's
  relay off, so that the two behind NAT average with the public peers only;
- ``nat-peer-relay`` (with ``--worlds``): the coordinator's relay off and
  the first public peer run with ``--relay``: the two behind NAT average
  with each other through that peer.

Every peer is a `gossiptrain peer` process with `--wait-for 4` (the clock
starts at the first start, as in experiments/wan.py), one torch thread,
shard i of 4, 3 classes per shard. Workload digits (the 1.1M-parameter
MLP); target: the peers' mean test accuracy held at `--target` for 3
evaluations (experiments.harness). With `--rate` every host's link is
shaped with tc tbf (the routers' public side too).

Needs root, iproute2 and iptables: without them it prints one line saying
why and exits 0. Output in experiments/results/nat/ (`--quick`: a scratch
folder): runs.csv and summary.md; the last line printed is a JSON object
{"nat_over_public": median time to target with 2 of 4 behind NAT over
the median with all 4 public (the issue's target: at most 1.25),
"nat_reached": runs of the nat world that reached the target, "runs"}.

    python experiments/nat.py                   # 3 seeds, unshaped links (a few minutes)
    python experiments/nat.py --seeds 5 --worlds public nat nat-no-relay
    python experiments/nat.py --seeds 5 --worlds public nat nat-peer-relay
    python experiments/nat.py --rate 100mbit    # every host's link at 100 Mbit/s
    python experiments/nat.py --quick           # 1 seed, short runs (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.testing import netns  # noqa: E402
from gossiptrain.train.metrics import read_metrics  # noqa: E402

PEERS = 4
PORT = 9000
SKEW = {"train.partition": "classes-per-peer", "train.partition_classes": 3}
WORLDS = ("public", "nat", "nat-no-relay", "nat-peer-relay")


def world_hosts(stack: contextlib.ExitStack, world: str) -> tuple[netns.Lan, list[netns.Namespace], list[netns.NatRouter]]:
    """The namespaces of one world, entered on ``stack``: the Lan, the peers' hosts (public first), the routers."""
    behind = 0 if world == "public" else 2
    lan = netns.Lan(1 + PEERS - behind, prefix="gt-natx")
    stack.enter_context(lan)
    routers = [netns.NatRouter(lan) for _ in range(behind)]
    for router in routers:
        stack.enter_context(router)
    return lan, [*lan.hosts[1:], *(r.hosts[0] for r in routers)], routers


def in_ns(ns: netns.Namespace, *args: Any) -> list[str]:
    return ["ip", "netns", "exec", ns.name, *harness.python_m("gossiptrain", *args)]


def one(world: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run of ``world`` with ``seed``: a row of runs.csv."""
    harness.fresh_dir(work)
    overrides = {**harness.run_overrides(PEERS, seed, max_seconds=args.timeout + 30), **SKEW,
                 "train.workload": args.workload}
    sets = [a for key, value in overrides.items() for a in ("--set", f"{key}={value}")]
    run = RunConfig().with_overrides(overrides)
    with contextlib.ExitStack() as stack:
        lan, hosts, routers = world_hosts(stack, world)
        if args.rate:
            for ns in [*lan.hosts, *hosts, *(r.router for r in routers)]:
                ns.shape_link("eth0", netns.LinkShape(rate=args.rate))
        procs = stack.enter_context(harness.Procs(work))
        join = f"{lan.addresses[0]}:{PORT}"
        relay = ["--no-relay"] if world in ("nat-no-relay", "nat-peer-relay") else []
        procs.start("coordinator", in_ns(lan.hosts[0], "coordinator", "--bind", join, *relay, *sets))
        deadline = time.monotonic() + 60
        while "join with:" not in (work / "coordinator.log").read_text(errors="replace"):
            if (problem := procs.failed()) or time.monotonic() > deadline:
                raise RuntimeError(problem or "the coordinator did not start within 60 s")
            time.sleep(0.05)
        for i, ns in enumerate(hosts):
            relays = ["--relay"] if world == "nat-peer-relay" and i == 0 else []  # hosts: the public ones first
            procs.start(f"peer-{i}", in_ns(ns, "peer", "--join", join, "--quiet", "--threads", 1, "--shard", i,
                                            "--wait-for", PEERS, "--metrics", work / f"peer-{i}.jsonl", *relays))

        def read() -> list[harness.Point]:
            per_peer = [read_metrics(work / f"peer-{i}.jsonl") for i in range(PEERS)]
            return harness.gossip_series(per_peer, run.train.batch_size)[0]

        points = harness.poll_run(procs, read, args.target, args.timeout)
        per_peer = [read_metrics(work / f"peer-{i}.jsonl") for i in range(PEERS)]
    result = harness.Run(world, seed, 1.0, points, args.target)
    last = [next((r for r in reversed(recs) if r.get("event") in ("eval", "done")), {}) for recs in per_peer]
    clients = [r for r in last if str(r.get("address", "")).endswith("/client")]
    return {
        "world": world, "seed": seed, "rate": args.rate or "none", "target": args.target,
        "time_to_target": result.time_to_target, "final_acc": round(result.final_acc, 4),
        "samples_to_target": result.samples_to_target,
        "client_members": len(clients),
        "members_min": min((r.get("members", 0) for r in last), default=0),
        "members_dead": sum(r.get("members_dead", 0) for r in last),
        "exchanges_per_peer": statistics.mean(r.get("exchanges", 0) for r in last),
        "clients_exchanges": [r.get("exchanges", 0) for r in clients],
        "sent_over_routes": sum(r.get("sent_over_routes", 0) for r in last),
        "received_relayed": sum(r.get("received_relayed", 0) for r in clients),
        "peers_relayed": sum(r.get("relayed", 0) for r in last),  # by peers run with --relay
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> int:
    def times(world: str) -> list[float]:
        return [r["time_to_target"] for r in rows if r["world"] == world and r["time_to_target"] is not None]

    def median(world: str) -> float | None:
        t = times(world)
        return statistics.median(t) if len(t) == sum(r["world"] == world for r in rows) and t else None

    public, nat, no_relay = median("public"), median("nat"), median("nat-no-relay")
    peer_relay = median("nat-peer-relay")
    ratio = nat / public if nat is not None and public else None
    no_relay_ratio = no_relay / public if no_relay is not None and public else None
    peer_relay_ratio = peer_relay / public if peer_relay is not None and public else None
    lines = [
        f"# 4 peers, 2 of them behind NAT, against 4 public peers: {args.workload}, 3 classes per peer, "
        f"medians of {args.seeds} seeds", "",
        f"Regenerate: `python experiments/nat.py --seeds {args.seeds} --worlds {' '.join(args.worlds)}"
        f"{' --rate ' + args.rate if args.rate else ''}{f' --out {args.out}' if args.out else ''}` (as root). Target: mean "
        f"test accuracy {args.target} held for 3 evaluations; {args.timeout:.0f} s of training per run at most; links "
        f"{'shaped to ' + args.rate if args.rate else 'unshaped'}. One 2-core machine runs every process.", "",
    ]
    table = [[r["world"], r["seed"], "not reached" if r["time_to_target"] is None else f"{r['time_to_target']:.2f}",
              f"{r['final_acc']:.3f}", r["client_members"], r["members_min"], r["members_dead"],
              f"{r['exchanges_per_peer']:.0f}", r["sent_over_routes"], r["received_relayed"],
              r.get("peers_relayed", 0)] for r in rows]
    lines += harness.markdown_table(
        ["world", "seed", "time to target (s)", "final mean acc", "client members", "smallest view", "deaths",
         "exchanges per peer", "sent over routes", "clients' relayed", "passed on by a peer"], table)
    lines += ["", f"Median time to target: public {harness.fmt(public or float('nan'))} s, 2 behind NAT "
              f"{harness.fmt(nat or float('nan'))} s: NAT / public = **{harness.fmt(ratio or float('nan'))}** "
              "(target at most 1.25)."]
    if any(r["world"] == "nat-no-relay" for r in rows):
        lines += [f"With the coordinator's relay off (the clients average with the public peers only): "
                  f"{harness.fmt(no_relay or float('nan'))} s, NAT / public = {harness.fmt(no_relay_ratio or float('nan'))}."]
    if any(r["world"] == "nat-peer-relay" for r in rows):
        lines += [f"Through a peer's relay (`--relay` on the first public peer, the coordinator's off): "
                  f"{harness.fmt(peer_relay or float('nan'))} s, NAT / public = {harness.fmt(peer_relay_ratio or float('nan'))}."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(harness.headline({
        "nat_over_public": harness.finite_or_none(ratio),
        "nat_reached": len(times("nat")),
        "nat_no_relay_over_public": harness.finite_or_none(no_relay_ratio),
        "nat_peer_relay_over_public": harness.finite_or_none(peer_relay_ratio),
        "runs": len(rows),
    }))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.93, help="mean test accuracy to hold (default 0.93)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds of training per run before it counts as not reached")
    ap.add_argument("--workload", default="digits")
    ap.add_argument("--worlds", nargs="+", default=["public", "nat"], choices=WORLDS,
                    help="which worlds to run (default: public nat)")
    ap.add_argument("--rate", default="", help="shape every host's link to this tbf rate, e.g. 100mbit (default: none)")
    ap.add_argument("--quick", action="store_true", help="1 seed, digits-small, short runs (a smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default experiments/results/nat)")
    args = ap.parse_args()
    if (problem := netns.why_not("iptables", need="network namespaces and NAT routers")) is not None:
        print(f"nat: skipped: {problem}")
        return 0
    if args.quick:
        args.seeds, args.timeout, args.target, args.workload = 1, 20.0, 0.8, "digits-small"
    out = harness.results_dir("nat", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in range(args.seeds):
        for world in args.worlds:
            row = one(world, seed, args, out / "runs" / f"{world}-{seed}")
            print(f"{world} seed {seed}: {row['time_to_target']} s, final {row['final_acc']}", flush=True)
            rows.append(row)
    harness.write_csv(out / "runs.csv", rows)
    return report(rows, args, out)


if __name__ == "__main__":
    sys.exit(main())
