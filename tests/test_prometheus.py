"""`--prometheus`: /metrics parses with prometheus_client's own parser, its counters rise, a scrape never waits on training."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gossiptrain.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

from .conftest import fast_config
from .swarm import Procs

parser = pytest.importorskip("prometheus_client.parser", reason="the prometheus extra is not installed")

from gossiptrain.protocol.rtt import RTT_BUCKETS_S  # noqa: E402
from gossiptrain.train.prometheus import STALENESS_BOUNDS, PrometheusExporter, parse_listen  # noqa: E402


def scrape(url: str) -> dict[str, dict[str, Any]]:
    """name -> {"type", "samples": {sample name: value}} as prometheus_client's parser reads the page."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {f.name: {"type": f.type, "samples": {s.name + str(sorted(s.labels.items())): s.value for s in f.samples}}
            for f in parser.text_string_to_metric_families(text)}


def value(families: dict[str, dict[str, Any]], name: str) -> float:
    (v,) = [v for k, v in families[name]["samples"].items() if k.startswith(name + "_total") or k.startswith(name + "[")]
    return float(v)


def test_the_latest_record_is_served_as_counters_gauges_and_a_histogram() -> None:
    with PrometheusExporter("127.0.0.1", 0) as exporter:
        url = f"http://127.0.0.1:{exporter.port}/metrics"
        assert "gossiptrain_" not in urllib.request.urlopen(url, timeout=10).read().decode()  # nothing evaluated yet
        exporter.write({"event": "start", "step": 0, "peer": "p1", "shard": 0})  # not an evaluation: ignored
        exporter.write({"event": "eval", "peer": "p1", "shard": 0, "step": 40, "exchanges": 12, "bytes_sent": 5000,
                        "test_acc": 0.9, "members": 3, "test_loss": float("nan"), "staleness_hist": {"0": 5, "1": 2, "2-3": 1},
                        "rtt_hist": {"0.001": 2, "0.01": 3, "inf": 1}})
        got = scrape(url)
        assert got["gossiptrain_local_steps"]["type"] == "counter" and value(got, "gossiptrain_local_steps") == 40
        assert value(got, "gossiptrain_exchanges") == 12 and value(got, "gossiptrain_bytes_sent") == 5000
        assert got["gossiptrain_test_accuracy"]["type"] == "gauge" and value(got, "gossiptrain_test_accuracy") == 0.9
        assert "gossiptrain_test_loss" not in got  # NaN is no value
        buckets = {k: v for k, v in got["gossiptrain_staleness_steps"]["samples"].items() if "_bucket" in k}
        # Every bound always, counted or not (the same le on every peer, for sum by (le)): cumulative
        assert [v for k, v in buckets.items()][:4] == [5.0, 7.0, 8.0, 8.0]  # le 0, 1, 3, 7, ...
        assert len(buckets) == len(STALENESS_BOUNDS) + 1 and set(list(buckets.values())[3:]) == {8.0}  # ..., +Inf
        rtts = {k: v for k, v in got["gossiptrain_exchange_round_trip_seconds"]["samples"].items() if "_bucket" in k}
        assert len(rtts) == len(RTT_BUCKETS_S) + 1  # le 0.001, 0.002, ..., 10, +Inf
        assert list(rtts.values())[:4] == [2.0, 2.0, 2.0, 5.0] and list(rtts.values())[-1] == 6.0  # inf: in +Inf only
        assert all("('peer', 'p1')" in k for k in got["gossiptrain_members"]["samples"])
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=10):  # a scraper that hangs mid-request
            exporter.write({"event": "eval", "peer": "p1", "shard": 0, "step": 41})  # the loop's side: a reference swap
            assert value(scrape(url), "gossiptrain_local_steps") == 41  # and other scrapes are answered meanwhile


def test_the_example_grafana_dashboard_asks_only_for_what_peers_and_the_coordinator_export() -> None:
    from gossiptrain.train.prometheus import COORDINATOR_COUNTERS, COUNTERS, GAUGES

    dashboard = json.loads((ROOT / "deploy" / "grafana" / "gossiptrain.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    asked = set(re.findall(r"\bgossiptrain_[a-z_]+", " ".join(exprs)))
    exported = ({name + "_total" for name, _ in COUNTERS.values()} | {name for name, _ in GAUGES.values()}
                | {"gossiptrain_staleness_steps_bucket", "gossiptrain_coordinator_members"}
                | {name + "_total" for name, _ in COORDINATOR_COUNTERS.values()})
    assert asked and asked <= exported, asked - exported
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_listen_specs() -> None:
    assert parse_listen("9100") == ("127.0.0.1", 9100)
    assert parse_listen("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_listen("[::1]:9100") == ("::1", 9100)
    for bad in ("", "host", "1:2:x", "70000"):
        with pytest.raises(ConfigError, match="--prometheus"):
            parse_listen(bad)


def test_a_real_peers_counters_rise_between_scrapes(procs: Procs, coordinator_factory: Any) -> None:
    coord = coordinator_factory(fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 60,
                                               "train.eval_every_seconds": 0.2}))
    join = coord.address.removeprefix("tcp://")
    watched = procs.peer(join, "--prometheus", "127.0.0.1:0")
    procs.peer(join)
    url = procs.wait_for(lambda: (m := re.search(r"Prometheus metrics at (\S+)", watched.output())) and m.group(1), 60,
                         "the peer to print its metrics address")
    first = procs.wait_for(lambda: (got := scrape(url)).get("gossiptrain_exchanges") and got, 60, "a first evaluation")
    def more() -> dict[str, dict[str, Any]] | None:
        got = scrape(url)
        return got if value(got, "gossiptrain_exchanges") > value(first, "gossiptrain_exchanges") else None

    later = procs.wait_for(more, 60, "more exchanges")
    assert value(later, "gossiptrain_local_steps") > value(first, "gossiptrain_local_steps")
    assert value(later, "gossiptrain_members") == 2


def test_the_coordinator_serves_its_joins_and_members(procs: Procs) -> None:
    from .swarm import next_host

    host = next_host()
    coord = procs.start("coordinator", "--bind", f"{host}:0", "--prometheus", "127.0.0.1:0", "--shards", "2",
                        "--seconds", "60", "--set", "membership.report_interval=0.5", name="coordinator")
    join = procs.wait_for(lambda: (m := re.search(r"listening on tcp://(\S+) ", coord.output())) and m.group(1), 60,
                          "the coordinator to listen")
    url = procs.wait_for(lambda: (m := re.search(r"Prometheus metrics at (\S+)", coord.output())) and m.group(1), 60,
                         "the coordinator to print its metrics address")
    assert value(scrape(url), "gossiptrain_coordinator_joins_answered") == 0
    procs.peer(join)
    procs.peer(join)
    got = procs.wait_for(
        lambda: (g := scrape(url)) and value(g, "gossiptrain_coordinator_members") == 2
        and value(g, "gossiptrain_coordinator_reports") >= 2 and g, 60, "the coordinator to count two reporting members",
    )
    assert got["gossiptrain_coordinator_joins_answered"]["type"] == "counter"
    assert value(got, "gossiptrain_coordinator_joins_answered") >= 2
