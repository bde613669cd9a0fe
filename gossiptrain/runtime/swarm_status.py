"""A swarm at a glance: every live member's own status, with the totals and who lags.

``StatusBoard.poll`` asks the member at ``--join`` who is alive (query ->
roster), then each of them how it is doing (``SwarmClient.statuses``,
``gossiptrain.protocol.status``), and folds the answers into a
``SwarmStatus``: one row per member and the swarm's totals. The board
remembers each member's last answer across polls, so ``--watch`` and the
dashboard keep showing a member that stopped answering, with how long ago
it was last heard, instead of dropping it from the table.

A member's state, as shown:

- ``alive``: it answered and its loop reached a safe point in the last ``STUCK_AFTER_S``;
- ``stuck``: it answered, but its training loop has not reached a safe point
  for longer than that (a loop stuck in evaluation, a checkpoint, data loading);
- ``suspect``: the member asked suspects it (SWIM), not declared dead yet;
- ``joining``, ``final``, ``done``: the phase it reports (``done``: its final phase is over);
- ``no answer``: listed alive, but it did not answer this poll;
- ``gone``: no longer listed (dead or left), kept in the table with its last
  answer for ``forget_after_s``, out of the totals.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from gossiptrain.net.address_forms import is_client_address
from gossiptrain.protocol.member import Member
from gossiptrain.protocol.status import DONE, FINAL, JOINING, MemberStatus
from gossiptrain.runtime.swarm_client import Roster, SwarmClient

STUCK_AFTER_S = 30.0  # a loop without a safe point for longer than this is shown stuck
LAG_FRACTION = 0.8  # a member below this fraction of the median step lags
LAG_MIN_STEPS = 10  # ...once the median is past this many steps (at the start, everyone is "behind")


@dataclass(frozen=True)
class MemberRow:
    """One member in the table: who the roster says it is, its state, and its last answer (None: never heard)."""

    id: str
    addr: str
    shard: int
    state: str
    heard_s_ago: float | None  # since its last answer reached us
    status: MemberStatus | None
    answered: bool = False  # in this poll
    relay: bool = False  # it relays between members behind NAT (`peer --relay`; ``Member.relay``)

    @property
    def role(self) -> str | None:
        """``relay`` (it passes messages between clients), ``client`` (behind NAT), or None: neither."""
        return "relay" if self.relay else "client" if is_client_address(self.addr) else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "addr": self.addr, "shard": self.shard, "state": self.state,
                               "role": self.role,
                               "heard_s_ago": None if self.heard_s_ago is None else round(self.heard_s_ago, 2)}
        if self.status is not None:
            reported = asdict(self.status)
            for k in ("id", "addr", "shard"):
                del reported[k]
            reported["partners"] = list(self.status.partners)
            out.update(reported)
        return out


@dataclass(frozen=True)
class SwarmStatus:
    """What one poll found: the run, who answered the query, the rows, the totals and the spread of steps."""

    fingerprint: str
    answered_by: str
    stopping: bool
    time: float  # wall clock (seconds since the epoch) of the poll
    rows: tuple[MemberRow, ...]
    totals: dict[str, Any] = field(default_factory=dict)
    steps: dict[str, Any] = field(default_factory=dict)  # min, median, max, lagging (member ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.fingerprint, "answered_by": self.answered_by, "stopping": self.stopping, "time": round(self.time, 3),
            "members": [r.to_dict() for r in self.rows], "totals": self.totals, "steps": self.steps,
        }


def member_state(listed: str, status: MemberStatus | None, answered_now: bool) -> str:
    """The state shown for a member (see the module docstring)."""
    if listed == "suspect":
        return "suspect"
    if status is None or not answered_now:
        return "no answer"
    if status.phase in (JOINING, FINAL, DONE):
        return status.phase
    return "stuck" if status.idle_s > STUCK_AFTER_S else "alive"


def summarize(rows: tuple[MemberRow, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The swarm's totals and the spread of its steps, from the rows with an answer."""
    known = [r.status for r in rows if r.status is not None and r.state != "gone"]
    accs = [s.test_acc for s in known if s.test_acc is not None]
    losses = [s.loss for s in known if s.loss is not None]
    totals = {
        "members": sum(1 for r in rows if r.state != "gone"),
        "answered": sum(1 for r in rows if r.answered),
        "steps": sum(s.step for s in known),
        "samples": sum(s.samples for s in known),
        "exchanges_per_s": round(sum(s.exchanges_per_s for s in known), 2),
        "mb_sent": round(sum(s.bytes_sent for s in known) / 1e6, 3),
        "mb_received": round(sum(s.bytes_received for s in known) / 1e6, 3),
        "mean_test_acc": round(statistics.fmean(accs), 4) if accs else None,
        "mean_loss": round(statistics.fmean(losses), 4) if losses else None,
        # leased data (gossiptrain.protocol.leases): the swarm's epoch, as its furthest member has heard; None: shards
        "lease_epoch": max((s.lease_epoch for s in known if s.lease_epoch is not None), default=None),
    }
    steps = [s.step for s in known]
    if not steps:
        return totals, {"min": None, "median": None, "max": None, "lagging": []}
    median = statistics.median(steps)
    lagging = sorted(
        r.id for r in rows
        if r.status is not None and r.state != "gone" and median >= LAG_MIN_STEPS and r.status.step < LAG_FRACTION * median
    )
    return totals, {"min": min(steps), "median": median, "max": max(steps), "lagging": lagging}


class StatusBoard:
    """Polls a swarm through one ``SwarmClient`` and remembers each member's last answer (see the module docstring)."""

    def __init__(self, client: SwarmClient, *, timeout: float = 2.0, forget_after_s: float = 300.0) -> None:
        self.client = client
        self.timeout = timeout
        self.forget_after_s = forget_after_s  # a member neither listed nor heard for this long leaves the table
        self._last: dict[str, tuple[MemberStatus, float, Member]] = {}  # id -> (last answer, when, as listed)

    async def poll(self) -> SwarmStatus:
        """One round: who is alive, then each of them (``JoinError`` if the member at ``--join`` does not answer)."""
        roster: Roster = await self.client.query(attempts=2, timeout=self.timeout)
        listed = {m.id: (m, "alive") for m in roster.members} | {m.id: (m, "suspect") for m in roster.suspects}
        answers = await self.client.statuses([m for m, _ in listed.values()], timeout=self.timeout)
        now = time.monotonic()
        for mid, status in answers.items():
            self._last[mid] = (status, now, listed[mid][0])
        for mid in [mid for mid, (_, when, _) in self._last.items() if mid not in listed and now - when > self.forget_after_s]:
            del self._last[mid]
        rows = []
        for mid in sorted(set(listed) | set(self._last)):
            member, how = listed.get(mid, (None, "gone"))
            last = self._last.get(mid)
            status, heard, member = (last[0], now - last[1], member or last[2]) if last else (None, None, member)
            assert member is not None
            state = "gone" if how == "gone" else member_state(how, status, mid in answers)
            rows.append(MemberRow(mid, member.addr, member.shard, state, heard, status, mid in answers, member.relay))
        totals, steps = summarize(tuple(rows))
        return SwarmStatus(roster.fingerprint, roster.answered_by, roster.stopping, time.time(), tuple(rows), totals, steps)
