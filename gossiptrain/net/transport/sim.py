"""The simulated backend: ``sim://`` transports on one event loop, joined by a modelled network.

The simulator runs many peers in one process on one (usually virtual-time)
event loop. Their transports talk through a ``SimNetwork`` that models each
directed link's latency, bandwidth, loss and jitter, plus partitions, and
delivers with ``loop.call_at``. Only the running loop's clock is read, so the
same code runs unchanged on a real loop and on the virtual one, and with the
network's own seeded RNG a run is reproducible.

Messages are copied at send and checked against the receiver's limits at
delivery, as tcp:// does, so nothing above the transport can tell the two
apart except by timing. There are no connections: ``reply`` sends back along
the link to the sender's address (every simulated transport can be dialled,
and a partition cuts both ways). A client-mode transport (``become_client``,
a peer behind NAT) is the exception: it is reached only from addresses it
has sent to, as over the connections a real one opens (its routes).

Fate of a message sent with ``SimTransport.send`` (each outcome is counted
once in ``SimNetwork.stats``):

- refused at send (``send`` returns False, sender's ``send_dropped``):
  nothing listens at the destination now, the link's send queue is full,
  or the destination is a client that never sent to the sender;
- ``partitioned``: sender and destination are on different sides of a
  partition at send time; the message never leaves;
- ``lost``: dropped on the wire with the link's ``loss`` probability (it
  still used the link's bandwidth);
- ``unreachable``: the transport that listened when it was sent has closed
  (crashed, or restarted at the same address) by the time it arrives;
- ``inbox_full``: the receiver's inbox is full on arrival;
- ``oversize``: breaks the receiver's limits (receiver's ``oversize_dropped``);
- ``delivered``: put into the receiver's inbox.

Partitions and loss cannot be seen by the sender (``send`` returned True);
``unreachable`` and ``inbox_full`` are also added to the sender's
``send_dropped``, like tcp's messages that never got through.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import threading
import re
import types
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Collection, Iterator, Literal, Mapping, Sequence

from gossiptrain.config import Limits
from gossiptrain.errors import ConfigError
from gossiptrain.net.address_forms import CLIENT_PATH, is_client_address
from gossiptrain.net.transport.base import RELAY_PREFIX, RELAYED_PREFIX, Transport, oversize

log = logging.getLogger(__name__)

#: The network ``listen("sim://...")`` attaches to; the simulator sets it and
#: asyncio tasks inherit it with their context.
current_network: ContextVar[SimNetwork] = ContextVar("gossiptrain_sim_network")

#: Ports handed out for ``sim://name:0`` start here (like an ephemeral range).
FIRST_PORT = 40000

#: What became of a message that reached its destination: a ``NetworkStats`` field.
Outcome = Literal["delivered", "inbox_full", "oversize"]

_URL = re.compile(r"sim://([A-Za-z0-9_.-][A-Za-z0-9_.:-]*)")


@dataclass(frozen=True)
class LinkProfile:
    """How one directed link behaves; the same profile both ways unless set otherwise."""

    latency: float = 0.0005  # seconds one way, after the last byte is sent
    bandwidth: float = 1.0e9  # bytes/s; a message of B bytes holds the link for B/bandwidth (inf: no cost)
    loss: float = 0.0  # probability that a message is dropped on the wire
    jitter: float = 0.0  # extra latency, uniform in [0, jitter] seconds; never reorders a link

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ConfigError(f"link.{f.name} must be a number, got {value!r}")
        _require(math.isfinite(self.latency) and self.latency >= 0, "latency", "must be >= 0 and finite", self.latency)
        _require(self.bandwidth > 0, "bandwidth", "must be > 0 (bytes/s; inf for no cost)", self.bandwidth)
        _require(0.0 <= self.loss <= 1.0, "loss", "must be in [0, 1]", self.loss)
        _require(math.isfinite(self.jitter) and self.jitter >= 0, "jitter", "must be >= 0 and finite", self.jitter)


def _require(ok: bool, name: str, message: str, value: float) -> None:
    if not ok:
        raise ConfigError(f"link.{name} {message}, got {value!r}")


@dataclass
class NetworkStats:
    """What became of every message the network accepted (see the module docstring)."""

    sent: int = 0  # accepted: send returned True
    refused: int = 0  # send returned False: unknown destination or link queue full
    delivered: int = 0
    lost: int = 0
    partitioned: int = 0
    unreachable: int = 0
    inbox_full: int = 0
    oversize: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def settled(self) -> int:
        """Accepted messages whose fate is known; ``sent - settled()`` are in flight."""
        return self.delivered + self.lost + self.partitioned + self.unreachable + self.inbox_full + self.oversize


class Arrived(list):  # type: ignore[type-arg]
    """One message's frames as the receiver gets them, and the address that sent them (what ``reply`` answers)."""

    __slots__ = ("origin",)
    origin: str


