"""The end of a run: stop requests, final-phase notices, and read-only queries from tools outside the swarm.

A run ends for a peer when its budget is spent (``train.max_steps``,
``train.max_seconds``) or when the swarm is asked to stop (``gossiptrain
stop``). The peer then runs a final phase (``FinalPhase``,
``gossiptrain.runtime.final_phase``) on its training thread, taking no more
local steps but still averaging at its safe points:

1. it tells its view it is done (and whether it will write the merged
   model), then waits until every live member is done too, at most
   ``final.wait_seconds``: peers finishing their budgets a little apart
   keep averaging with the ones still training;
2. ``final.consensus_seconds`` of averaging, everyone together, so the
   members end close to one another;
3. a writer (``gossiptrain peer --final-model PATH``) downloads every live
   member's state and writes their average weighted by samples seen
   (``gossiptrain.state.merged_model``), then says so; everyone stays until the
   writers they know of have written or left, at most ``final.merge_seconds``;
4. the peer leaves (announced), and its process exits.

Messages (bodies checked; nothing but small msgpack values):

- ``query`` {}: anyone, no fingerprint needed -> ``roster`` {fingerprint,
  config, members, stopping}: who is alive, as the answerer sees it. Rate
  limited per source like joins. The asker never becomes a member: this is
  how ``gossiptrain export`` and ``gossiptrain stop`` find the swarm.
- ``stop`` {id, reason}: with the run's fingerprint; the swarm finishes. A
  member forwards a stop id it has not seen to every member of its view (a
  flood: every live member hears it within a hop or two); the coordinator
  relays it to the members it knows. A sender outside the view (the tool)
  gets a ``roster`` back as its acknowledgement.
- ``fin`` {phase, writer, done}: the sender is ``done`` (its final phase
  began; ``writer``: it will write the merged model) or has ``written`` it;
  ``done`` (optional): other members it knows to be done. Sent to every
  member of the view, and again every heartbeat interval of the final
  phase, so that a lost message costs one interval. Two client-mode
  members (behind NAT) cannot send each other anything: a done member that
  hears a member is done passes that on to the clients it knows (done or
  not: a done one waits for the rest), and every ``fin`` carries the
  sender's done list. A member that lies about who is done can only end
  others' wait early (as in the rendezvous), never hold anyone back.

``FinishEndpoint`` keeps this state for a ``PeerNode`` (or the coordinator)
on the network thread; the training thread only reads it. It is sans-IO,
like ``gossiptrain.protocol.membership``: ``handle(event, now)`` takes an
event (a message's plain values, built by the runtime, or a local request)
and returns the ``Send`` actions its driver puts on the wire.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from gossiptrain.config import RunConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.address_forms import is_client_address
from gossiptrain.net.kinds import FIN, ROSTER, STOP
from gossiptrain.protocol.admission import JoinLimiter
from gossiptrain.protocol.member import ALIVE, SUSPECT, Member

log = logging.getLogger(__name__)

DONE, WRITTEN = "done", "written"

_ID_LIMIT = 1 << 63
_REASON_CHARS = 200
_REMEMBERED = 4096  # stop ids and member notices kept (bounded state)
_ROSTER_ENTRY_BYTES = 128  # a generous bound on one member's entry in a roster, for the header limit
_DONE_LISTED = 256  # other members a fin names as done, at most (a client needs those it cannot hear from)
_MAX_ID = 64  # as membership's member ids


def new_stop_id(rng: random.Random | None = None) -> int:
    return (rng or random.SystemRandom()).randrange(1, _ID_LIMIT)


@dataclass(frozen=True)
class StopRequest:
    """The swarm was asked to finish: by whom first (a member id, "coordinator", or a tool's name) and why."""

    id: int
    reason: str
    origin: str


@dataclass
class FinishStats:
    queries_answered: int = 0
    queries_throttled: int = 0
    stops_received: int = 0  # stop messages, repeats included
    notices_received: int = 0  # fin messages

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def roster_body(config: RunConfig, members: Sequence[Member], stopping: bool) -> dict[str, Any]:
    """The answer to a query: the run and the live members, suspects included (as many as one message takes)."""
    cap = max(1, min(config.limits.max_container_len, (config.limits.max_header_bytes - 64 * 1024) // _ROSTER_ENTRY_BYTES))
    alive = [m for m in members if m.state in (ALIVE, SUSPECT)][:cap]
    return {
        "fingerprint": config.fingerprint(), "config": config.to_dict(), "members": [m.to_wire() for m in alive],
        "stopping": stopping,
    }


# -- events (the runtime builds them from messages, or from local requests) ----------------------


@dataclass(frozen=True)
class Query:
    """A ``query`` from anyone (no fingerprint needed); ``source`` is what it is rate limited by (its IP, say)."""

    addr: str
    source: str


@dataclass(frozen=True)
class StopNotice:
    """A ``stop`` message: its sender (a member id, or a tool's), where to answer, the run it is for, its body."""

    sender: str
    addr: str
    fingerprint: str
    body: Mapping[str, Any]


@dataclass(frozen=True)
class FinNotice:
    """A ``fin`` message: its sender is done, or has written the merged model."""

    sender: str
    addr: str
    fingerprint: str
    body: Mapping[str, Any]


@dataclass(frozen=True)
class RosterNotice:
    """A ``roster`` message: it answers a query, and members send none, so it is refused."""

    sender: str
    addr: str


@dataclass(frozen=True)
class RequestStop:
    """Stop the swarm: asked locally (``origin`` empty: us), or passed on from a stop message."""

    reason: str
    origin: str = ""
    stop_id: int | None = None  # None: a new one
    came_from: str = ""  # the member it came from, which needs no copy back


@dataclass(frozen=True)
class Announce:
    """Tell the live members of our view that we are done, or wrote the merged model (``everyone=False``: a reminder)."""

    phase: str
    writer: bool
    everyone: bool = True


Event = Query | StopNotice | FinNotice | RosterNotice | RequestStop | Announce


# -- actions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Put a message of ``kind`` with ``body`` on the wire to ``addr``, with our fingerprint."""

    addr: str
    kind: str
    body: dict[str, Any]


Action = Send


class FinishEndpoint:
    """Stop requests, fin notices and queries for one member, or for the coordinator.

    ``handle(event, now)`` returns the messages to send. ``members()`` are
    the members we know (our membership's alive ones, or the coordinator's
    registry): read, never changed, at each event.
    """

    def __init__(self, config: RunConfig, *, me: str, members: Callable[[], Sequence[Member]]) -> None:
        self.config = config
        self.fingerprint = config.fingerprint()
        self.me = me
        self._members = members
        self.stop: StopRequest | None = None  # written on the network thread, read by the training thread
        self.done: dict[str, bool] = {}  # member -> whether it will write the merged model; those in a final phase
        self.written: set[str] = set()  # members that wrote the merged model
        self.stats = FinishStats()
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._limiter = JoinLimiter.from_limits(config.limits)

    def handle(self, event: Event, now: float) -> list[Action]:
        """Handle one event; ProtocolError if a message is malformed (or a roster, which is not for us)."""
        out: list[Action] = []
        if isinstance(event, Query):
            if not self._limiter.allow(event.source, now):
                self.stats.queries_throttled += 1
                return out
            self.stats.queries_answered += 1
            out.append(Send(event.addr, ROSTER, roster_body(self.config, self._members(), self.stop is not None)))
        elif isinstance(event, RosterNotice):
            raise ProtocolError("a roster answers a query; members send none")
        elif isinstance(event, (StopNotice, FinNotice)):
            if event.fingerprint != self.fingerprint:
                raise ProtocolError("a stop or fin of another run")
            if isinstance(event, StopNotice):
                self._on_stop(event, out)
            else:
                self._on_fin(event, out)
        elif isinstance(event, RequestStop):
            self._request_stop(event.reason, event.origin, event.stop_id, event.came_from, out)
        elif isinstance(event, Announce):
            self._announce(event.phase, event.writer, event.everyone, out)
        return out

    # -- messages ------------------------------------------------------------------------------

    def _on_stop(self, event: StopNotice, out: list[Action]) -> None:
        body = event.body
        sid, reason = body.get("id"), body.get("reason")
        if type(sid) is not int or not 0 < sid < _ID_LIMIT or not isinstance(reason, str):
            raise ProtocolError("stop needs an int id in [1, 2**63) and a str reason")
        self.stats.stops_received += 1
        members = list(self._members())
        if not any(m.id == event.sender for m in members):
            # A tool (or a member we do not know yet): acknowledge with what we know, so it can report it.
            out.append(Send(event.addr, ROSTER, roster_body(self.config, members, True)))
        self._request_stop(reason[:_REASON_CHARS], event.sender or event.addr, sid, event.sender, out)

    def _on_fin(self, event: FinNotice, out: list[Action]) -> None:
        phase, writer, listed = event.body.get("phase"), event.body.get("writer"), event.body.get("done", [])
        if phase not in (DONE, WRITTEN) or type(writer) is not bool or not event.sender:
            raise ProtocolError("fin needs phase done or written and a bool writer")
        if not isinstance(listed, list) or len(listed) > _DONE_LISTED or not all(
            type(i) is str and 0 < len(i) <= _MAX_ID for i in listed
        ):
            raise ProtocolError(f"a fin's done lists at most {_DONE_LISTED} member ids")
        self.stats.notices_received += 1
        news = [] if event.sender in self.done else [event.sender]
        self._note(event.sender, phase, writer)
        for member in listed:
            if member not in self.done and member != self.me:
                news.append(member)
                self._note(member, DONE, False)
        if news and self.me in self.done:
            # Clients that cannot hear it from those (behind NAT, as they may be) hear it from us.
            self._pass_on(news, skip=event.sender, out=out)

    def _pass_on(self, news: list[str], skip: str, out: list[Action]) -> None:
        body = {"phase": DONE, "writer": self.done[self.me], "done": news[:_DONE_LISTED]}
        for m in self._members():  # done ones too: they wait for everyone else to be done
            if m.state == ALIVE and m.id != skip and m.id not in news and is_client_address(m.addr):
                out.append(Send(m.addr, FIN, body))

    def _note(self, member: str, phase: str, writer: bool) -> None:
        self.done[member] = self.done.get(member, False) or writer
        if phase == WRITTEN:
            self.written.add(member)
        while len(self.done) > _REMEMBERED:  # bounded: the oldest notices go first
            oldest = next(iter(self.done))
            del self.done[oldest]
            self.written.discard(oldest)

    # -- local requests --------------------------------------------------------------------------

    def _request_stop(self, reason: str, origin: str, stop_id: int | None, came_from: str, out: list[Action]) -> None:
        """Mark the swarm as stopping and pass the request on to everyone we know, unless we had it already."""
        sid = stop_id if stop_id is not None else new_stop_id()
        if sid in self._seen:
            return
        self._seen[sid] = None
        while len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)
        if self.stop is None:
            self.stop = StopRequest(sid, reason, origin or self.me)
            log.warning("stop requested by %s (%s): finishing the run", self.stop.origin, reason)
        body = {"id": sid, "reason": reason}
        for m in self._members():
            if m.state == ALIVE and m.id not in (self.me, came_from):
                out.append(Send(m.addr, STOP, body))

    def _announce(self, phase: str, writer: bool, everyone: bool, out: list[Action]) -> None:
        """Tell the live members of our view that we are done, or wrote the merged model.

        ``everyone=False`` (a reminder) tells only those that have not said
        they are done themselves: a newcomer, or one that missed a message;
        once all are done a reminder costs nothing, however big the swarm.
        """
        self._note(self.me, phase, writer)
        targets = [m for m in self._members() if m.state == ALIVE and m.id != self.me and (everyone or m.id not in self.done)]
        others = [m for m in self.done if m != self.me][-_DONE_LISTED:]
        body: dict[str, Any] = {"phase": phase, "writer": writer, **({"done": others} if others else {})}
        for m in targets:
            out.append(Send(m.addr, FIN, body))
            if self.stop is not None:  # the stop again, for members that joined since or missed it
                out.append(Send(m.addr, STOP, {"id": self.stop.id, "reason": self.stop.reason}))
