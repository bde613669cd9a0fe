"""The coordinator: a bootstrap service and nothing more.

It answers joins (id, shard, run configuration, fingerprint, a sample of live
members) and learns who is alive only from joins and the peers' periodic
reports. It holds no training state, so it can be stopped and restarted at
any time: training goes on, and a restarted coordinator relearns the swarm
from the next round of reports.

Joins and reports are rate limited per source (``gossiptrain.protocol.admission.JoinLimiter``),
so that one host flooding them costs a counter, not replies, connections
or registry entries; the registry holds at most ``limits.registry_members``
(members it knows keep their places). A report is answered with gossip
to the address it claims, at most once per address every half report
interval, so forged reports (from any number of sources) make the
coordinator send an address no more than its honest member's reports do. Who may connect at all is the transport's business
(CURVE with ``--secure``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from gossiptrain.config import Limits, RunConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net import kinds
from gossiptrain.net.addressing import is_client_address
from gossiptrain.net.kinds import GOSSIP
from gossiptrain.net.transport import Transport
from gossiptrain.net.wire import Message
from gossiptrain.protocol.admission import JoinLimiter, join_source
from gossiptrain.protocol.finish import FinishEndpoint
from gossiptrain.protocol.joining import JoinRequest
from gossiptrain.protocol.member import ALIVE, REPORTED_DEATHS, Member, least_loaded_shard
from gossiptrain.protocol.param_spec import LAYOUT_OPEN, ParamSpec
from gossiptrain.runtime.clock import REAL_CLOCK, Clock
from gossiptrain.runtime.endpoint import EndpointStats
from gossiptrain.runtime.final_phase import finish_event
from gossiptrain.runtime.join_answering import JoinAnsweringEndpoint

log = logging.getLogger(__name__)


def coordinator_limits(limits: Limits) -> Limits:
    """The limits a coordinator listens with: an inbox of ``limits.coordinator_inbox_messages``, at least."""
    return dataclasses.replace(limits, inbox_messages=max(limits.inbox_messages, limits.coordinator_inbox_messages))


@dataclass
class CoordinatorStats(EndpointStats):
    joins_answered: int = 0
    joins_refused: int = 0
    joins_throttled: int = 0  # dropped unanswered: over the per-source join rate (limits.join_*)
    reports: int = 0
    reports_throttled: int = 0  # dropped unanswered: over the per-source report rate (limits.report_*)
    registry_full: int = 0  # joins and reports of members not recorded: the registry held limits.registry_members
    introductions_skipped: int = 0  # reports not answered with gossip: their address had one within half an interval
    reported_dead: int = 0  # registry entries dropped because a member reported them dead (see _forget_dead)


class Registry:
    """Members the coordinator has heard from recently; silent ones expire.

    Entries are kept in the order they were last heard from (the clock only
    moves forward), so expiring walks only the expired ones. The lists of
    live, dialable and reported members are rebuilt only after a change of
    who is in them or of an entry (a new member, a new incarnation, one
    gone): a report that only says a member is still there, every report
    interval from every member, costs no walk of the whole registry. (It
    did: 1,000 simulated members spent about 6% of their time rebuilding
    these lists, 5M member visits at 500.)
    """

    def __init__(self, expire_after: float, capacity: int) -> None:
        self.expire_after = expire_after
        self.capacity = capacity
        self._seen: dict[str, tuple[Member, float]] = {}  # oldest first
        self._reported: set[str] = set()  # ids that reported themselves (not only joined through us)
        self._unreachable: set[str] = set()  # ids whose own reports say nobody can dial them (behind NAT)
        self._lists: dict[str, list[Member]] = {}  # "alive", "dialable", "reported": until the next change

    def update(self, member: Member, now: float, *, reported: bool = False, reachable: bool = True) -> bool:
        """Record ``member`` as heard from now (``reported``: by itself, which says whether it is ``reachable``);
        False if new and the registry is full."""
        if member.state != ALIVE:
            self._forget(member.id)
            return True
        known = self._seen.get(member.id)
        if known is None and len(self._seen) >= self.capacity and self._expire(now) >= self.capacity:
            return False  # those we know keep their places: a flood of new ids cannot push them out
        if known is None or member.incarnation >= known[0].incarnation:
            self._seen.pop(member.id, None)  # to the end: heard from last
            self._seen[member.id] = (member, now)
            if known is None or (known[0] is not member and known[0] != member):
                self._lists.clear()
        if reported:
            before = (member.id in self._reported, member.id in self._unreachable)
            self._reported.add(member.id)
            (self._unreachable.discard if reachable else self._unreachable.add)(member.id)
            if (True, not reachable) != before:  # newly reported, or its reachability changed
                self._lists.clear()
        return True

    def reported(self, now: float) -> list[Member]:
        """The live members that reported themselves and can be dialled: the ones worth handing to a newcomer
        (do not modify the list)."""
        dialable = self.dialable(now)
        if (out := self._lists.get("reported")) is None:
            out = self._lists["reported"] = [m for m in dialable if m.id in self._reported]
        return out

    def dialable(self, now: float) -> list[Member]:
        """The live members, less those that said nobody can dial them: what a probe or an exchange can reach
        (do not modify the list)."""
        alive = self.alive(now)
        if (out := self._lists.get("dialable")) is None:
            out = self._lists["dialable"] = [
                m for m in alive if m.id not in self._unreachable and not is_client_address(m.addr)
            ]
        return out

    def seen_dead(self, member_id: str, now: float, fresh_for: float) -> bool:
        """A member reported dead: forget it unless it was heard from itself within ``fresh_for`` seconds."""
        known = self._seen.get(member_id)
        if known is None or now - known[1] < fresh_for:
            return False
        self._forget(member_id)
        return True

    def alive(self, now: float) -> list[Member]:
        """The live members, in no particular order (do not modify the list)."""
        self._expire(now)
        if (out := self._lists.get("alive")) is None:
            out = self._lists["alive"] = [m for m, _ in self._seen.values()]
        return out

    def count(self, now: float) -> int:
        return self._expire(now)

    def _expire(self, now: float) -> int:
        """Forget the members silent for longer than ``expire_after``; how many are left."""
        while self._seen:
            mid, (_, seen) = next(iter(self._seen.items()))
            if now - seen <= self.expire_after:
                break
            self._forget(mid)
        return len(self._seen)

    def _forget(self, member_id: str) -> None:
        if self._seen.pop(member_id, None) is not None:
            self._lists.clear()
        self._reported.discard(member_id)
        self._unreachable.discard(member_id)


class Coordinator(JoinAnsweringEndpoint):
    """Bootstraps membership for one run; see the module docstring."""

    def __init__(
        self,
        config: RunConfig,
        transport: Transport,
        clock: Clock = REAL_CLOCK,
        seed: int | None = None,
        spec: ParamSpec | None = None,
    ):
        super().__init__(transport, config.limits, sender="coordinator", fingerprint=config.fingerprint(), stats=CoordinatorStats())
        self.stats: CoordinatorStats
        self.config = config
        self.clock = clock
        self.rng = random.Random(seed)
        # The swarm's model: given when the workload is known (the CLI builds it), else learnt from the first peer
        # (train.workload external) and forgotten once no member is left, so that an empty swarm takes a new one.
        self.spec: ParamSpec | None = spec
        self._spec_given = spec  # the workload's model (its layout open): what an emptied swarm goes back to
        m = config.membership
        self.registry = Registry(3 * m.report_interval + m.suspicion_timeout_max(1), config.limits.registry_members)
        self.report_limiter = JoinLimiter.for_reports(config.limits)
        self._introduced: OrderedDict[str, float] = OrderedDict()  # address -> when we last gossiped to it (bounded)
        self._last_count = 0
        # Queries from tools (gossiptrain export/stop) and stop requests, relayed to the members we know.
        self.finish = FinishEndpoint(config, me="coordinator", members=self.members)
        self.handlers = {kinds.JOIN: self._on_join, kinds.REPORT: self._on_report, **dict.fromkeys(kinds.FINISH, self._on_finish)}
        # Joins come from newcomers that do not know the run; the finish machine checks its own messages' runs.
        self.open_kinds = frozenset((kinds.JOIN, *kinds.FINISH))

    @property
    def address(self) -> str:
        return self.transport.address

    def members(self) -> list[Member]:
        return list(self.registry.alive(self.clock.now()))

    @property
    def member_count(self) -> int:
        """Live members as last counted (every ``membership.report_interval``): safe to read from another thread."""
        return self._last_count

    async def _start(self) -> None:
        await super()._start()  # the receive loop
        self.spawn(self._sweep_loop(), "sweep")

    async def _sweep_loop(self) -> None:
        """Expire silent members regularly, so the count people see is current."""
        while True:
            self._note_count()
            await self.clock.sleep(self.config.membership.report_interval)

    def _note_count(self) -> None:
        count = self.registry.count(self.clock.now())
        if count != self._last_count:
            log.info("%d members alive (from joins and reports)", count)
            self._last_count = count
        if count == 0 and self.spec != self._spec_given:
            self.spec = self._spec_given
            log.info("no member left: the swarm's %s is forgotten; the next member to join sets it",
                     "model" if self._spec_given is None else "layout")
        self._end_stop_if_empty(count)

    def _on_report(self, msg: Message, frames: Sequence[object]) -> None:
        if not self.report_limiter.allow(join_source(self.transport.source_of(frames), msg.addr), self.clock.now()):
            self.stats.reports_throttled += 1  # no registry entry, and no gossip sent to the address it claims
            return
        member = Member.from_wire(msg.body.get("member"))
        if member.id != msg.sender:
            raise ProtocolError("a report must be about its sender")
        self._learn_spec(msg.body.get("spec"))
        self.stats.reports += 1
        now = self.clock.now()
        unreachable = msg.body.get("unreachable", False)
        if type(unreachable) is not bool:
            raise ProtocolError("a report's unreachable must be a bool")
        if not self.registry.update(member, now, reported=True, reachable=not unreachable):
            self.stats.registry_full += 1
            return
        self._forget_dead(msg.body.get("dead"), member.id, now)
        self._note_count()
        self._introduce(member)

    def _forget_dead(self, dead: object, reporter: str, now: float) -> None:
        """Members a report says its sender found dead: not handed out again until they report themselves.

        One that reported within half a report interval stays (its own word
        is newer than the verdict, or the verdict is false); the rest leave
        the registry at once instead of after its expiry (three report
        intervals and a suspicion timeout), so a newcomer is not handed a
        crashed member (a dead predecessor, say) to probe and look to as a
        donor. A member that lies can only have others left out until their
        next report; its reports are rate limited and at most
        ``REPORTED_DEATHS`` names each are read.
        """
        if dead is None:
            return
        if not isinstance(dead, list) or not all(type(d) is str and 0 < len(d) <= 64 for d in dead):
            raise ProtocolError("a report's dead must be a list of member ids")
        for mid in dead[:REPORTED_DEATHS]:
            if mid != reporter and self.registry.seen_dead(mid, now, self.config.membership.report_interval / 2):
                self.stats.reported_dead += 1
                log.info("%s is dead (reported by %s): not handed out until it reports again", mid, reporter)

    def _on_finish(self, msg: Message, frames: Sequence[object]) -> None:
        for a in self.finish.handle(finish_event(msg, self.transport.source_of(frames)), self.clock.now()):
            self.send(a.addr, a.kind, a.body)
        self._end_stop_if_empty(self.registry.count(self.clock.now()))  # a stop of an empty swarm stops nothing

    def _end_stop_if_empty(self, count: int) -> None:
        """A stop ends with the swarm it stopped: once no member is left (or none was), the coordinator no longer
        answers "stopping", and whoever joins next starts afresh, as with a new coordinator."""
        if count == 0 and self.finish.stop is not None:
            self.finish.stop = None
            log.info("no member left: the stop is over; members that join now train their own budget")

    def _introduce(self, reporter: Member) -> None:
        """Answer a report with a few other live members.

        A newcomer welcomed while the registry was empty (its predecessors had
        not reported yet, or had expired while building their models) would
        otherwise know no one; peers that joined alone find each other here,
        at their next report.
        """
        now = self.clock.now()
        alive = self.registry.dialable(now)  # members nobody can dial would only be probed in vain
        if not any(m.id != reporter.id for m in alive[:2]):
            return  # nobody else (the reporter is at most one of them)
        # One introduction per address per half report interval, whoever claims it: an honest member
        # reports once an interval, while reports forged in another's name (from any number of sources,
        # under any number of ids) would otherwise make us gossip to that address once each.
        last = self._introduced.get(reporter.addr)
        if last is not None and now - last < self.config.membership.report_interval / 2:
            self.stats.introductions_skipped += 1
            return
        self._introduced[reporter.addr] = now
        self._introduced.move_to_end(reporter.addr)
        while len(self._introduced) > self.config.limits.registry_members:
            self._introduced.popitem(last=False)
        k = self.config.membership.sample_size
        sample = [m for m in self.rng.sample(alive, min(k + 1, len(alive))) if m.id != reporter.id][:k]
        self.send(reporter.addr, GOSSIP, {"members": [m.to_wire() for m in sample]})

    def _learn_spec(self, raw: object) -> None:
        if raw is not None and (self.spec is None or self.spec.layout == LAYOUT_OPEN):
            theirs = ParamSpec.from_wire(raw)
            self.spec = theirs if self.spec is None else self.spec.with_layout_of(theirs)

    # -- joins (JoinAnsweringEndpoint) --------------------------------------------------------

    def _on_join(self, msg: Message, frames: Sequence[object]) -> None:
        self._note_count()  # first: a swarm left empty since the last sweep takes a new model (see _note_count)
        super()._on_join(msg, frames)

    def _join_sample(self) -> tuple[Sequence[Member], Callable[[int], int]]:
        """Members for a newcomer: those that reported themselves (a flood of joins from made-up addresses
        does not crowd them out), else whoever joined; shards assigned over all of them."""
        now = self.clock.now()
        alive = self.registry.alive(now)
        pool = self.registry.reported(now) or self.registry.dialable(now)
        sample = self.rng.sample(pool, min(self.config.membership.sample_size, len(pool)))
        return sample, lambda shards: least_loaded_shard((m.shard for m in alive), shards)

    def _coordinator_address(self) -> str:
        return self.transport.address

    def _welcomed(self, newcomer: Member, request: JoinRequest) -> None:
        if request.spec is not None:
            self.spec = request.spec if self.spec is None else self.spec.with_layout_of(request.spec)
        if not self.registry.update(newcomer, self.clock.now()):
            self.stats.registry_full += 1  # welcomed all the same: it is recorded once it reports with room
        self._note_count()
