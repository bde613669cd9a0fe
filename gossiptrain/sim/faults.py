"""Fault schedules for the simulator: churn as crash/rejoin events, and partitions.

Schedules are plain data computed up front from the seed, so a run's faults
can be printed, saved as a trace and replayed exactly.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gossiptrain.errors import ConfigError

CRASH, JOIN = "crash", "join"


@dataclass(frozen=True)
class ChurnEvent:
    time: float  # virtual seconds
    peer: int  # cluster slot
    kind: str  # "crash" (killed, no leave announced) or "join" (a fresh process rejoins that slot)

    def __post_init__(self) -> None:
        if self.kind not in (CRASH, JOIN):
            raise ConfigError(f"churn event kind must be {CRASH!r} or {JOIN!r}, got {self.kind!r}")
        if self.time < 0 or self.peer < 0:
            raise ConfigError(f"churn event needs time >= 0 and peer >= 0, got {self}")


@dataclass(frozen=True)
class PartitionSpec:
    """From ``start`` to ``heal`` the first ``fraction`` of the slots cannot reach the rest."""

    start: float
    heal: float
    fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.heal:
            raise ConfigError(f"partition needs 0 <= start < heal, got start={self.start} heal={self.heal}")
        if not 0 < self.fraction < 1:
            raise ConfigError(f"partition fraction must be in (0, 1), got {self.fraction}")

    @classmethod
    def parse(cls, text: str) -> "PartitionSpec":
        """'START:HEAL' or 'START:HEAL:FRACTION' (virtual seconds)."""
        parts = text.split(":")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) not in (2, 3):
            raise ConfigError(f"partition {text!r} must look like START:HEAL or START:HEAL:FRACTION, e.g. 10:30")
        return cls(*values)


class ChurnSettings(Protocol):
    """What churn is drawn from: these fields of a ``SimConfig`` (``gossiptrain.sim.sim_config``, which imports this module)."""

    @property
    def peers(self) -> int: ...

    @property
    def duration(self) -> float: ...

    @property
    def churn_rate(self) -> float: ...

    @property
    def churn_downtime(self) -> float: ...

    @property
    def churn_trace(self) -> tuple[ChurnEvent, ...]: ...


def churn_schedule(config: ChurnSettings, rng: random.Random) -> list[ChurnEvent]:
    """Poisson crashes at ``churn_rate`` per second across the cluster, each rejoining after the downtime.

    A crash picks a slot that is up at that moment; if all are down the
    crash is skipped. At least one slot always stays up.
    """
    events: list[ChurnEvent] = []
    if config.churn_rate <= 0:
        return events
    down_until = [0.0] * config.peers
    t = 0.0
    while True:
        t += rng.expovariate(config.churn_rate)
        if t >= config.duration:
            return events
        up = [s for s in range(config.peers) if down_until[s] <= t]
        if len(up) <= 1:
            continue
        slot = rng.choice(up)
        down_until[slot] = t + config.churn_downtime
        events.append(ChurnEvent(t, slot, CRASH))
        if down_until[slot] < config.duration:
            events.append(ChurnEvent(down_until[slot], slot, JOIN))


def churn_events(config: ChurnSettings, rng: random.Random) -> list[ChurnEvent]:
    """Every crash and join of a run in time order: the explicit trace and the Poisson schedule drawn from ``rng``."""
    return sorted([*config.churn_trace, *churn_schedule(config, rng)], key=lambda e: (e.time, e.peer))


def load_trace(path: str | Path) -> tuple[ChurnEvent, ...]:
    """A churn trace: CSV lines 'time,peer,event' (event: crash or join); '#' starts a comment."""
    events = []
    try:
        with open(path, newline="") as fh:
            for lineno, row in enumerate(csv.reader(fh), start=1):
                if not row or row[0].strip().startswith("#") or row[0].strip() == "time":
                    continue
                if len(row) != 3:
                    raise ConfigError(f"{path}:{lineno}: expected 'time,peer,event', got {','.join(row)!r}")
                try:
                    events.append(ChurnEvent(float(row[0]), int(row[1]), row[2].strip()))
                except ValueError:
                    raise ConfigError(f"{path}:{lineno}: time must be a number and peer an integer") from None
    except OSError as e:
        raise ConfigError(f"cannot read churn trace {path}: {e.strerror}") from None
    return tuple(events)
