"""A real Prometheus server in a temporary directory, scraping a swarm's ``--prometheus`` endpoints, for tests.

``PrometheusServer(targets, workdir)`` writes a ``prometheus.yml`` into
``workdir`` (one scrape job per name in ``targets``, each a list of
``HOST:PORT``, scraped every ``scrape_interval``), starts the
``prometheus`` binary (Debian's package) as a child process with its
storage in ``workdir/data`` and its web API on 127.0.0.1 at a free port,
and stops it on leaving the ``with`` block, whatever happened. ``query``
runs PromQL through ``/api/v1/query``; ``wait_scraped`` polls until every
target is up and was scraped at least N times. ``dashboard_exprs`` walks a
Grafana dashboard's JSON for every ``expr`` and ``grafana_to_promql`` fills
in Grafana's variables.

Needs the ``prometheus`` binary (``why_not`` says when it is missing); the
Debian package's own service is never used. Not imported by
``gossiptrain.testing``'s ``__init__``.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence


def why_not(binary: str = "prometheus") -> str | None:
    """Why no Prometheus can run here (None: it can)."""
    if shutil.which(binary) is None:
        return f"needs {binary} (Debian's prometheus package: apt-get install prometheus)"
    return None


class PrometheusError(RuntimeError):
    """Prometheus did not start, or answered a query with an error (its own words in the message)."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def config_text(targets: Mapping[str, Sequence[str]], scrape_interval: str) -> str:
    """prometheus.yml (JSON is YAML): one static job per name, scraped every ``scrape_interval``."""
    config = {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                   "evaluation_interval": scrape_interval},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(addresses)}]}
                           for job, addresses in targets.items()],
    }
    return json.dumps(config, indent=2)


class PrometheusServer:
    """One ``prometheus`` process of this test's own, in ``workdir``; stopped on exit (SIGTERM, then SIGKILL)."""

    def __init__(self, targets: Mapping[str, Sequence[str]], workdir: Path, scrape_interval: str = "1s",
                 binary: str = "prometheus", host: str = "127.0.0.1", start_timeout: float = 60) -> None:
        self.workdir = Path(workdir)
        self.config = self.workdir / "prometheus.yml"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(config_text(targets, scrape_interval), encoding="utf-8")
        self.log = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        for _ in range(3):  # a free port may be taken between finding it and prometheus binding it: try another
            self.port = _free_port(host)
            self.url = f"http://{host}:{self.port}"
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(
                    [binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address={host}:{self.port}",
                     "--log.level=warn"],
                    stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir, stdin=subprocess.DEVNULL,
                )
            try:
                self._wait_ready(start_timeout)
                return
            except PrometheusError:
                self.close()
                if "address already in use" not in self.output():
                    raise
        raise PrometheusError(f"prometheus found no free port:\n{self.output()[-2000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited {self.proc.returncode}:\n{self.output()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready after {timeout} s:\n{self.output()[-2000:]}")
            time.sleep(0.1)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/PATH?PARAMS: its ``data``; an error answer raises PrometheusError with Prometheus's words."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                body = json.load(answer)
        except urllib.error.HTTPError as e:  # 400 bad_data (a parse error), 422 execution: the body says why
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (vector or scalar/string as one entry): [{"metric": labels, "value": [t, v]}]."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def wait_scraped(self, times: int = 2, timeout: float = 60) -> dict[str, int]:
        """Poll until every configured target is up and was scraped ``times`` times; instance -> scrapes."""
        deadline = time.monotonic() + timeout
        while True:
            targets = self.api("targets", state="active")["activeTargets"]
            counts = {r["metric"]["instance"]: int(float(r["value"][1]))
                      for r in self.query("count_over_time(up[10m])")}
            if targets and all(t["health"] == "up" and counts.get(t["labels"]["instance"], 0) >= times for t in targets):
                return counts
            if time.monotonic() > deadline:
                state = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in targets]
                raise PrometheusError(f"targets not up and scraped {times} times after {timeout} s: {state}, {counts}")
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "PrometheusServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def dashboard_exprs(dashboard: Any) -> Iterator[tuple[str, str]]:
    """(where, expr) for every ``expr`` anywhere in a Grafana dashboard's JSON (panels, rows, templating)."""

    def walk(node: Any, where: str) -> Iterator[tuple[str, str]]:
        if isinstance(node, dict):
            title = node.get("title") or node.get("name")
            here = f"{where}/{title}" if isinstance(title, str) else where
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    yield f"{here} [{node.get('refId', '')}]", value
                else:
                    yield from walk(value, here)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item, where)

    yield from walk(dashboard, "")


#: Grafana's built-in interval variables, for a Prometheus that scrapes every second and a 30-minute view.
#: $__rate_interval is max($__interval + scrape interval, 4 x scrape interval) in Grafana: 1m at most here,
#: as wide as the dashboard's own fixed windows, so that two scrapes always fall inside it.
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__interval_ms": "15000", "__range": "30m",
            "__range_s": "1800", "__range_ms": "1800000"}


def grafana_to_promql(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with ``$name``, ``${name}``, ``${name:fmt}`` and ``[[name]]`` filled in from ``variables``
    (then ``BUILTINS``); an unknown variable raises KeyError naming it."""
    known = {**BUILTINS, **variables}

    def fill(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g)
        return known[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", fill, expr)
