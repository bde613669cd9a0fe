"""The real network backend: ZeroMQ over TCP (IPv4 and IPv6), on asyncio or uvloop.

One ROUTER socket receives from everyone; one DEALER per destination sends,
created on first use. ZeroMQ gives us framing, reconnection and per-pipe
queues; this module adds what it lacks for untrusted peers: limits checked
frame by frame, drops counted instead of raised, and a bounded wait for a
new destination to connect (ZMQ_IMMEDIATE would otherwise refuse the first
message to every new peer).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..config import Limits
from ..errors import ConfigError
from .base import Transport

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

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# One context per transport, so this inproc name cannot collide.
_MONITOR_ENDPOINT = "inproc://handshakes"

_Message = tuple[list[bytes | memoryview], int]  # frames, total bytes


@dataclass(eq=False)
class _Destination:
    socket: zmq.asyncio.Socket
    # Messages waiting for the first connection; None once it is settled
    # (connected, or given up on), after which sends go straight to ZeroMQ.
    pending: deque[_Message] | None = field(default_factory=deque)
    connecting: asyncio.Task[None] | None = None


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
    """Transport over ZeroMQ; ``url`` is the address to bind, e.g. tcp://0.0.0.0:7070."""

    def __init__(self, url: str, limits: Limits, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        check_url(url)
        if not connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be > 0, got {connect_timeout}")
        super().__init__(url, limits)
        self.connect_timeout = connect_timeout
        self._url = url
        self._ctx: zmq.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._destinations: dict[str, _Destination] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def _start(self) -> None:
        self._ctx = zmq.Context()
        router = self._router = self._ctx.socket(zmq.ROUTER, socket_class=zmq.asyncio.Socket)
        router.setsockopt(zmq.IPV6, 1)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, self.limits.inbox_messages)
        router.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + MAXMSGSIZE_SLACK)
        try:
            router.bind(self._url)
        except zmq.ZMQError as e:
            raise ConfigError(f"cannot listen on {self._url}: {e.strerror}") from None
        self.address = _unmap_ipv4(router.getsockopt_string(zmq.LAST_ENDPOINT))
        router.monitor(_MONITOR_ENDPOINT, _HANDSHAKE_FAILED)
        self._monitor = self._ctx.socket(zmq.PAIR, socket_class=zmq.asyncio.Socket)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(_MONITOR_ENDPOINT)
        self.spawn(self._read(), "read")
        self.spawn(self._count_handshake_failures(), "monitor")
        log.debug("listening on %s", self.address)

    async def _close(self) -> None:
        self.inbox.close()
        for address in list(self._destinations):
            self._drop(address, linger_ms=CLOSE_LINGER_MS)
        if self._router is not None:
            if self._monitor is not None:
                self._router.disable_monitor()
                self._monitor.close(linger=0)
            self._router.close(linger=0)
        if self._ctx is not None:
            # Sockets are closed with LINGER 0 or CLOSE_LINGER_MS, so this
            # returns promptly even with messages queued to dead peers.
            self._ctx.term()
        self._router = self._monitor = self._ctx = None

    # -- sending ---------------------------------------------------------------------------

    def _send(self, address: str, message: list[bytes | memoryview], nbytes: int) -> bool:
        item = (message, nbytes)
        dest = self._destinations.get(address) or self._connect(address)
        if dest is None:
            return False
        if dest.pending is not None:
            if len(dest.pending) >= self.limits.send_queue_messages:
                return False
            dest.pending.append(item)
            return True
        return self._push(dest.socket, item)

    def forget(self, address: str) -> None:
        # LINGER 0: whatever is still queued to a member that left is discarded now.
        self._drop(address, linger_ms=0)

    def _drop(self, address: str, linger_ms: int) -> None:
        dest = self._destinations.pop(address, None)
        if dest is None:
            return
        if dest.pending:
            self.stats.send_dropped += len(dest.pending)
        dest.pending = None
        if dest.connecting is not None:
            dest.connecting.cancel()
        dest.socket.close(linger=linger_ms)

    def _connect(self, address: str) -> _Destination | None:
        assert self._ctx is not None
        # Addresses come from other peers; only tcp:// may reach a DEALER
        # (inproc:// would reach into this very context).
        if not address.startswith("tcp://"):
            log.warning("not sending to %r: not a tcp:// address", address)
            return None
        sock = self._ctx.socket(zmq.DEALER, socket_class=zmq.asyncio.Socket)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.limits.send_queue_messages)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            log.warning("not sending to %r: %s", address, e.strerror)
            return None
        dest = self._destinations[address] = _Destination(sock)
        dest.connecting = self.spawn(self._await_connection(address, dest), f"connect {address}")
        return dest

    async def _await_connection(self, address: str, dest: _Destination) -> None:
        """Hand the messages sent before ``address`` connected to ZeroMQ once it has, in order."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        try:
            while dest.pending:
                left = deadline - loop.time()
                # With ZMQ_IMMEDIATE, POLLOUT means connected and with room.
                if left <= 0 or not await dest.socket.poll(left * 1000, zmq.POLLOUT):
                    break
                while dest.pending and self._push(dest.socket, dest.pending[0]):
                    dest.pending.popleft()
        finally:
            if dest.pending:
                self.stats.send_dropped += len(dest.pending)
                log.debug("dropped %d messages: %s did not connect in time", len(dest.pending), address)
            dest.pending = None
            dest.connecting = None

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
            log.warning("send failed: %s", e.strerror)
            return False
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes
        return True

    # -- receiving -------------------------------------------------------------------------

    async def _read(self) -> None:
        """Move whole messages from the ROUTER to the inbox, dropping those over the limits.

        Frames are checked one at a time so that an oversize message is
        discarded as it is read. While the inbox is full nothing is read and
        ZeroMQ's own queues push back on senders.
        """
        assert self._router is not None
        router, limits, stats = self._router, self.limits, self.stats
        while True:
            await self.inbox.wait_not_full()
            routing_id = await router.recv(copy=False)  # added by the ROUTER; the header names the sender
            more = routing_id.more
            frames: list[zmq.Frame] = []
            total = 0
            dropped = False
            while more:
                frame = await router.recv(copy=False)
                more = frame.more
                if dropped:
                    continue
                size = len(frame)
                total += size
                if len(frames) == limits.max_frames or size > limits.max_frame_bytes or total > limits.max_message_bytes:
                    dropped = True
                    frames.clear()
                    continue
                frames.append(frame)
            if dropped:
                stats.oversize_dropped += 1
                log.debug("dropped an incoming message over the limits")
                continue
            if not frames:
                continue
            self.inbox.put_nowait([f.buffer for f in frames])
            stats.messages_received += 1
            stats.bytes_received += total

    async def _count_handshake_failures(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if int(event["event"]) & _HANDSHAKE_FAILED:
                self.stats.handshake_failures += 1
                log.debug("handshake failed on %s: event %s, errno %s", self.address, event["event"], event["value"])
