"""A peer's metrics for Prometheus (``--prometheus [HOST:]PORT``): ``/metrics`` from its latest evaluation.

The training loop hands each record it writes to ``PrometheusExporter.write``,
which keeps only a reference to the latest one; a scrape (on the exporter's
own HTTP thread, ``prometheus_client``'s server) reads that reference and
builds the families from it. So a slow or hung scraper costs the training
loop nothing, and an answer's size does not grow with the swarm.
Totals that only grow are counters (``gossiptrain_exchanges_total``,
``gossiptrain_bytes_sent_total``, ``gossiptrain_local_steps_total``, ...),
the rest gauges, every family labelled with the peer's id and shard, and
the staleness of merged updates (steps) and the exchanges' round trips
(seconds) histograms. ``--prometheus`` on the coordinator serves its own
counters instead (``coordinator_families``). Bound to 127.0.0.1
unless a host is given. Needs ``prometheus-client``
(``pip install 'gossiptrain[prometheus]'``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator

from gossiptrain.errors import ConfigError
from gossiptrain.net.addressing import parse_listen as listen_at
from gossiptrain.protocol.rtt import RTT_BUCKETS_S
from gossiptrain.protocol.staleness import bucket_bounds

#: record field -> (metric name, help); totals since the peer started.
COUNTERS: dict[str, tuple[str, str]] = {
    "step": ("gossiptrain_local_steps", "local optimizer steps taken"),
    "exchanges": ("gossiptrain_exchanges", "averaging exchanges completed or served"),
    "bytes_sent": ("gossiptrain_bytes_sent", "bytes sent to other members"),
    "bytes_received": ("gossiptrain_bytes_received", "bytes received from other members"),
    "timeouts": ("gossiptrain_exchange_timeouts", "exchanges that timed out"),
    "presumed_lost": ("gossiptrain_exchanges_presumed_lost", "exchanges whose reply was far later than usual (not waited for)"),
    "refused": ("gossiptrain_exchanges_refused", "our exchange requests partners refused"),
    "dropped": ("gossiptrain_messages_dropped", "messages dropped as malformed, of another run or rejected"),
    "members_dead": ("gossiptrain_members_dead", "members this peer saw declared dead"),
    "waited_s": ("gossiptrain_flow_control_waited_seconds", "seconds the training loop waited for the link"),
    "guard_restores": ("gossiptrain_guard_restores", "times the model became non-finite and was restored (stability guard)"),
}
#: record field -> (metric name, help); values as of the latest evaluation.
GAUGES: dict[str, tuple[str, str]] = {
    "test_acc": ("gossiptrain_test_accuracy", "test-set accuracy of this peer's model"),
    "test_loss": ("gossiptrain_test_loss", "test-set loss of this peer's model"),
    "loss": ("gossiptrain_train_loss", "training loss, averaged over recent steps"),
    "members": ("gossiptrain_members", "members in this peer's view, itself included"),
    "exchanges_per_s": ("gossiptrain_exchanges_per_second", "exchanges per second since the previous evaluation"),
    "rtt_ms": ("gossiptrain_exchange_round_trip_milliseconds", "smoothed exchange round trip"),
    "staleness_mean": ("gossiptrain_staleness_mean_steps", "mean staleness of merged updates, in steps"),
    "compression_level": ("gossiptrain_compression_level", "compression auto: 0 none, 1 fp16, 2 int8"),
    "guard_backed_off": ("gossiptrain_guard_methods_backed_off", "added methods the stability guard has turned off now"),
}


def parse_listen(spec: str, flag: str = "--prometheus") -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` -> (host, port), host 127.0.0.1 unless given (``net.addressing.parse_listen``)."""
    return listen_at(spec, flag)


def check_available(flag: str = "--prometheus") -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(f"{flag} needs prometheus-client: pip install 'gossiptrain[prometheus]'") from None


#: coordinator stat -> (metric name, help); totals since it started.
COORDINATOR_COUNTERS: dict[str, tuple[str, str]] = {
    "joins_answered": ("gossiptrain_coordinator_joins_answered", "joins welcomed"),
    "joins_refused": ("gossiptrain_coordinator_joins_refused", "joins refused (another run, another model, a bad request)"),
    "joins_throttled": ("gossiptrain_coordinator_joins_throttled", "joins dropped over their source's rate"),
    "reports": ("gossiptrain_coordinator_reports", "members' periodic reports"),
    "reports_throttled": ("gossiptrain_coordinator_reports_throttled", "reports dropped over their source's rate"),
    "reported_dead": ("gossiptrain_coordinator_reported_dead", "registry entries dropped because members reported them dead"),
    "queries_answered": ("gossiptrain_coordinator_queries_answered", "queries of tools answered (status, export, stop)"),
    "bad_messages": ("gossiptrain_coordinator_bad_messages", "messages dropped as malformed"),
    "wrong_run": ("gossiptrain_coordinator_wrong_run", "messages of another run"),
}


