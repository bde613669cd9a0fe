"""The transport interface every backend implements, and the inbox they share.

A transport moves whole multipart messages between endpoints, like
datagrams: ``send`` never blocks and may drop, ``recv`` yields one message's
frames. It knows nothing of message contents (the sender's identity travels
in the header, which the wire codec owns). Code above this layer talks only
to ``Transport``, so ``tcp://`` and ``sim://`` are interchangeable and one
conformance suite (``gossiptrain.testing.transport_checks``, run by tests/test_transport.py) holds both to the same contract.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from gossiptrain.config import Limits
from gossiptrain.errors import TransportClosed
from gossiptrain.net.address_forms import is_client_address
from gossiptrain.service import Service, Status

log = logging.getLogger(__name__)

@dataclass
class TransportStats:
    """Counters a transport keeps; drops are counted, never raised."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    send_dropped: int = 0  # destination queue full, or not reachable in time
    oversize_dropped: int = 0  # over max_frames / max_frame_bytes / max_message_bytes (either side)
    handshake_failures: int = 0  # a connection that never became a valid peer (e.g. garbage bytes)
    connections_closed: int = 0  # outgoing connections closed as the least recently used (limits.max_connections)
    incoming_refused: int = 0  # incoming connections shut down at once: over limits.incoming_per_source or max_incoming
    sent_over_routes: int = 0  # messages for a client-mode member, sent back over the connection it opened to us
    received_over_own: int = 0  # messages that came back over connections we opened (replies; a client's everything)
    relayed: int = 0  # as a relay: messages passed from one client-mode member to another
    relay_dropped: int = 0  # as a relay: messages not passed on (no route to the target, over the budget, not relaying)
    received_relayed: int = 0  # as a client: messages from another client that came through our relay
    sealed_dropped: int = 0  # as a client: relayed messages that did not open (secure: not sealed for us by the sender)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


#: The first frame (after a client's route frame) of a message for a relay: then the client address it is for.
RELAY_PREFIX = b"\x00relay\x00"
#: The first frame of a message a relay passed on: then the client address it came from.
RELAYED_PREFIX = b"\x00relayed\x00"