@dataclass(eq=False, slots=True)
class _InFlight:
    target: SimTransport
    frames: Arrived
    nbytes: int
    sender: SimTransport | None


@dataclass(eq=False, slots=True)
class _Link:
    """The state of one directed link: when its transmitter is free, and what is on the wire.

    Held only while a message is on it or leaving its transmitter: an idle link behaves as a fresh one (it is
    free now and its last message has arrived), and a swarm's members all end up talking to each other (n^2
    links; two empty queues each were 1.7 KB of the 2.7 KB a view entry cost, membership only).
    """

    key: tuple[str, str]  # (source address, destination address)
    free_at: float = 0.0
    last_arrival: float = 0.0
    sending_until: deque[float] | None = None  # end of transmission, per queued message
    wire: deque[_InFlight] | None = None  # in arrival order


def _copies(frames: Sequence[bytes | memoryview]) -> list[bytes]:
    """Each frame as bytes: a copy of a buffer the sender may reuse, the same object for an immutable bytes."""
    return [f if type(f) is bytes else bytes(f) for f in frames]


class SimNetwork:
    """Links between ``sim://`` addresses on one event loop, with a seeded RNG for loss and jitter."""

    def __init__(self, default: LinkProfile = LinkProfile(), seed: int = 0) -> None:
        self.default = default
        self.stats = NetworkStats()
        self._rng = random.Random(seed)
        self._profiles: dict[tuple[str, str], LinkProfile] = {}
        self._links: dict[tuple[str, str], _Link] = {}  # the links with a message on them (see _Link)
        self._transports: dict[str, SimTransport] = {}
        self._routes: set[tuple[str, str]] = set()  # (address, client address): the client has sent to address
        self._groups: dict[str, int] = {}
        self._next_port = FIRST_PORT
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0  # the thread _loop was last seen running on

    # -- configuration ---------------------------------------------------------------------

    @contextlib.contextmanager
    def activate(self) -> Iterator[SimNetwork]:
        """Make ``listen("sim://...")`` use this network within the block (and tasks started in it)."""
        token = current_network.set(self)
        try:
            yield self
        finally:
            current_network.reset(token)

    def set_link(self, a: str, b: str, profile: LinkProfile, both_ways: bool = True) -> None:
        """Give the link a -> b (and b -> a unless ``both_ways`` is False) its own profile.

        Takes effect for messages sent from now on; those in flight keep their arrival time.
        """
        self._profiles[(a, b)] = profile
        if both_ways:
            self._profiles[(b, a)] = profile

    def link(self, a: str, b: str) -> LinkProfile:
        """The profile of the directed link a -> b."""
        return self._profiles.get((a, b), self.default)

    def partition(self, groups: Sequence[Collection[str]]) -> None:
        """Cut the network: addresses in different groups cannot reach each other.

        Replaces any earlier partition. An address in no group is not cut off
        from anyone. Checked at send time: messages already in flight arrive.
        """
        where: dict[str, int] = {}
        for i, group in enumerate(groups):
            for address in group:
                if where.setdefault(address, i) != i:
                    raise ConfigError(f"partition groups overlap: {address!r} is in groups {where[address]} and {i}")
        self._groups = where

    def heal(self) -> None:
        """Undo ``partition``: everyone can reach everyone again."""
        self._groups = {}

    def reachable(self, src: str, dst: str) -> bool:
        """Whether the current partition lets ``src`` reach ``dst``."""
        a, b = self._groups.get(src), self._groups.get(dst)
        return a is None or b is None or a == b

    @property
    def transports(self) -> Mapping[str, SimTransport]:
        """The transports listening now, by address (read-only)."""
        return types.MappingProxyType(self._transports)

    @property
    def links_held(self) -> int:
        """Directed links whose state is kept: those with a message on them, between open transports."""
        return len(self._links)

    @property
    def in_flight(self) -> int:
        """Messages accepted and not yet arrived."""
        return self.stats.sent - self.stats.settled()

    # -- delivery --------------------------------------------------------------------------

    def deliver(self, src: str, dst: str, frames: Sequence[bytes | memoryview], nbytes: int) -> bool:
        """Put one message on the link src -> dst; False (refused) if it cannot be accepted.

        Refused when nothing listens at ``dst`` now, or when the link already
        has the sender's ``limits.send_queue_messages`` messages waiting to be
        transmitted (ZeroMQ's SNDHWM: a slow link pushes back). Otherwise
        accepted: partition and loss are decided now, and the message arrives
        at max(now, link free) + nbytes / bandwidth + latency (+ jitter), never
        before an earlier message on the same link.
        """
        loop = self._bind_loop()
        now = loop.time()
        target = self._transports.get(dst)
        sender = self._transports.get(src)
        if target is None:
            self.stats.refused += 1
            return False
        key = (src, dst)
        if CLIENT_PATH in dst and is_client_address(dst) and key not in self._routes:
            self.stats.refused += 1  # nobody dials a client: only what it sent to can answer it
            return False
        if CLIENT_PATH in src and is_client_address(src):
            self._routes.add((dst, src))
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = _Link(key, free_at=now, last_arrival=now)
        queued = link.sending_until
        if queued is not None:
            while queued and queued[0] <= now:
                queued.popleft()
            if not queued:
                queued = link.sending_until = None
            elif sender is not None and len(queued) >= sender.limits.send_queue_messages:
                self.stats.refused += 1
                return False
        self.stats.sent += 1
        if self._groups and not self.reachable(src, dst):  # no partition (the usual case): no lookups
            self.stats.partitioned += 1
            return True
        profile = self._profiles.get(key, self.default)  # self.link(src, dst), without the call
        link.free_at = max(now, link.free_at) + nbytes / profile.bandwidth
        if queued is None:
            queued = link.sending_until = deque()
        queued.append(link.free_at)
        # Draw only for features in use: a lossless, jitter-free run takes no
        # randomness, and one RNG in send order keeps every run reproducible.
        if profile.loss > 0 and self._rng.random() < profile.loss:
            self.stats.lost += 1
            return True
        arrival = link.free_at + profile.latency
        if profile.jitter > 0:
            arrival += self._rng.uniform(0.0, profile.jitter)
        # FIFO per link, as over a TCP connection: jitter delays, never reorders.
        arrival = link.last_arrival = max(arrival, link.last_arrival)
        # What arrives is a copy as of now (the sender may reuse a tensor's memory once sent); a bytes frame
        # (every header) is immutable already.
        copies = Arrived(frames if len(frames) == 1 and type(frames[0]) is bytes else _copies(frames))
        copies.origin = src
        if link.wire is None:
            link.wire = deque()
        link.wire.append(_InFlight(target, copies, nbytes, sender))
        loop.call_at(arrival, self._arrive, link)
        return True

    def _arrive(self, link: _Link) -> None:
        # Each timer takes the head, not "its own" message: timers at equal
        # times may fire in any order, the head is always the earliest.
        wire = link.wire
        assert wire is not None  # one timer per message on it
        item = wire.popleft()
        if not wire:  # nothing on the wire: every message sent on it has left the transmitter, unless one was lost
            link.wire = None
            if self._loop is not None and link.free_at <= self._loop.time() and self._links.get(link.key) is link:
                del self._links[link.key]  # idle: the next message starts a fresh link, which behaves the same
        target = item.target
        if self._transports.get(target.address) is not target:
            self.stats.unreachable += 1
            if item.sender is not None:
                item.sender.stats.send_dropped += 1
            return
        outcome = target._accept(item.frames, item.nbytes)
        if outcome == "inbox_full" and item.sender is not None:
            item.sender.stats.send_dropped += 1
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop; a network serves one loop at a time (link times are in its clock)."""
        bound = self._loop
        if bound is not None and self._thread == threading.get_ident() and bound.is_running():
            return bound  # without get_running_loop's process-id system call, at every message
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            self._thread = threading.get_ident()
            return loop
        if self._loop is not None and not self._loop.is_closed() and (self._transports or self.in_flight):
            raise RuntimeError("this SimNetwork is in use on another event loop")
        # A closed loop's timers never fire and its transports can never close:
        # what was on the wire is lost, and their addresses are free again.
        self.stats.unreachable += sum(len(link.wire) for link in self._links.values() if link.wire)
        self._links.clear()
        self._routes.clear()
        self._transports.clear()
        self._loop = loop
        self._thread = threading.get_ident()
        return loop

    # -- membership of transports ----------------------------------------------------------

    def _register(self, transport: SimTransport, url: str) -> str:
        self._bind_loop()
        name = url.removeprefix("sim://")
        host, sep, port = name.rpartition(":")
        if sep and port == "0":
            while f"sim://{host}:{self._next_port}" in self._transports:
                self._next_port += 1
            address = f"sim://{host}:{self._next_port}"
            self._next_port += 1
        else:
            address = url
        if address in self._transports:
            raise ConfigError(f"cannot listen on {url}: address in use")
        self._transports[address] = transport
        return address

    def _unregister(self, transport: SimTransport) -> None:
        if self._transports.get(transport.address) is transport:
            del self._transports[transport.address]
            self._forget_links(transport.address)

    def _forget_links(self, address: str) -> None:
        """Drop the links to and from ``address``, whose transport closed (what is on their wire still arrives, or
        is counted unreachable: its timers hold the link), and the routes a client there had opened."""
        # (simulated churn opens new addresses for ever: nothing of a closed one may stay.) Only the links with a
        # message on them are held, and only clients open routes: both are few.
        for key in [key for key in self._links if address in key]:
            del self._links[key]
        if self._routes:
            self._routes = {route for route in self._routes if address not in route}

    def _move(self, transport: SimTransport, address: str) -> None:
        """``transport`` is known at ``address`` from now on (it became a client); its old address is free."""
        if address in self._transports:
            raise ConfigError(f"cannot become {address}: address in use")
        self._unregister(transport)
        self._transports[address] = transport

    def routed(self, src: str, client: str) -> bool:
        """Whether the client-mode transport at ``client`` has sent to ``src`` (so ``src`` can reach it)."""
        return (src, client) in self._routes


class SimTransport(Transport):
    """Transport on a ``SimNetwork``; ``url`` is sim://NAME, and sim://NAME:0 gets a fresh port.

    The network is ``network`` if given, else the one active in this context
    (``SimNetwork.activate``), looked up here so ``listen`` fails early.
    """

    # Receivers check every message (``wire.decode``); checking it at the sender as well, as real
    # peers do for a clear error, would double the simulator's cost of each message for nothing new.
    check_sends = False

    def __init__(self, url: str, limits: Limits, *, network: SimNetwork | None = None) -> None:
        if not _URL.fullmatch(url):
            raise ConfigError(f"invalid transport URL {url!r}: expected sim://NAME (letters, digits, _.:-; NAME:0 picks a port)")
        if network is None:
            network = current_network.get(None)
            if network is None:
                raise ConfigError(
                    f"cannot listen on {url!r}: sim:// needs a simulated network "
                    "(gossiptrain.sim sets one up; or use SimNetwork.activate())"
                )
        super().__init__(url, limits)
        self.network = network
        self._url = url

    async def _start(self) -> None:
        self.address = self.network._register(self, self._url)
        log.debug("listening on %s", self.address)

    async def _close(self) -> None:
        # Unregistered first: whatever is still in flight to us is counted unreachable.
        self.network._unregister(self)
        self.inbox.close()

    def _send(self, address: str, message: list[bytes | memoryview], nbytes: int) -> bool:
        if self.relay is not None and CLIENT_PATH in address and not self._routed(address) and is_client_address(address):
            target = RELAY_PREFIX + address.encode()  # another client: through our relay, as tcp:// does
            message, nbytes, address = [target, *message], nbytes + len(target), self.relay
        if not self.network.deliver(self.address, address, message, nbytes):
            return False
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes
        if CLIENT_PATH in address and is_client_address(address):
            self.stats.sent_over_routes += 1
        return True

    def _reply(self, received: Sequence[object], message: list[bytes | memoryview], nbytes: int) -> bool:
        # No connections: an answer travels the link back to the sender's address, which every
        # simulated peer can be dialled at (a partition cuts both ways).
        origin = received.origin if isinstance(received, Arrived) else None
        return origin is not None and self._send(origin, message, nbytes)

    def forget(self, address: str) -> None:
        # No connection to tear down: links hold no per-destination state worth dropping.
        pass

    def _became_client(self, address: str) -> None:
        self.network._move(self, address)
        self.address = address

    def _pass_on(self, frames: Arrived, nbytes: int) -> None:
        """As a relay: pass a client's message on to the client its relay frame names (see tcp://'s)."""
        target = frames[0][len(RELAY_PREFIX):].decode(errors="replace")
        origin = frames.origin
        budget = self.relaying
        now = asyncio.get_running_loop().time()
        if (
            budget is None
            or not is_client_address(origin)
            or not self._routed(target)
            or not budget.take(nbytes, now)
            or not self.network.deliver(self.address, target, [RELAYED_PREFIX + origin.encode(), *frames[1:]], nbytes)
        ):
            self.stats.relay_dropped += 1
            return
        self.stats.relayed += 1

    def _routed(self, address: str) -> bool:
        return self.network.routed(self.address, address)

    def _accept(self, frames: Arrived, nbytes: int) -> Outcome:
        """Take one arriving message; the ``NetworkStats`` field that says what became of it."""
        if oversize(self.limits, [len(f) for f in frames]):
            self.stats.oversize_dropped += 1
            return "oversize"
        if frames[0].startswith(RELAY_PREFIX):
            self._pass_on(frames, nbytes)
            return "delivered"  # to us, the relay
        if frames[0].startswith(RELAYED_PREFIX):
            del frames[0]  # another client's, through our relay
            self.stats.received_relayed += 1
        if not self.inbox.put_nowait(frames):
            return "inbox_full"
        self.stats.messages_received += 1
        self.stats.bytes_received += nbytes
        if self.client_as is not None:  # nobody could have dialled us: it came over a route of ours
            self.stats.received_over_own += 1
        return "delivered"