class PrometheusExporter:
    """Serves ``/metrics`` on (host, port) from the latest record given to ``write``; ``close`` stops the server.

    ``collect``, when given, is called instead at each scrape (on the
    server's thread) for the families to serve: the coordinator's.
    """

    def __init__(self, host: str, port: int, collect: Callable[[], Iterable[Any]] | None = None) -> None:
        check_available()
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry

        self._latest: dict[str, Any] | None = None
        self._collect = collect
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise ConfigError(f"--prometheus {host}:{port} cannot listen: {e.strerror or e}") from None
        self.port = int(self._server.server_address[1])
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def write(self, record: dict[str, Any]) -> None:
        if record.get("event") in ("eval", "done"):
            self._latest = record  # one reference, swapped: the scrape thread reads it as it was

    def collect(self) -> Iterator[Any]:
        """The families of the latest record (prometheus_client calls this on its thread at each scrape)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self._collect is not None:
            yield from self._collect()
            return
        record = self._latest
        if record is None:
            return
        labels = ["peer", "shard"]
        values = [str(record.get("peer", "")), str(record.get("shard", ""))]
        for field, (name, text) in COUNTERS.items():
            if _finite(record.get(field)):
                family = CounterMetricFamily(name, text, labels=labels)
                family.add_metric(values, float(record[field]))
                yield family
        for field, (name, text) in GAUGES.items():
            if _finite(record.get(field)):
                family = GaugeMetricFamily(name, text, labels=labels)
                family.add_metric(values, float(record[field]))
                yield family
        hist = record.get("staleness_hist")
        if isinstance(hist, dict) and hist:
            yield _staleness(hist, labels, values)
        rtts = record.get("rtt_hist")
        if isinstance(rtts, dict) and rtts:
            yield _round_trips(rtts, labels, values)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "PrometheusExporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def coordinator_families(stats: Callable[[], dict[str, Any]], members: Callable[[], int]) -> Callable[[], Iterator[Any]]:
    """The coordinator's families for ``PrometheusExporter(collect=...)``: its counters and the members it knows.

    ``stats()`` and ``members()`` are read at each scrape, on the exporter's
    thread: plain reads of counters the coordinator's loop writes.
    """

    def collect() -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = stats()
        for field, (name, text) in COORDINATOR_COUNTERS.items():
            if _finite(values.get(field)):
                yield CounterMetricFamily(name, text, value=float(values[field]))
        yield GaugeMetricFamily("gossiptrain_coordinator_members", "live members in the coordinator's registry",
                                value=float(members()))

    return collect


#: The staleness histogram's upper bounds (steps): the ends of the buckets peers count ("0", "1", "2-3", "4-7", ...),
#: every one of them always, so that every peer's series have the same ``le`` (past the last: +Inf only).
STALENESS_BOUNDS = (0.0, *(float((1 << k) - 1) for k in range(1, 17)))


def _staleness(hist: dict[str, Any], labels: list[str], values: list[str]) -> Any:
    """Buckets as peers count them ("0", "1", "2-3", "4-7", ...) as a cumulative Prometheus histogram (le = upper end)."""
    counts = [(float(bucket_bounds(k)[1]), v) for k, v in hist.items() if isinstance(v, int)]
    return _histogram("gossiptrain_staleness_steps", "staleness of merged updates, in steps", counts, labels, values,
                      STALENESS_BOUNDS)


def _round_trips(hist: dict[str, Any], labels: list[str], values: list[str]) -> Any:
    """Round trips as peers count them (upper bound in seconds -> count; "inf" past the last) as a Prometheus histogram."""
    counts = []
    for key, n in hist.items():
        try:
            counts.append((float(key), int(n)))
        except (TypeError, ValueError):
            continue
    return _histogram("gossiptrain_exchange_round_trip_seconds",
                      "exchange round trips: request to reply, or push to receipt", counts, labels, values, RTT_BUCKETS_S)


def _histogram(name: str, text: str, counts: list[tuple[float, int]], labels: list[str], values: list[str],
               bounds: Iterable[float]) -> Any:
    """(upper bound, count) pairs, in any order, as one cumulative histogram with a bucket at each of ``bounds``
    (a count above the last: in +Inf only).

    Every bound, counted or not: Prometheus sums histograms across peers bucket by bucket (``sum by (le)``, as the
    dashboard's staleness quantiles do). Peers that served only the buckets they had counted gave it different
    ``le`` sets as soon as their largest staleness differed, and that sum is no histogram (its buckets need not
    grow with ``le``), so ``histogram_quantile`` over it meant nothing."""
    from prometheus_client.core import HistogramMetricFamily

    buckets = [(f"{upper:g}", sum(n for at, n in counts if at <= upper)) for upper in sorted(bounds)]
    buckets.append(("+Inf", sum(n for _, n in counts)))
    family = HistogramMetricFamily(name, text, labels=labels)
    family.add_metric(values, buckets, sum_value=None)
    return family


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