class RelayBudget:
    """What a relay may pass on: ``rate`` bytes a second on average and ``burst`` at once.

    A token bucket that may go into debt by one message, so that a message
    larger than the burst still passes when the bucket is full; then nothing
    passes until the debt is paid off at ``rate``.
    """

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, now

    def take(self, nbytes: int, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens <= 0:
            return False
        self.tokens -= nbytes
        return True


def frame_nbytes(frame: bytes | memoryview) -> int:
    """Size in bytes; ``len`` of a memoryview counts items, not bytes."""
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    return memoryview(frame).nbytes


def oversize(limits: Limits, sizes: Sequence[int]) -> bool:
    """Whether a message with these frame sizes breaks ``limits``."""
    return (
        len(sizes) > limits.max_frames
        or max(sizes, default=0) > limits.max_frame_bytes
        or sum(sizes) > limits.max_message_bytes
    )


class Inbox:
    """A bounded FIFO of received messages whose readers wake with an error on close.

    Backends put complete, already validated messages here; ``Transport.recv``
    takes them out. Waiters are woken all at once and re-check, so a reader
    cancelled right after its wake-up (``wait_for`` timeouts) cannot strand
    another reader.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._messages: deque[list[memoryview]] = deque()
        self._readers: list[asyncio.Future[None]] = []
        self._writers: list[asyncio.Future[None]] = []
        self.closed = False

    def __len__(self) -> int:
        return len(self._messages)

    def full(self) -> bool:
        return len(self._messages) >= self.capacity

    def put_nowait(self, message: list[memoryview]) -> bool:
        """Queue a message; False (nothing queued) if full or closed."""
        if self.closed or self.full():
            return False
        self._messages.append(message)
        _wake(self._readers)
        return True

    async def wait_not_full(self) -> None:
        """Wait for room: a backend with backpressure (tcp) reads no more until then."""
        while self.full() and not self.closed:
            await self._wait(self._writers)

    async def get(self) -> list[memoryview]:
        while not self._messages:
            if self.closed:
                raise TransportClosed("transport closed")
            await self._wait(self._readers)
        message = self._messages.popleft()
        _wake(self._writers)
        return message

    def close(self) -> None:
        """Drop queued messages and wake everyone; readers then raise TransportClosed."""
        self.closed = True
        self._messages.clear()
        _wake(self._readers)
        _wake(self._writers)

    @staticmethod
    async def _wait(waiters: list[asyncio.Future[None]]) -> None:
        future = asyncio.get_running_loop().create_future()
        waiters.append(future)
        try:
            await future
        finally:
            if future in waiters:
                waiters.remove(future)


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    for future in waiters:
        if not future.done():
            future.set_result(None)
    waiters.clear()


class Transport(Service, abc.ABC):
    """One inbound endpoint plus outgoing connections made on demand.

    Backends fill ``self.inbox`` with validated messages and close it in
    ``_close``; ``recv`` is shared. ``address`` is the URL given until
    ``start`` binds, then the resolved one (port 0 replaced by the real port).
    """

    #: Whether senders check each message as its receivers will (``wire.encode``'s ``check``) before it
    #: leaves: a clear error at the sender. The simulator's receivers run that check on the same bytes.
    check_sends: bool = True

    def __init__(self, url: str, limits: Limits) -> None:
        super().__init__()
        self.address: str = url
        self.limits = limits
        self.stats = TransportStats()
        self.inbox = Inbox(limits.inbox_messages)
        self.client_as: str | None = None  # our client-mode address, once ``become_client``
        self.relay: str | None = None  # a client's relay (``use_relay``): the way to clients it has no route to
        self.relaying: RelayBudget | None = None  # we relay for clients (``serve_as_relay``), within this budget

    def become_client(self, address: str) -> None:
        """From now on, be the client-mode member at ``address``, which nobody can dial (behind NAT).

        Every message we send names ``address`` to its receiver, which then
        sends whatever it has for ``address`` back over the connection the
        message came on (its route to us), and we read what comes back over
        every connection we open. So a member we have sent to can probe us,
        exchange with us and answer us; one we never sent to cannot
        (``can_reach`` says so).
        """
        if not is_client_address(address):
            raise ValueError(f"{address!r} is not a client-mode address (gossiptrain.net.addressing.client_address)")
        self._check_open()
        self.client_as = address
        self._became_client(address)

    def _became_client(self, address: str) -> None:
        """What a backend does when it becomes the client at ``address`` (nothing, by default)."""

    def use_relay(self, address: str) -> None:
        """As a client, send what we have for another client-mode member, which we cannot reach, through the
        member at ``address`` (which must ``serve_as_relay`` and hold a route to it); it says where it came from.

        CURVE protects each connection, not the path between two clients: a
        secure transport seals what goes through the relay for its target
        alone (``gossiptrain.net.sealed``).
        """
        if self.client_as is None:
            raise ValueError("only a client-mode member uses a relay (become_client first)")
        if is_client_address(address):
            raise ValueError(f"a relay must be reachable, not a client-mode member: {address!r}")
        self.relay = address

    def serve_as_relay(self, now: float) -> None:
        """Pass messages between client-mode members (both with a route to us), within ``limits.relay_*``."""
        self.relaying = RelayBudget(self.limits.relay_bytes_per_second, self.limits.relay_burst_bytes, now)

    def can_relay(self, address: str) -> bool:
        """Whether a message for the client-mode member at ``address`` can go through our relay."""
        return self.relay is not None and is_client_address(address)

    def can_reach(self, address: str) -> bool:
        """Whether a message for ``address`` can leave now.

        A member's address can be dialled; a client-mode member's only over a
        connection it opened to us, once a message of its has come over it.
        """
        return not is_client_address(address) or self._routed(address)

    def _routed(self, address: str) -> bool:
        """Whether we have a route (a connection it opened) to the client-mode member at ``address``."""
        return False

    def send(self, address: str, frames: Sequence[bytes | memoryview], *, replies: bool = False) -> bool:
        """Queue one message for the transport listening at ``address``; never blocks.

        True if queued. A destination not yet connected holds the message
        until it connects (backend-defined grace); if it never does, the
        message is counted in ``stats.send_dropped`` later. False, counted,
        if the destination's queue is full, it is known unreachable, or the
        message breaks ``limits`` (``oversize_dropped``). Never raises for an
        unreachable or malformed peer address; raises TransportClosed if this
        transport is closed. Frames are not copied: do not modify a buffer
        after passing it here.

        ``replies``: also take what the destination sends back over this
        connection (``reply``) into our inbox, checked like everything else:
        the way back for a sender nobody can dial (a joiner behind NAT).
        """
        checked = self._checked(frames, address)
        if checked is None:
            return False
        sent = self._send(address, *checked)
        if replies or self.client_as is not None:  # a client hears everything over its own connections
            self._take_replies(address)
        if not sent:
            self.stats.send_dropped += 1
        return sent

    def reply(self, received: Sequence[object], frames: Sequence[bytes | memoryview]) -> bool:
        """Send one message back to the sender of ``received`` over the connection it came in on; never blocks.

        No new connection is made, so the answer reaches a sender whose own
        address nobody can dial (behind NAT, or advertising a wrong one),
        provided it sent with ``replies=True``. False, counted in
        ``send_dropped``, if that connection is gone or its queue is full;
        the checks and errors are ``send``'s.
        """
        checked = self._checked(frames, "a sender")
        if checked is None:
            return False
        if not self._reply(received, *checked):
            self.stats.send_dropped += 1
            return False
        return True

    def _checked(self, frames: Sequence[bytes | memoryview], to: str) -> tuple[list[bytes | memoryview], int] | None:
        """(the frames as one message, its bytes) to hand a backend; None (counted) if it breaks our own limits."""
        self._check_open()
        message = list(frames)
        if not message:
            raise ValueError("a message needs at least one frame")
        sizes = [frame_nbytes(f) for f in message]
        if oversize(self.limits, sizes):
            self.stats.oversize_dropped += 1
            log.debug("not sending to %s: %d frames, %d bytes break the limits", to, len(sizes), sum(sizes))
            return None
        return message, sum(sizes)

    @abc.abstractmethod
    def _send(self, address: str, message: list[bytes | memoryview], nbytes: int) -> bool:
        """Hand over a message that passed the checks; False if it was dropped (``send`` counts it)."""

    @abc.abstractmethod
    def _reply(self, received: Sequence[object], message: list[bytes | memoryview], nbytes: int) -> bool:
        """Hand over a message for the sender of ``received``, over its connection; False if dropped (counted)."""

    def _take_replies(self, address: str) -> None:
        """Read what ``address`` sends back over our connection to it (backends whose replies arrive anyway: nothing)."""

    @abc.abstractmethod
    def forget(self, address: str) -> None:
        """Drop the outgoing connection to ``address`` (a member that left, or a newcomer's there) and its queue."""

    def source_of(self, frames: Sequence[object]) -> str | None:
        """The network source (an IP) a received message came from, where the backend can tell; else None."""
        return None

    def key_of(self, frames: Sequence[object]) -> bytes | None:
        """The public key the sender of a received message proved (a secure backend); else None."""
        return None

    def connect_failure(self, address: str) -> str | None:
        """Why connecting to ``address`` failed for good (a refused key, say), where the backend can tell."""
        return None

    def accepts_key(self, public_key: bytes | None) -> bool:
        """Whether a peer authenticating with ``public_key`` would be let in (backends without keys: always)."""
        return True

    def reachable_at(self, url: str) -> str:
        """``url`` (this endpoint under an advertised host name) as others must dial it."""
        return url

    async def recv(self) -> list[memoryview]:
        """The frames of the next whole message. Raises TransportClosed once closed."""
        if self.status is Status.CREATED:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return await self.inbox.get()

    def _check_open(self) -> None:
        if self.status is Status.CREATED:
            raise RuntimeError(f"{type(self).__name__} is not started")
        if self.status is not Status.RUNNING:
            raise TransportClosed(f"transport {self.address} is {self.status.value}")
