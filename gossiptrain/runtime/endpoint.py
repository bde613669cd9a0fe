"""One base for every service that speaks the wire protocol: send, receive, dispatch by kind.

A peer's network side, the coordinator and the swarm client all do the
same three things: encode and send a message (a message that breaks the
limits is logged and not sent, one the transport cannot queue is counted),
decode everything that arrives (a bad message is dropped and counted; it
never kills the receiver), and route it by kind. Subclasses declare the
routing as a table, ``handlers`` (kind -> method), the way dask's
``Server.handlers`` does, instead of an if-chain. Kinds in ``open_kinds``
are taken from anyone (a join, a query from a tool that does not know the
run yet); every other kind must carry this run's fingerprint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from gossiptrain.config import Limits
from gossiptrain.errors import ProtocolError
from gossiptrain.net.addressing import is_key_id, key_id, key_id_of
from gossiptrain.net.transport import Transport
from gossiptrain.net.wire import Message, decode, encode
from gossiptrain.service import Service

log = logging.getLogger(__name__)

#: Handles one decoded message; ``frames`` are the raw frames (``Transport.source_of`` reads them).
Handler = Callable[[Message, Sequence[object]], None]


@dataclass
class EndpointStats:
    """What every endpoint counts; services extend it with their own counters."""

    bad_messages: int = 0  # failed to decode or validate, or their handler raised
    wrong_run: int = 0  # another run's fingerprint
    unexpected: int = 0  # a kind this endpoint does not take
    undeliverable: int = 0  # messages the transport could not queue
    forged_senders: int = 0  # secure swarm: a member id or address its connection's key does not entitle it to

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Endpoint(Service):
    """A service on one transport: ``send``, and a receive loop that calls ``handlers[msg.kind]``.

    Subclasses set ``handlers`` (and ``open_kinds``) in their constructor and
    call ``super()._start()`` from their own ``_start``; a plain ``Endpoint``
    with a table set from outside serves a client that owns no service of its
    own. ``sender`` and ``advertise`` (the address others reach us at;
    default: the bound one) name us in every message sent; ``fingerprint`` is the run's (it may
    be learnt later, as the swarm client does); ``step`` is stamped on
    outgoing messages.
    """

    def __init__(
        self,
        transport: Transport,
        limits: Limits,
        *,
        sender: str,
        fingerprint: str,
        stats: EndpointStats | None = None,
        advertise: str = "",
    ) -> None:
        super().__init__()
        self.transport = transport
        self.limits = limits
        self.sender = sender
        self.fingerprint = fingerprint
        self.stats = stats if stats is not None else EndpointStats()
        self.advertised = advertise
        self.step = 0
        self.handlers: Mapping[str, Handler] = {}
        self.open_kinds: frozenset[str] = frozenset()

    @property
    def sender_address(self) -> str:
        """The address others answer us at: the advertised one, else the bound one."""
        return self.advertised or self.transport.address

    async def _start(self) -> None:
        self.spawn(self._receive_loop(), "receive")

    # -- sending ---------------------------------------------------------------------------

    def send(self, addr: str, kind: str, body: dict[str, Any], tensors: Mapping[str, Any] | None = None) -> bool:
        """Encode and queue one message; False (logged or counted) if it breaks the limits or cannot be queued."""
        msg = Message(kind, self.sender, self.sender_address, self.fingerprint, self.step, body, dict(tensors or {}))
        try:
            frames = encode(msg, self.limits, check=self.transport.check_sends)
        except ProtocolError as e:
            log.error("cannot send %s to %s: %s", kind, addr, e)
            return False
        if not self.transport.send(addr, frames):
            self.stats.undeliverable += 1
            return False
        return True

    def reply(self, received: Sequence[object], kind: str, body: dict[str, Any]) -> bool:
        """Answer the sender of ``received`` (a message's raw frames) over the connection it came in on.

        For answers that must reach a sender nobody can dial (a joiner behind
        NAT, or one advertising an address where it does not listen): False
        (counted as undeliverable) if that connection is gone.
        """
        msg = Message(kind, self.sender, self.sender_address, self.fingerprint, self.step, body)
        try:
            frames = encode(msg, self.limits, check=self.transport.check_sends)
        except ProtocolError as e:
            log.error("cannot send %s back: %s", kind, e)
            return False
        if not self.transport.reply(received, frames):
            self.stats.undeliverable += 1
            return False
        return True

    # -- receiving -------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.transport.recv()
            try:
                self.dispatch(decode(frames, self.limits), frames)
            except ProtocolError as e:
                self.stats.bad_messages += 1
                log.debug("dropped a bad message: %s", e)
            except Exception:  # a bug must not let one peer's message kill the receiver
                self.stats.bad_messages += 1
                log.exception("error while handling a message; dropped it")

    def _sender_proven(self, msg: Message, frames: Sequence[object]) -> bool:
        """In a secure swarm, a message sent as a member must come from that member's key, and name its address.

        A member's id is derived from its key (``key_id_of``), and CURVE proves
        the key of each connection: so nobody sends as another member, nor
        names an address of someone else's to be answered at. Senders that are
        not members (the coordinator, tools) and open swarms are not checked.
        """
        key = self.transport.key_of(frames)
        if key is None or not is_key_id(msg.sender):
            return True
        return key_id_of(key) == msg.sender and key_id(msg.addr) == msg.sender

    def dispatch(self, msg: Message, frames: Sequence[object] = ()) -> None:
        """Route one decoded message by its kind (ProtocolError from a handler: the message was bad)."""
        if msg.kind not in self.open_kinds and msg.fingerprint != self.fingerprint:
            self.stats.wrong_run += 1
            return
        if not self._sender_proven(msg, frames):
            self.stats.forged_senders += 1
            return
        handler = self.handlers.get(msg.kind)
        if handler is None:
            self.stats.unexpected += 1
        else:
            handler(msg, frames)
