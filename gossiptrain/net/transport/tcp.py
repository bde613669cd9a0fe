"""The real network backend: ZeroMQ over TCP (IPv4 and IPv6), on asyncio or uvloop.

One ROUTER socket receives from everyone; one DEALER per destination sends,
created on first use, at most ``limits.max_connections`` of them (the least
recently used is closed first). ZeroMQ gives us framing, reconnection and per-pipe
queues; this module adds what it lacks for untrusted peers: limits checked
frame by frame, drops counted instead of raised, and a bounded wait for a
new destination to connect (ZMQ_IMMEDIATE would otherwise refuse the first
message to every new peer). An answer that must reach a sender nobody can
dial (``reply``: a joiner behind NAT) goes back through the ROUTER over the
connection the message came on, and the sender's DEALER reads it when it
asked to (``send(replies=True)``), with the same checks.

A client-mode transport (``become_client``: behind NAT, nobody can dial it)
puts one more frame in front of every message, ``ROUTE_PREFIX`` and its
client address. A ROUTER that reads one remembers the connection it came on
as its route to that address (in a secure swarm only where the connection's
CURVE key is the key in the address), strips the frame, and from then on
sends whatever it has for that address over the route instead of dialling.
The frame rides on every message, so a route follows the client across a
reconnection at its first message; a route whose connection has gone fails
its sends (ROUTER_MANDATORY), which is how a dead client is noticed.

Two clients cannot reach each other. A client with a relay (``use_relay``:
the coordinator, which every client holds a connection to) sends what it
has for another client to the relay, behind a ``RELAY_PREFIX`` frame naming
the target; a transport that ``serve_as_relay`` passes it on over its
route to the target, behind a ``RELAYED_PREFIX`` frame naming the client it
came from (the one its route frame names), within its byte budget; the
target strips that frame and reads the message as any other. In a secure
swarm the sender seals what goes through a relay for the target alone
(``gossiptrain.net.sealed``): the relay passes ciphertext, and the target
drops anything that does not open.

With a ``SecurityConfig`` the transport is secure (CURVE): the ROUTER is a
CURVE server that admits only client keys in the allow-list directory
(checked by pyzmq's ZAP authenticator, with ZAP_ENFORCE_DOMAIN so that a
missing authenticator fails closed), and each DEALER is a CURVE client with
our own keypair. A client must know the public key of the server it dials,
so a secure transport's address carries it: ``tcp://host:port?curve=<64 hex
digits>`` (hex, because Z85 text contains ``?``, ``#`` and ``/``). Layers
above keep addresses as opaque strings; only ``_connect`` reads the key.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from gossiptrain.config import Limits, SecurityConfig
from gossiptrain.errors import ConfigError
from gossiptrain.net import sealed
from gossiptrain.net.addressing import CURVE_QUERY, curve_address, is_client_address, split_curve_address
from gossiptrain.net.keys import CurveKeys, load_curve
from gossiptrain.net.transport.base import RELAY_PREFIX, RELAYED_PREFIX, Transport
from gossiptrain.net.transport.incoming import IncomingGuard, descriptor_budget, peer_of, shut_down

log = logging.getLogger(__name__)

#: ZMQ_MAXMSGSIZE is set this far above limits.max_frame_bytes. A frame over
#: MAXMSGSIZE makes libzmq drop the whole connection (and the messages behind
#: it); a frame a little over the limit is instead read and dropped here, counted.
MAXMSGSIZE_SLACK = 4096

#: On close, queued messages (a leave announcement, say) get this long to go out;
#: the context's termination waits at most this, so close stays prompt.
CLOSE_LINGER_MS = 200

#: Seconds a new destination has to connect before its first messages are dropped.
DEFAULT_CONNECT_TIMEOUT = 2.0

#: The first frame of a client-mode member's messages starts with this, then its client address (UTF-8):
#: not a wire header, whose first byte is a msgpack map or array.
ROUTE_PREFIX = b"\x00route\x00"
#: Longest client address a route frame may name (as membership's addresses).
MAX_ROUTE_ADDRESS = 512

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# One context per transport, so this inproc name cannot collide.
_MONITOR_ENDPOINT = "inproc://handshakes"
# While a new destination connects, its handshake events say why it failed, for error messages.
_CONNECT_EVENTS = _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED

_Message = tuple[list[bytes | memoryview], int]  # frames, total bytes


class ReceivedFrames(list):  # type: ignore[type-arg]
    """The frames of one received message, the IP its connection came from (ZeroMQ's Peer-Address), and its route.

    ``route``: the ROUTER's id of the connection it came in on, which ``reply``
    answers over; None for a reply that came back to one of our DEALERs.
    """

    __slots__ = ("source", "key", "route")

    def __init__(
        self, frames: list[memoryview], source: str | None, key: bytes | None = None, route: bytes | None = None
    ) -> None:
        super().__init__(frames)
        self.source = source
        self.key = key  # the sender's CURVE public key (Z85), as the handshake proved it; None when not secure
        self.route = route


@dataclass(eq=False)
class _Destination:
    socket: zmq.asyncio.Socket
    # Messages waiting for the first connection; None once it is settled
    # (connected, or given up on), after which sends go straight to ZeroMQ.
    pending: deque[_Message] | None = field(default_factory=deque)
    connecting: asyncio.Task[None] | None = None
    monitor: zmq.asyncio.Socket | None = None  # handshake events, while connecting
    failure: str | None = None  # why the handshake failed, if it did
    replies: asyncio.Task[None] | None = None  # reads what the destination sends back (``send(replies=True)``)


def check_url(url: str) -> None:
    """Raise ConfigError unless ``url`` is tcp://host:port (IPv6 hosts in brackets)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"invalid transport URL {url!r}: {e}") from None
    if (
        parts.scheme != "tcp"
        or not parts.hostname
        or port is None
        or parts.path
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ConfigError(f"invalid transport URL {url!r}: expected tcp://host:port (port 0 picks a free one)")


def _unmap_ipv4(endpoint: str) -> str:
    """tcp://[::ffff:10.0.0.1]:7070 -> tcp://10.0.0.1:7070.

    With ZMQ_IPV6 on (needed for IPv6 hosts), libzmq reports IPv4 binds as
    IPv4-mapped IPv6; peers should be given the plain form.
    """
    parts = urlsplit(endpoint)
    try:
        mapped = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return endpoint
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        return f"tcp://{mapped.ipv4_mapped}:{parts.port}"
    return endpoint


class TcpTransport(Transport):
    """Transport over ZeroMQ; ``url`` is the address to bind, e.g. tcp://0.0.0.0:7070.

    With ``security`` it is secure (see the module docstring): the keys are
    read here, so a bad key file is a ConfigError before anything listens.
    """

    def __init__(
        self,
        url: str,
        limits: Limits,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        security: SecurityConfig | None = None,
    ) -> None:
        check_url(url)
        if not connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be > 0, got {connect_timeout}")
        super().__init__(url, limits)
        self.connect_timeout = connect_timeout
        self.curve: CurveKeys | None = load_curve(security) if security is not None else None
        self.port = 0  # the bound port, once started
        self._url = url
        self._ctx: zmq.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._auth: ThreadAuthenticator | None = None
        # Outgoing connections, least recently used first (at most limits.max_connections)
        self._destinations: OrderedDict[str, _Destination] = OrderedDict()
        self._monitors = itertools.count()
        # Client-mode members' routes: their address -> the ROUTER id of the connection they last sent on.
        self._routes: OrderedDict[str, bytes] = OrderedDict()
        self._route_frame: bytes | None = None  # ours, once we are a client (``become_client``)
        # Secure clients: the numbers on what we seal for a relay, and the last one each sender's carried.
        self._sealed_numbers = sealed.Counter()
        self._sealed_seen = sealed.Seen()
        self.incoming = IncomingGuard(limits.incoming_per_source, limits.max_incoming)  # bounds set again at start

    def source_of(self, frames: Sequence[object]) -> str | None:
        """The IP the connection a received message came on was from (ZeroMQ's Peer-Address)."""
        return frames.source if isinstance(frames, ReceivedFrames) else None

    def key_of(self, frames: Sequence[object]) -> bytes | None:
        """The CURVE public key (Z85) the connection a received message came on proved; None when not secure."""
        return frames.key if isinstance(frames, ReceivedFrames) else None

    def accepts_key(self, public_key: bytes | None) -> bool:
        """Whether a handshake from ``public_key`` passes our allow-list (always, when not secure)."""
        return self.curve is None or public_key in self.curve.allowed

    def reachable_at(self, url: str) -> str:
        """``url`` (this endpoint under another host name, e.g. the advertised one) as others must dial it."""
        return curve_address(url, self.curve.public) if self.curve is not None else url

    @property
    def open_connections(self) -> int:
        """Outgoing connections open now (at most ``limits.max_connections``)."""
        return len(self._destinations)

    def connect_failure(self, address: str) -> str | None:
        """Why the handshake with ``address`` failed (wrong key, not allowed, ...), if it did."""
        dest = self._destinations.get(address)
        return dest.failure if dest is not None else None

    # -- lifecycle -------------------------------------------------------------------------

    async def _start(self) -> None:
        self._ctx = zmq.Context()
        router = self._router = self._ctx.socket(zmq.ROUTER, socket_class=zmq.asyncio.Socket)
        router.setsockopt(zmq.IPV6, 1)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, self.limits.inbox_messages)
        router.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + MAXMSGSIZE_SLACK)
        router.setsockopt(zmq.HANDSHAKE_IVL, int(self.limits.handshake_seconds * 1000))
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply over a connection that is gone fails, and is counted
        if self.curve is not None:
            self._start_curve_server(router, self.curve)
        try:
            router.bind(self._url)
        except zmq.ZMQError as e:
            raise ConfigError(f"cannot listen on {self._url}: {e.strerror}") from None
        plain = _unmap_ipv4(router.getsockopt_string(zmq.LAST_ENDPOINT))
        self.port = urlsplit(plain).port or 0
        self.address = self.reachable_at(plain)
        self.incoming = IncomingGuard(
            self.limits.incoming_per_source,
            descriptor_budget(self.limits.max_incoming, self.limits.max_connections),
            still_from=lambda fd, source: peer_of(fd, self.port) == source,
        )
        router.monitor(_MONITOR_ENDPOINT, _HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor = self._ctx.socket(zmq.PAIR, socket_class=zmq.asyncio.Socket)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(_MONITOR_ENDPOINT)
        self.spawn(self._read(), "read")
        self.spawn(self._count_handshake_failures(), "monitor")
        log.debug("listening on %s%s", self.address, " (CURVE)" if self.curve else "")

    def _start_curve_server(self, router: zmq.asyncio.Socket, curve: CurveKeys) -> None:
        """Make ``router`` a CURVE server whose clients the ZAP authenticator checks (before bind)."""
        assert self._ctx is not None
        # The authenticator binds inproc://zeromq.zap.01 in our own context, so transports never share one.
        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".zap"))
        self._auth.start()
        self._auth.configure_curve(domain=curve.domain, location=curve.allow_dir)
        if not self._auth.certs.get(curve.domain):  # pyzmq logs, rather than raises, a failed load
            raise ConfigError(f"security.allow_dir {curve.allow_dir}: no public key could be loaded")
        router.curve_server = True
        router.curve_secretkey = curve.secret
        router.curve_publickey = curve.public
        router.zap_domain = curve.domain.encode()
        # Fail closed: with no ZAP handler answering, refuse every client instead of admitting all.
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    async def _close(self) -> None:
        self.inbox.close()
        for address in list(self._destinations):
            self._drop(address, linger_ms=CLOSE_LINGER_MS)
        if self._router is not None:
            if self._monitor is not None:
                self._router.disable_monitor()
                self._monitor.close(linger=0)
            self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()  # joins its thread; it closes its sockets
            self._auth = None
        if self._ctx is not None:
            # Sockets are closed with LINGER 0 or CLOSE_LINGER_MS, so this
            # returns promptly even with messages queued to dead peers.
            self._ctx.term()
        self._router = self._monitor = self._ctx = None

    # -- sending ---------------------------------------------------------------------------

    def _became_client(self, address: str) -> None:
        self._route_frame = ROUTE_PREFIX + address.encode()

    def _routed(self, address: str) -> bool:
        return address in self._routes

    def _send(self, address: str, message: list[bytes | memoryview], nbytes: int) -> bool:
        if is_client_address(address):  # nobody can dial it: over the connection it opened to us, or a relay
            route = self._routes.get(address)
            if route is not None and self._router is not None:
                if not self._push(self._router, ([route, *message], nbytes)):
                    return False
                self.stats.sent_over_routes += 1
                return True
            if self.relay is None or self._route_frame is None:
                return False
            if self.curve is not None:  # the relay must not read it: sealed for the target alone
                message = self._seal(message, address)
                if message is None:
                    return False
                nbytes = sum(len(f) for f in message)
            target = RELAY_PREFIX + address.encode()
            message, nbytes, address = [target, *message], nbytes + len(target), self.relay
        if self._route_frame is not None:
            message = [self._route_frame, *message]
            nbytes += len(self._route_frame)
        item = (message, nbytes)
        dest = self._destinations.get(address)
        if dest is not None:
            self._destinations.move_to_end(address)
        else:
            dest = self._connect(address)
        if dest is None:
            return False
        if dest.pending is not None:
            if len(dest.pending) >= self.limits.send_queue_messages:
                return False
            dest.pending.append(item)
            return True
        return self._push(dest.socket, item)

    def _reply(self, received: Sequence[object], message: list[bytes | memoryview], nbytes: int) -> bool:
        route = received.route if isinstance(received, ReceivedFrames) else None
        if route is None or self._router is None:
            return False
        return self._push(self._router, ([route, *message], nbytes))

    def _take_replies(self, address: str) -> None:
        dest = self._destinations.get(address)
        if dest is not None and dest.replies is None:
            dest.replies = self.spawn(self._read_replies(address, dest), f"replies from {address.partition(CURVE_QUERY)[0]}")

    def forget(self, address: str) -> None:
        self._routes.pop(address, None)
        # A short linger, not 0: closing with LINGER 0 while the I/O thread is halfway through a
        # multipart message aborted the process inside libzmq 4.3.5 ("Resource temporarily
        # unavailable (src/session_base.cpp:233)"), seen when members left as others pushed to them.
        self._drop(address, linger_ms=CLOSE_LINGER_MS)

    def _drop(self, address: str, linger_ms: int) -> None:
        dest = self._destinations.pop(address, None)
        if dest is None:
            return
        if dest.pending:
            self.stats.send_dropped += len(dest.pending)
        dest.pending = None
        if dest.connecting is not None:
            dest.connecting.cancel()
        if dest.replies is not None:  # before the socket closes under its pending receive
            dest.replies.cancel()
        if dest.monitor is not None:  # closed now: the context's termination waits for every socket
            dest.monitor.close(linger=0)
        dest.socket.close(linger=linger_ms)

    def _connect(self, address: str) -> _Destination | None:
        assert self._ctx is not None
        # Addresses come from other peers; only tcp:// may reach a DEALER
        # (inproc:// would reach into this very context).
        if not address.startswith("tcp://"):
            log.warning("not sending to %r: not a tcp:// address", address)
            return None
        try:
            url, server_key = split_curve_address(address)
        except ValueError as e:
            log.warning("not sending to %r: %s", address[:200], e)
            return None
        if self.curve is not None and server_key is None:
            log.warning("not sending to %s: this member is secure (--secure) and the address carries no CURVE key", url)
            return None
        if self.curve is None and server_key is not None:
            log.warning("not sending to %s: it is a secure member (its address has a CURVE key); run with --secure", url)
            return None
        while len(self._destinations) >= self.limits.max_connections:
            # Partners and probes are sent to often, so they stay; what goes is whom we have not sent to for longest.
            oldest = next(iter(self._destinations))
            log.debug("closing the connection to %s: %d open (limits.max_connections)", oldest, len(self._destinations))
            self._drop(oldest, linger_ms=CLOSE_LINGER_MS)
            self.stats.connections_closed += 1
        sock = monitor = None
        try:
            sock = self._ctx.socket(zmq.DEALER, socket_class=zmq.asyncio.Socket)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.limits.send_queue_messages)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
            # What it may send back (``send(replies=True)``) is bounded as the ROUTER's input is.
            sock.setsockopt(zmq.RCVHWM, self.limits.inbox_messages)
            sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + MAXMSGSIZE_SLACK)
            if self.curve is not None and server_key is not None:
                sock.curve_secretkey = self.curve.secret
                sock.curve_publickey = self.curve.public
                sock.curve_serverkey = server_key
            monitor_at = f"inproc://connect-{next(self._monitors)}"
            sock.monitor(monitor_at, _CONNECT_EVENTS)
            monitor = self._ctx.socket(zmq.PAIR, socket_class=zmq.asyncio.Socket)
            monitor.setsockopt(zmq.LINGER, 0)
            monitor.connect(monitor_at)
            sock.connect(url)
        except zmq.ZMQError as e:  # a bad address, or out of sockets (ZMQ_MAX_SOCKETS, file descriptors)
            if monitor is not None:
                monitor.close(linger=0)
            if sock is not None:
                sock.close(linger=0)
            log.warning("not sending to %r: %s", address[:200], e.strerror)
            return None
        dest = self._destinations[address] = _Destination(sock, monitor=monitor)
        dest.connecting = self.spawn(self._await_connection(address, dest), f"connect {url}")
        return dest

    async def _await_connection(self, address: str, dest: _Destination) -> None:
        """Hand the messages sent before ``address`` connected to ZeroMQ once it has, in order."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        try:
            while dest.pending:
                left = deadline - loop.time()
                if left <= 0:
                    break
                # With ZMQ_IMMEDIATE, POLLOUT means connected (handshake done) and with room.
                # Waking every 100 ms at most reads the handshake events as they come.
                if not await dest.socket.poll(min(left, 0.1) * 1000, zmq.POLLOUT):
                    self._read_handshake_events(address, dest)
                    continue
                while dest.pending and self._push(dest.socket, dest.pending[0]):
                    dest.pending.popleft()
        finally:
            self._read_handshake_events(address, dest)
            if dest.pending:
                self.stats.send_dropped += len(dest.pending)
                log.debug("dropped %d messages: %s did not connect in time", len(dest.pending), address)
            dest.pending = None
            dest.connecting = None
            if dest.monitor is not None:
                if not dest.socket.closed:
                    dest.socket.disable_monitor()
                dest.monitor.close(linger=0)
                dest.monitor = None

    def _read_handshake_events(self, address: str, dest: _Destination) -> None:
        """Note why the handshake with ``address`` failed, from the events queued so far."""
        monitor = dest.monitor
        while monitor is not None and not monitor.closed:
            try:
                frames = monitor.recv_multipart(flags=zmq.NOBLOCK).result()
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                dest.failure = None
            elif kind & _HANDSHAKE_FAILED:
                failure = _describe_handshake_failure(address, kind, value, self.curve is not None)
                if failure != dest.failure:
                    log.info("%s", failure)  # a join reports it as its error; exchanges count their drops
                dest.failure = failure

    def _push(self, sock: zmq.asyncio.Socket, item: _Message) -> bool:
        """Hand one message to ZeroMQ without waiting; False if its queue is full or unconnected."""
        frames, nbytes = item
        # copy=False: pyzmq still copies frames under zmq.COPY_THRESHOLD, and
        # shares the caller's buffer for the big ones.
        future = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        if not future.done():  # pyzmq queued it behind another waiter: we never wait
            future.cancel()
            return False
        try:
            future.result()
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:  # a reply whose connection is gone: counted, nothing to say
                log.warning("send failed: %s", e.strerror)
            return False
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes
        return True

    # -- receiving -------------------------------------------------------------------------

    async def _read(self) -> None:
        """Move whole messages from the ROUTER to the inbox, dropping those over the limits.

        While the inbox is full nothing is read and ZeroMQ's own queues push
        back on senders.
        """
        assert self._router is not None
        router = self._router
        while True:
            await self.inbox.wait_not_full()
            got = await self._recv_checked(router, routed=True)
            if got is None:
                continue
            frames, total, route = got
            key: bytes | None = None
            if self.curve is not None:
                try:
                    key = frames[0].get("User-Id").encode("ascii")  # pyzmq's ZAP handler: the client's Z85 key
                except (zmq.ZMQError, UnicodeEncodeError):
                    key = None
            origin = None
            if _is_route(frames[0]):
                origin = self._learn_route(frames[0].bytes, key, route)
                frames = frames[1:]
                if not frames:
                    continue
            if _starts(frames[0], RELAY_PREFIX):
                self._pass_on(frames, total, origin)
                continue
            self._deliver(frames, total, key, route)

    async def _read_replies(self, address: str, dest: _Destination) -> None:
        """Move what ``address`` sends back over our DEALER to the inbox, checked as the ROUTER's input is.

        Its key, in a secure swarm, is the server key we dialled it with: the
        CURVE handshake proved the other end holds it. Ends (quietly) when the
        destination is dropped.
        """
        try:
            _, server_key = split_curve_address(address)
        except ValueError:
            return
        try:
            while True:
                await self.inbox.wait_not_full()
                got = await self._recv_checked(dest.socket, routed=False)
                if got is not None:
                    frames = got[0]
                    if _is_route(frames[0]):  # only clients send one, and nobody dials a client
                        frames = frames[1:]
                    if frames and _starts(frames[0], RELAYED_PREFIX):  # another client's, through our relay
                        self._deliver_relayed(frames, got[1])
                        continue
                    if frames:
                        self.stats.received_over_own += 1
                        self._deliver(frames, got[1], server_key, None)
        except zmq.ZMQError:  # the socket closed under us (the transport closing)
            return

    async def _recv_checked(
        self, sock: zmq.asyncio.Socket, *, routed: bool
    ) -> tuple[list[zmq.Frame], int, bytes | None] | None:
        """One whole message from ``sock``: (frames, bytes, the ROUTER's route if ``routed``); None if dropped.

        Frames are checked one at a time, so that an oversize message is
        discarded (and counted) as it is read, and a message without frames
        is skipped.
        """
        limits = self.limits
        first = await sock.recv(copy=False)  # the first frame of a message: the rest is here then (_next_frame)
        route: bytes | None = None
        waiting: zmq.Frame | None = None
        if routed:  # added by the ROUTER; the header names the sender
            route, more = first.bytes, first.more
        else:
            more, waiting = True, first
        frames: list[zmq.Frame] = []
        total = 0
        dropped = False
        while more:
            frame = waiting if waiting is not None else await _next_frame(sock)
            waiting = None
            more = frame.more
            if dropped:
                continue
            size = len(frame)
            total += size
            # A client's route frame and a relay's frame (at most 2 in front) come on top of what the limits allow.
            too_many = len(frames) >= limits.max_frames and len(frames) >= limits.max_frames + _control_frames(frames)
            if too_many or size > limits.max_frame_bytes or total > limits.max_message_bytes:
                dropped = True
                frames.clear()
                continue
            frames.append(frame)
        if dropped:
            self.stats.oversize_dropped += 1
            log.debug("dropped an incoming message over the limits")
            return None
        return (frames, total, route) if frames else None

    def _learn_route(self, frame: bytes, key: bytes | None, route: bytes | None) -> str | None:
        """Remember ``route`` as the way to the client-mode member a route frame names, if it may claim it;
        that member's address (None if it may not)."""
        address = _address_after(frame, ROUTE_PREFIX)
        if route is None or address is None:
            return None
        try:
            _, claimed = split_curve_address(address)
        except ValueError:
            return None
        if not is_client_address(address) or claimed != key:  # secure: only the holder of the address's key
            return None
        if self._routes.get(address) != route:
            self._routes[address] = route
            while len(self._routes) > self.limits.max_incoming:
                self._routes.popitem(last=False)
        self._routes.move_to_end(address)
        return address

    def _pass_on(self, frames: list[zmq.Frame], total: int, origin: str | None) -> None:
        """As a relay: pass a client's message on to the client its relay frame names, over our route to it."""
        target = _address_after(frames[0].bytes, RELAY_PREFIX)
        route = self._routes.get(target) if target is not None else None
        budget = self.relaying
        loop = asyncio.get_running_loop()
        if (
            origin is None  # only a client (named by its route frame) has messages relayed
            or route is None
            or budget is None
            or self._router is None
            or not budget.take(total, loop.time())
        ):
            self.stats.relay_dropped += 1
            return
        came_from = RELAYED_PREFIX + origin.encode()
        if self._push(self._router, ([route, came_from, *frames[1:]], total)):
            self.stats.relayed += 1
        else:
            self.stats.relay_dropped += 1

    def _seal(self, message: list[bytes | memoryview], target: str) -> list[bytes | memoryview] | None:
        """``message`` sealed for the client at ``target`` (gossiptrain.net.sealed); None if it cannot be."""
        assert self.curve is not None and self.client_as is not None
        try:
            _, other = split_curve_address(target)
        except ValueError:
            return None
        if other is None:
            return None
        return list(sealed.seal(message, secret=self.curve.secret, public=self.curve.public, other=other,
                                sender=self.client_as, target=target, chunk=self.limits.chunk_bytes,
                                number=self._sealed_numbers.next()))

    def _deliver_relayed(self, frames: list[zmq.Frame], total: int) -> None:
        """A message another client sent us through our relay: opened (a secure swarm's are sealed) and delivered
        as from that client, whose address the relay's frame names; dropped and counted if it does not open."""
        origin = _address_after(frames[0].bytes, RELAYED_PREFIX)
        rest = frames[1:]
        if origin is None or not rest:
            self.stats.sealed_dropped += 1
            return
        key: bytes | None = None
        contents: list[memoryview] | None = None
        if self.curve is not None:
            try:
                _, key = split_curve_address(origin)
                if key is None or self.client_as is None:
                    raise sealed.SealError("the sender's address has no key")
                opened = sealed.unseal([f.buffer for f in rest], secret=self.curve.secret, public=self.curve.public,
                                       other=key, sender=origin, target=self.client_as, limits=self.limits,
                                       seen=self._sealed_seen)
            except (sealed.SealError, ValueError):
                self.stats.sealed_dropped += 1
                return
            contents = [memoryview(f) for f in opened]
        self.stats.received_relayed += 1
        self.stats.received_over_own += 1
        self._deliver(rest, total, key, None, contents)

    def _deliver(
        self, frames: list[zmq.Frame], total: int, key: bytes | None, route: bytes | None,
        contents: list[memoryview] | None = None,
    ) -> None:
        """Put a received message in the inbox: ``frames``' buffers, or ``contents`` (what they held, opened)."""
        try:
            source: str | None = frames[0].get("Peer-Address")
        except zmq.ZMQError:  # no connection metadata (cannot happen over tcp://; never fatal)
            source = None
        self.inbox.put_nowait(ReceivedFrames(contents if contents is not None else [f.buffer for f in frames], source, key, route))
        self.stats.messages_received += 1
        self.stats.bytes_received += total

    async def _count_handshake_failures(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            kind, value = int(event["event"]), int(event["value"])
            if kind & _HANDSHAKE_FAILED:
                self.stats.handshake_failures += 1
                log.debug("handshake failed on %s: event %s, errno %s", self.address, kind, value)
            elif kind == zmq.EVENT_ACCEPTED:  # value: the new connection's descriptor
                source = peer_of(value, self.port)
                if source is not None and not self.incoming.accepted(value, source):
                    shut_down(value)
                    refused = self.stats.incoming_refused = self.incoming.refused
                    if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th, ...: not one line per connection
                        log.warning("shutting down incoming connections from %s: %d open from it, %d in all "
                                    "(limits.incoming_per_source %d, max_incoming %d); %d refused so far",
                                    source, self.incoming.count(source), len(self.incoming),
                                    self.incoming.per_source, self.incoming.total, refused)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.incoming.disconnected(value)


async def _next_frame(sock: zmq.asyncio.Socket) -> zmq.Frame:
    """The next frame of a message whose first frame was read.

    ZeroMQ delivers a message whole, so it is there: read without waiting.
    Awaiting each frame cost an asyncio future and its callbacks per frame,
    and a model of 114 tensors is 114 frames each way (experiments/exchange.py
    --model charlm-transformer, transport and codec alone: 14.7 and 15.9 ms
    against 19.7 and 16.8 ms awaiting each). Should it not be there after
    all, wait for it as before.
    """
    try:
        return sock.recv(flags=zmq.NOBLOCK, copy=False).result()
    except zmq.Again:
        return await sock.recv(copy=False)


def _starts(frame: zmq.Frame, prefix: bytes) -> bool:
    """Whether ``frame`` starts with ``prefix`` (compared in place: no copy of a large frame)."""
    return len(frame) >= len(prefix) and frame.buffer[: len(prefix)] == prefix


def _is_route(frame: zmq.Frame) -> bool:
    """Whether ``frame`` is a client's route frame."""
    return _starts(frame, ROUTE_PREFIX)


def _control_frames(frames: list[zmq.Frame]) -> int:
    """How many of the first two frames are a client's or a relay's (route, relay, relayed), not the message's."""
    n = 0
    for frame in frames[:2]:
        if not (_is_route(frame) or _starts(frame, RELAY_PREFIX) or _starts(frame, RELAYED_PREFIX)):
            break
        n += 1
    return n


def _address_after(frame: bytes, prefix: bytes) -> str | None:
    """The address a control frame names after its prefix; None if too long or not text."""
    raw = frame[len(prefix):]
    if len(raw) > MAX_ROUTE_ADDRESS:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def _describe_handshake_failure(address: str, kind: int, value: int, secure: bool) -> str:
    """A sentence naming the likely cause of a failed handshake with ``address``."""
    url = address.partition(CURVE_QUERY)[0]
    if kind & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"{url} refused our CURVE key (ZAP status {value}): our public key (NAME.key) "
            "is not in its allow-list directory (--allow)"
        )
    if kind & zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if secure:
            return f"{url} does not run with --secure, or is not a gossiptrain member"
        return f"{url} is a secure member (--secure) and we are not: run with --secure and a key it allows"
    if secure:
        return (
            f"the secure handshake with {url} failed: the server key we dial it with (--server-key, or the key "
            "in its address) is not the key of the member listening there"
        )
    return f"the handshake with {url} failed: it is not a gossiptrain member, or it runs with --secure"
