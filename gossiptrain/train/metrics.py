"""Metrics as JSON lines: one object per event, flushed at once so `tail -f` and other processes see it.

The file may be a URL (``s3://bucket/run/peer.jsonl``, ``memory://...``;
see ``gossiptrain.state.storage``). Object stores cannot append, so there
the lines are kept in memory and uploaded at most every
``storage.UPLOAD_EVERY_SECONDS`` (30) and at close, in parts of 4 MiB
(``NAME``, ``NAME.1``, ...; ``read_metrics`` reads them all); a reader
always sees whole lines, and a crash loses at most the last interval's.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any, Protocol

from gossiptrain.errors import ConfigError
from gossiptrain.state import storage


def _clean(value: Any) -> Any:
    """JSON has no NaN or Infinity: write them as null rather than produce invalid lines."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def check_metrics_path(path: str | Path | storage.URL, what: str = "metrics file") -> None:
    """ConfigError, naming ``path`` as ``what``, if a metrics file cannot be appended to there; creates nothing.

    Missing directories are fine (``MetricsLog`` creates them); a directory
    given as the file, a file where a directory must be, or no permission to
    write are not. A URL is checked for its scheme and backend only
    (``storage.location``): the store itself answers at the first upload.
    """
    target = storage.location(path, what)
    if not isinstance(target, Path):
        return
    if target.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a directory: name a file, e.g. {target / 'peer.jsonl'}")
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise ConfigError(f"{what} {str(path)!r} cannot be written: {ancestor} is a file, not a directory")
    writable = os.access(target, os.W_OK) if target.exists() else os.access(ancestor, os.W_OK | os.X_OK)
    if not writable:
        raise ConfigError(f"{what} {str(path)!r} cannot be written: permission denied")


class MetricsLog:
    """Appends records to a JSON-lines file (missing directories are created); a no-op when no path is given.

    A path that cannot be written raises ConfigError naming it. On a URL
    the file is uploaded whole every ``upload_every`` seconds and at close
    (see the module docstring).
    """

    def __init__(
        self, path: str | Path | storage.URL | None, *, upload_every: float = storage.UPLOAD_EVERY_SECONDS
    ) -> None:
        self.path = storage.location(path, "metrics file") if path else None
        self._fh: storage.TextAppender | None = None
        self._lock = threading.Lock()
        if self.path is not None:
            check_metrics_path(self.path)
            try:
                self._fh = storage.open_append(self.path, upload_every=upload_every)
            except OSError as e:
                raise ConfigError(f"metrics file {str(self.path)!r} cannot be written: {e.strerror or e}") from None

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        line = json.dumps({k: _clean(v) for k, v in record.items()}, separators=(",", ":"))
        with self._lock:
            self._fh.write(line + "\n")  # flushed at once (local), or uploaded when due (URL)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class RecordSink(Protocol):
    """Where a peer's records go: the metrics file, TensorBoard."""

    def write(self, record: dict[str, Any]) -> None: ...


class Tee:
    """Every record to each of ``sinks``, in order."""

    def __init__(self, *sinks: RecordSink) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)


def read_metrics(path: str | Path | storage.URL) -> list[dict[str, Any]]:
    """All complete records of a JSON-lines file or URL (a line being written is skipped)."""
    out: list[dict[str, Any]] = []
    try:
        text = storage.read_appended(storage.location(path, "metrics file")).decode("utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class MetricsTail:
    """The records of a JSON-lines file that another process is still writing, read incrementally.

    For watchers that poll many growing files for minutes (chaos tests, the
    churn experiment): re-reading whole files at every poll would take the
    CPU from the peers being watched. A line still being written is left for
    the next ``poll``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []
        self._offset = 0

    def poll(self) -> list[dict[str, Any]]:
        """All complete records so far (the same list, grown)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return self.records
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._offset += end
        return self.records
