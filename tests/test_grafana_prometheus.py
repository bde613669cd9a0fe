"""The example Grafana dashboard's queries, run by a real Prometheus (Debian's) scraping a real swarm.

A coordinator and two peers train digits-small with ``--prometheus``; a
``prometheus`` of the test's own (gossiptrain/testing/prometheus.py) scrapes
all three every second. Once every target is up and every peer has been
scraped at least twice since it started exchanging, every ``expr`` of
``deploy/grafana/gossiptrain.json`` (wherever in the JSON: panels, rows,
templating; Grafana's variables filled in by ``grafana_to_promql``:
``$__rate_interval`` as 1m, a template variable as its "All" regex) goes
through ``/api/v1/query``: it must parse, and return a series for each peer
of the swarm (a query over peers' series that aggregates them, or one of
the coordinator's: at least one series).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from gossiptrain.testing.prometheus import PrometheusServer, dashboard_exprs, grafana_to_promql, why_not

from .swarm import Proc, Procs, next_host

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "gossiptrain.json"

pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")


def template_values(dashboard: dict) -> dict[str, str]:
    """Each template variable (but the data source) as Grafana fills in "All": its allValue, else a regex of any."""
    return {v["name"]: v.get("allValue") or ".+" for v in dashboard.get("templating", {}).get("list", [])
            if v.get("type") != "datasource"}


def test_grafana_to_promql_fills_in_variables() -> None:
    assert grafana_to_promql('rate(x{peer=~"$peer"}[$__rate_interval])', {"peer": ".+"}) == 'rate(x{peer=~".+"}[1m])'
    assert grafana_to_promql("${peer:regex} [[peer]]", {"peer": "a|b"}) == "a|b a|b"
    with pytest.raises(KeyError, match="member"):
        grafana_to_promql("x{peer=~'$member'}", {})


def test_the_dashboards_staleness_quantiles_sum_peers_that_saw_different_staleness(tmp_path: Path) -> None:
    """Peers' histograms all have the same buckets, so Prometheus's ``sum by (le)`` of them is the swarm's.

    Two exporters (the peers' code) serve what two peers' records say: one
    merged 50 fresh and 50 updates 64-127 steps stale, the other 50 fresh and
    50 one step stale. Of the 200, the 180th is 30/50 into 64-127: p90 is 101.4
    (linear within the bucket, as ``histogram_quantile`` reads it). When each
    served only its counted buckets, the sum's buckets were 100 at le 0, 1 and
    127, 200 only at +Inf: p90 read 127, the largest bound.
    """
    if why := why_not():
        pytest.skip(why)
    from gossiptrain.train.prometheus import PrometheusExporter

    dashboard = json.loads(DASHBOARD.read_text())
    (p90,) = [e for where, e in dashboard_exprs(dashboard) if "histogram_quantile(0.9" in e]
    hists = [{"0": 50, "64-127": 50}, {"0": 50, "1": 50}]
    with PrometheusExporter("127.0.0.1", 0) as a, PrometheusExporter("127.0.0.1", 0) as b:
        for n, (exporter, hist) in enumerate(zip((a, b), hists)):
            exporter.write({"event": "eval", "peer": f"p{n}", "shard": n, "step": 100, "staleness_hist": hist})
        with PrometheusServer({"peers": [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]}, tmp_path) as prom:
            prom.wait_scraped(times=1)
            (got,) = prom.query(grafana_to_promql(p90, template_values(dashboard)))
    assert float(got["value"][1]) == pytest.approx(63 + 64 * 30 / 50)


def free_address() -> str:
    """HOST:PORT free now, on a loopback address of its own (``next_host``)."""
    host = next_host()
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def test_every_dashboard_query_returns_the_swarms_peers_from_a_real_prometheus(procs: Procs, tmp_path: Path) -> None:
    if why := why_not():
        pytest.skip(why)
    # The metrics addresses are chosen here, so that Prometheus starts with the swarm: it scrapes a new target only
    # about 5 s after it starts (its discovery's update interval), a wait that once came after the swarm's start.
    targets = {"coordinator": [free_address()], "peers": [free_address(), free_address()]}
    coord = procs.start("coordinator", "--bind", f"{next_host()}:0", "--prometheus", targets["coordinator"][0],
                        "--shards", "2", "--workload", "digits-small", "--seconds", "120",
                        "--set", "train.eval_every_seconds=0.3", "--set", "membership.report_interval=0.5", name="coordinator")
    with PrometheusServer(targets, tmp_path / "prometheus") as prom:
        join = procs.wait_for(lambda: (m := re.search(r"listening on tcp://(\S+) ", coord.output())) and m.group(1), 60,
                              "the coordinator to listen")
        peers = [procs.peer(join, "--prometheus", address) for address in targets["peers"]]

        def metrics_at(proc: Proc) -> str:
            return procs.wait_for(lambda: (m := re.search(r"Prometheus metrics at http://(\S+)/metrics", proc.output()))
                                  and m.group(1), 60, f"{proc.name} to print its metrics address")

        assert {"coordinator": [metrics_at(coord)], "peers": [metrics_at(p) for p in peers]} == targets
        ids = procs.wait_for(lambda: all(p.records("start") for p in peers) and {p.records("start")[0]["peer"] for p in peers},
                             60, "the peers' ids")
        dashboard = json.loads(DASHBOARD.read_text())
        exprs = [(where, grafana_to_promql(expr, template_values(dashboard))) for where, expr in dashboard_exprs(dashboard)]
        assert len(exprs) >= 10

        prom.wait_scraped(times=2)

        def every_target_scraped_up_twice() -> bool:  # its scrapes before the target listened count in wait_scraped
            ups = {r["metric"]["instance"]: float(r["value"][1]) for r in prom.query("sum_over_time(up[10m])")}
            return all(ups.get(address, 0) >= 2 for addresses in targets.values() for address in addresses)

        procs.wait_for(every_target_scraped_up_twice, 60, "every target to be scraped up twice")

        def exchanging_peers_scraped_twice() -> bool:  # two scrapes of each peer since it first exchanged
            got = prom.query("count_over_time(gossiptrain_exchanges_total[1m]) >= 2"
                             " and min_over_time(gossiptrain_exchanges_total[1m]) > 0")
            return {r["metric"]["peer"] for r in got} == ids

        procs.wait_for(exchanging_peers_scraped_twice, 60, "every peer to be scraped twice while exchanging")
        answers = {where: (expr, prom.query(expr)) for where, expr in exprs}  # a parse error raises, in its own words
        # the dashboard sums histograms across peers bucket by bucket: every peer must serve the same buckets (le)
        layouts = prom.query('count by (__name__, le) ({__name__=~"gossiptrain_.+_bucket"})')

    empty = {where: expr for where, (expr, result) in answers.items() if not result}
    assert not empty, f"dashboard queries that returned nothing: {empty}"
    for where, (expr, result) in answers.items():
        labelled = {r["metric"].get("peer") for r in result} - {None}
        assert not labelled or labelled == ids, (where, expr, labelled, ids)  # per peer: each member, none other
    (coordinator,) = [result for expr, result in answers.values() if expr == "gossiptrain_coordinator_members"]
    assert [float(r["value"][1]) for r in coordinator] == [2.0]  # the members the coordinator knows
    assert {r["metric"]["__name__"] for r in layouts} == {"gossiptrain_staleness_steps_bucket",
                                                           "gossiptrain_exchange_round_trip_seconds_bucket"}
    assert {float(r["value"][1]) for r in layouts} == {2.0}, layouts
