"""``gossiptrain dashboard``: one live page of a running swarm, fed by the same polls as ``gossiptrain status``.

A ``Dashboard`` polls the swarm on its own event loop thread
(``StatusBoard``, every ``every`` seconds) and keeps a bounded history: the
swarm's mean accuracy and loss and its bytes sent at every poll, and each
member's numbers for the first ``CHARTED_MEMBERS`` members, for
``HISTORY_POLLS`` polls. An HTTP server on another thread serves the page
(``dashboard.html``: self-contained, no script or style from elsewhere) at
``/`` and the latest poll with the history at ``/status.json``; the page
fetches that every few seconds and draws the table, the curves and the
topology graph, a member that went quiet in red. So a browser, however
many and however slow, never adds an ask to the swarm: the swarm is asked
once per poll whatever is watching, and a request is answered from what
the last poll left. Bound to 127.0.0.1 unless asked otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from gossiptrain.config import SecurityConfig
from gossiptrain.errors import ConfigError, GossipError
from gossiptrain.runtime.loop_thread import LoopThread
from gossiptrain.runtime.swarm_client import SwarmClient
from gossiptrain.runtime.swarm_status import StatusBoard, SwarmStatus

log = logging.getLogger(__name__)

HISTORY_POLLS = 600  # polls kept for the curves: 20 minutes at one poll every 2 s
CHARTED_MEMBERS = 32  # members with their own curve; the means cover everyone


def history_point(status: SwarmStatus) -> dict[str, Any]:
    """What the curves need of one poll, bounded whatever the swarm's size."""
    members = {}
    for row in status.rows[:CHARTED_MEMBERS]:
        s = row.status
        if s is not None and row.state != "gone":
            members[row.id] = {"test_acc": s.test_acc, "loss": s.loss}
    return {
        "time": status.time, "mean_test_acc": status.totals["mean_test_acc"], "mean_loss": status.totals["mean_loss"],
        "bytes_sent": round(status.totals["mb_sent"] * 1e6), "members": members,
    }


class Dashboard:
    """Polls the swarm at ``join`` and serves the page at ``url`` (see the module docstring); ``close()`` stops both."""

    def __init__(
        self,
        join: str,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        every: float = 2.0,
        timeout: float = 2.0,
        advertise: str | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        self.join, self.every, self.timeout = join, every, timeout
        self._advertise, self._security = advertise, security
        self.latest: SwarmStatus | None = None  # replaced whole by the poller, read by the HTTP threads
        self.error = ""  # why the last poll failed ("" when it did not)
        self.failure: Exception | None = None  # what stopped the polls for good (they go on otherwise)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POLLS)
        self.polls = 0
        page = resources.files("gossiptrain.runtime").joinpath("dashboard.html").read_text(encoding="utf-8")
        self._page = page.replace("REFRESH_MS", str(max(500, int(every * 1000)))).encode()
        self._loop = LoopThread("gossiptrain-dashboard")
        self._poller: Any = None
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._http = threading.Thread(target=self._server.serve_forever, name="gossiptrain-dashboard-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{f'[{host}]' if ':' in str(host) else host}:{port}/"

    def start(self) -> "Dashboard":
        self._loop.start()
        self._poller = asyncio.run_coroutine_threadsafe(self._poll_forever(), self._loop.loop)
        self._http.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._poller is not None:
            self._poller.cancel()
        self._loop.stop()

    def __enter__(self) -> "Dashboard":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def snapshot(self) -> dict[str, Any]:
        """The body of ``/status.json``: the latest poll, why the last one failed, and the history."""
        latest = self.latest
        return {"status": latest.to_dict() if latest else None, "error": self.error, "history": list(self.history)}

    async def _poll_forever(self) -> None:
        try:
            await self._polls()
        except ConfigError as e:  # bad input (--advertise, keys): one line, no traceback; `failure` ends the command
            self.failure, self.error = e, f"the dashboard stopped polling: {e}"
        except Exception as e:  # the page says so, rather than waiting for a first poll forever
            self.failure, self.error = e, f"the dashboard stopped polling: {e!r}"
            log.exception("the dashboard stopped polling")

    async def _polls(self) -> None:
        async with SwarmClient(self.join, advertise=self._advertise, security=self._security) as client:
            board = StatusBoard(client, timeout=self.timeout)
            while True:
                try:
                    status = await board.poll()
                except GossipError as e:  # the member at --join is gone for now: say so, keep the last table
                    self.error = f"no answer from {self.join}: {e}"
                    log.warning("%s", self.error)
                else:
                    self.latest, self.error = status, ""
                    self.history.append(history_point(status))
                self.polls += 1
                await asyncio.sleep(self.every)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", dashboard._page)
                elif path == "/status.json":
                    self._send(200, "application/json", json.dumps(dashboard.snapshot()).encode())
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found: the page is at /, its data at /status.json\n")

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                log.debug("dashboard: " + format, *args)

        return Handler
