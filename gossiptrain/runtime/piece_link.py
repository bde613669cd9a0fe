"""One rank's own socket for its piece's exchanges (issue 48): no rank carries another's bytes.

A peer whose model is split across its ranks averages rank by rank
(``gossiptrain.protocol.piece_exchange``). Each rank listens at its own
address and sends its piece to the same rank of the partner peer; what
arrives is handed to the rank's ``RankExchanges`` on the network thread at
once: a request is checked and kept until the group's next safe point, where
every rank that holds it answers it from the piece that safe point took
(``gossiptrain.runtime.split_group``). The group's rank 0 also carries the leaders'
word: the outcome of each exchange (``XPEND``), kept until its next safe
point hands it to every rank (``take_outcomes``).

State transfer runs rank by rank over the same sockets: the messages of
``gossiptrain.protocol.state_transfer`` (``SREQ``, ``SREP``, ``SACK``,
``SNAK``) go to the rank's ``StateEndpoint`` (``transfer``), which serves
its piece to the same rank of newcomers in verified chunks and, on a
newcomer, downloads its piece from the same rank of donors
(``gossiptrain.runtime.piece_transfer``).

Bodies are small and checked (``xid``, ``a``, ``step``, ``norm``, ``outcome``); a malformed one
is a ``ProtocolError``, which the endpoint counts and drops. The training
side and this network side call the rank's machine under one lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Mapping, Sequence

from gossiptrain.config import Limits
from gossiptrain.errors import ProtocolError
from gossiptrain.net import kinds
from gossiptrain.net.kinds import XPEND, XPHELLO, XPNAK, XPREP, XPREQ, XPWELCOME
from gossiptrain.net.transport import Transport
from gossiptrain.net.wire import Message
from gossiptrain.protocol.piece_exchange import Outcome, RankExchanges, Send, hello_answer
from gossiptrain.protocol.pieces import PieceLayout
from gossiptrain.runtime.endpoint import Endpoint
from gossiptrain.runtime.state_endpoint import StateCopy, StateEndpoint

log = logging.getLogger(__name__)

#: Outcomes a leader keeps between two safe points, at most (a flood of XPENDs cannot grow it without bound).
MAX_OUTCOMES = 1024
_XID_MAX = (1 << 63) - 1


class PieceLink(Endpoint):
    """Sends this rank's piece messages and answers the partners' (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        limits: Limits,
        exchanges: RankExchanges,
        *,
        sender: str,
        fingerprint: str,
        clock: Callable[[], float],
        transfer: StateEndpoint | None = None,
        lock: threading.Lock | threading.RLock | None = None,
    ) -> None:
        super().__init__(transport, limits, sender=sender, fingerprint=fingerprint)
        self.exchanges = exchanges
        self.transfer = transfer  # this rank's side of state transfer (its piece), on this link's loop; None: none
        self.clock = clock
        self.lock = lock if lock is not None else threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None  # the network thread's, once started
        self._outcomes: dict[int, tuple[str, Outcome]] = {}  # leader: xid -> (requester, its word), until our safe point
        # Leader: what a hello is answered with (our layout, every rank's address); None: hellos are not ours.
        self.introduction: tuple[PieceLayout, tuple[str, ...]] | None = None
        self._welcomes: dict[str, tuple[str, dict[str, Any]]] = {}  # addr asked -> (its id, its answer)
        self._welcomed = threading.Condition(self.lock)
        self.handlers = {XPREQ: self._on_request, XPREP: self._on_reply, XPNAK: self._on_refusal, XPEND: self._on_outcome,
                         XPHELLO: self._on_hello, XPWELCOME: self._on_welcome,
                         **dict.fromkeys(kinds.STATE, self._on_state)}

    @property
    def address(self) -> str:
        """Where partners' ranks reach this one (the bound address once started)."""
        return self.sender_address

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.transport.start(timeout=10)  # ours alone: started and closed with the link
        await super()._start()
        if self.transfer is not None:  # snapshots hashed in a worker thread: the exchanges' messages do not wait
            self.transfer.offload = True
            self.spawn(self.transfer.run(), "state snapshots")

    async def _close(self) -> None:
        await self.transport.close("piece link closed")

    # -- the training side -----------------------------------------------------------------------

    def ask(self, request: Send, addr: str) -> None:
        """Send a request ``RankExchanges.start`` made to the partner rank at ``addr``, from any thread (it leaves
        from the network thread). One that cannot leave gets no reply: its status turns failed at its deadline,
        and the group aborts the exchange."""
        body: dict[str, Any] = {"xid": request.xid, "a": float(request.meta["a"]), "step": int(request.meta["step"])}
        if "norm" in request.meta:  # the whole model's norm: a server refuses one far from its own
            body["norm"] = float(request.meta["norm"])
        self._post(addr, XPREQ, body, request.tensors)

    def answer(self, addr: str, answer: Send) -> None:
        """A request's answer (``RankExchanges.serve_waiting``: our piece, or a refusal) to the rank at ``addr``, from
        any thread."""
        body: dict[str, Any] = {"xid": answer.xid}
        if "a" in answer.meta:  # a reply's weight (a staleness weight may have made it less than asked)
            body["a"] = float(answer.meta["a"])
        self._post(addr, answer.kind, body, answer.tensors)

    def tell(self, addr: str, xid: int, outcome: Outcome) -> None:
        """Leader to leader, from any thread: exchange ``xid``'s outcome, for every rank of the partner (``XPEND``)."""
        if outcome == Outcome.WAIT:
            raise ValueError("only a decided exchange is told")
        self._post(addr, XPEND, {"xid": xid, "outcome": int(outcome)})

    def _post(self, addr: str, kind: str, body: dict[str, Any], tensors: Mapping[str, Any] | None = None) -> None:
        self._call(self.send, addr, kind, body, tensors)

    def hello(self, addr: str, layout: PieceLayout, addresses: tuple[str, ...]) -> None:
        """Leader to leader, from any thread: our layout and ranks' addresses to the leader at ``addr`` (its piece
        link, or its member address: ``PeerNode`` answers there); the answer waits for ``welcome_from(addr)``."""
        with self.lock:
            self._welcomes.pop(addr, None)
        self._post(addr, XPHELLO, {"layout": layout.to_wire(), "addresses": list(addresses)})

    def welcome_from(self, addr: str) -> tuple[str, dict[str, Any]] | None:
        """The answer to our hello to ``addr`` (its sender's id, and ``hello_answer``'s words), once; None before."""
        with self.lock:
            return self._welcomes.pop(addr, None)

    def greet(self, addr: str, layout: PieceLayout, addresses: tuple[str, ...], timeout: float) -> tuple[str, dict[str, Any]]:
        """``hello``, then wait for the answer (``welcome_from``). TimeoutError if none comes within ``timeout`` s."""
        self.hello(addr, layout, addresses)
        with self._welcomed:
            if not self._welcomed.wait_for(lambda: addr in self._welcomes, timeout):
                raise TimeoutError(f"no answer from the piece link at {addr} within {timeout} s")
            return self._welcomes.pop(addr)

    def offer(self, copy: StateCopy) -> None:
        """Our piece as a safe point left it, for the newcomers' sessions waiting for one, from any thread."""
        assert self.transfer is not None
        self._call(self.transfer.offer_snapshot, copy)

    def expire(self, now: float) -> None:
        """Drop newcomers' sessions idle past ``state.session_timeout``, from any thread."""
        assert self.transfer is not None
        self._call(self.transfer.tick, now)

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the network thread, soon, from any thread."""
        if self._loop is None:
            raise RuntimeError("the piece link is not started")
        self._loop.call_soon_threadsafe(fn, *args)

    def take_outcomes(self) -> dict[int, tuple[str, Outcome]]:
        """xid -> (requester, outcome) that partners' leaders told us since the last call (the leader hands them
        to every rank; a rank settles a held merge only on the word of the peer that asked for it)."""
        with self.lock:
            out, self._outcomes = self._outcomes, {}
        return out

    # -- the network side ------------------------------------------------------------------------

    def _on_request(self, msg: Message, frames: Sequence[object]) -> None:
        xid = _xid(msg.body)
        a, step, norm = msg.body.get("a"), msg.body.get("step"), msg.body.get("norm")
        if type(a) is not float:
            raise ProtocolError("a piece request's weight 'a' is a float")
        if step is not None and (type(step) is not int or not 0 <= step <= _XID_MAX):
            raise ProtocolError("a piece request's 'step' is a non-negative integer")
        if norm is not None and type(norm) is not float:
            raise ProtocolError("a piece request's 'norm' is a float")
        meta: dict[str, float] = {"a": a}  # (the requester's step: staleness weights; its model's norm: the guard's)
        if step is not None:
            meta["step"] = step
        if norm is not None:
            meta["norm"] = norm
        with self.lock:  # kept for the group's next safe point (every rank answers from the same one), or refused
            refusal = self.exchanges.receive(msg.sender, xid, msg.tensors, meta, self.clock(), msg.addr)
        if refusal is not None:
            self.send(msg.addr, refusal.kind, {"xid": xid})

    def _on_reply(self, msg: Message, frames: Sequence[object]) -> None:
        xid = _xid(msg.body)
        a = msg.body.get("a")
        if a is not None and type(a) is not float:
            raise ProtocolError("a piece reply's weight 'a' is a float")
        with self.lock:
            self.exchanges.reply(msg.sender, xid, msg.tensors, a)

    def _on_refusal(self, msg: Message, frames: Sequence[object]) -> None:
        xid = _xid(msg.body)
        with self.lock:
            self.exchanges.refused(msg.sender, xid)

    def _on_outcome(self, msg: Message, frames: Sequence[object]) -> None:
        xid = _xid(msg.body)
        raw = msg.body.get("outcome")
        if type(raw) is not int or raw not in (Outcome.COMMIT, Outcome.ABORT):
            raise ProtocolError("an exchange's outcome is 1 (commit) or 2 (abort)")
        with self.lock:  # kept even where this rank holds nothing: another rank of ours may (its request came)
            if len(self._outcomes) < MAX_OUTCOMES:
                self._outcomes[xid] = (msg.sender, Outcome(raw))

    def _on_hello(self, msg: Message, frames: Sequence[object]) -> None:
        intro = self.introduction
        if intro is None:
            self.stats.unexpected += 1
            return
        answer = hello_answer(intro[0], intro[1], msg.body)
        if "refused" in answer:
            log.warning("refused %s's hello: %s", msg.sender, answer["refused"])
        self.send(msg.addr, XPWELCOME, answer)

    def _on_state(self, msg: Message, frames: Sequence[object]) -> None:
        if self.transfer is None:
            self.stats.unexpected += 1
            return
        self.transfer.on_message(msg)

    def _on_welcome(self, msg: Message, frames: Sequence[object]) -> None:
        with self._welcomed:
            if len(self._welcomes) < MAX_OUTCOMES:
                self._welcomes[msg.addr] = (msg.sender, dict(msg.body))
                self._welcomed.notify_all()


def _xid(body: Any) -> int:
    xid = body.get("xid") if isinstance(body, dict) else None
    if type(xid) is not int or not 0 <= xid <= _XID_MAX:
        raise ProtocolError("a piece message names its exchange by an integer 'xid'")
    return xid

