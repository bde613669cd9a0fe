"""TensorBoard scalars from the same records the metrics file gets (``--tensorboard DIR``).

A peer writes one run, ``DIR/<peer id>``, so that several peers (on one
machine or on a shared file system) sharing DIR show up side by side; the
simulator writes ``DIR/peer-<n>`` per simulated peer, with the consensus
distance too, at virtual time. The x axis is the peer's local step.
Needs the ``tensorboard`` package (``pip install 'gossiptrain[tensorboard]'``);
``torch.utils.tensorboard`` writes the event files.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import TracebackType
from typing import Any, Iterable

from gossiptrain.errors import ConfigError

#: Record field -> TensorBoard tag; bytes are shown in MB.
SCALARS: dict[str, str] = {
    "test_acc": "accuracy/test",
    "f1": "accuracy/f1",
    "loss": "loss/train",
    "test_loss": "loss/test",
    "exchanges": "exchanges/total",
    "exchanges_per_s": "exchanges/per_second",
    "staleness_mean": "exchanges/staleness_mean",
    "rtt_ms": "exchanges/round_trip_ms",
    "waited_s": "exchanges/flow_control_waited_s",
    "bytes_sent": "bytes/sent_MB",
    "bytes_received": "bytes/received_MB",
    "members": "swarm/members",
    "consensus_distance": "swarm/consensus_distance",
}
_MB = ("bytes_sent", "bytes_received")


def check_available(flag: str = "--tensorboard") -> None:
    """ConfigError naming ``flag`` if event files cannot be written here (the tensorboard package is missing)."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        raise ConfigError(f"{flag} needs the tensorboard package: pip install 'gossiptrain[tensorboard]'") from None


class TensorBoardLog:
    """Writes the scalars of ``eval`` and ``done`` records to one TensorBoard run; a no-op without a directory."""

    def __init__(self, logdir: str | Path | None) -> None:
        self._writer: Any = None
        if logdir is None:
            return
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        try:
            self._writer = SummaryWriter(log_dir=str(logdir))
        except OSError as e:
            raise ConfigError(f"--tensorboard {str(logdir)!r} cannot be written: {e.strerror or e}") from None

    def write(self, record: dict[str, Any], walltime: float | None = None) -> None:
        """The record's scalars at its ``step`` (records without a step, or other events, are skipped)."""
        if self._writer is None or record.get("event", "eval") not in ("eval", "done"):
            return
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        when = walltime if walltime is not None else record.get("time")
        for field, tag in SCALARS.items():
            value = record.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            self._writer.add_scalar(tag, value / 1e6 if field in _MB else value, global_step=step, walltime=when)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def write_simulated(rows: Iterable[dict[str, Any]], logdir: str | Path) -> int:
    """A simulator's rows as one run per simulated peer (``logdir/peer-<n>``), at virtual time; the runs written."""
    logs: dict[Any, TensorBoardLog] = {}
    try:
        for row in rows:
            log = logs.get(row["peer"])
            if log is None:
                log = logs[row["peer"]] = TensorBoardLog(Path(logdir) / f"peer-{row['peer']}")
            log.write(row, walltime=float(row["time"]))
    finally:
        for log in logs.values():
            log.close()
    return len(logs)
