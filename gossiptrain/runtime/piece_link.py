"""One rank's own socket for its piece's exchanges (issue 48): no rank carries another's bytes.

A peer whose model is split across its ranks averages rank by rank
(``gossiptrain.protocol.piece_exchange``). Each rank listens at its own
address and sends its piece to the same rank of the partner peer; what
arrives is handed to the rank's ``RankExchanges`` on the network thread at
once: a request is checked and kept until the group's next safe point, where
every rank that holds it answers it from the piece that safe point took
(``gossiptrain.runtime.split_group``). The group's rank 0 also carries the leaders'
word: the outcome of each exchange (``XPEND``), kept until its next safe
point hands it to every rank (``take_outcomes``), and newcomers' asks for
the pieces (``XPSTATE``, ``take_wanted``). A newcomer's rank takes only the
piece it awaits (``await_piece``: ``XPPIECE`` of that tag, from the donor).

Bodies are small and checked (``xid``, ``a``, ``outcome``); a malformed one
is a ``ProtocolError``, which the endpoint counts and drops. The training
side and this network side call the rank's machine under one lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Mapping, Sequence

from torch import Tensor

from gossiptrain.config import Limits
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import XPEND, XPHELLO, XPNAK, XPPIECE, XPREP, XPREQ, XPSTATE, XPWELCOME
from gossiptrain.net.transport import Transport
from gossiptrain.net.wire import Message
from gossiptrain.protocol.piece_exchange import MAX_ADDRESS, Outcome, RankExchanges, Send, hello_answer
from gossiptrain.protocol.pieces import PieceLayout
from gossiptrain.runtime.endpoint import Endpoint

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
        lock: threading.Lock | threading.RLock | None = None,
    ) -> None:
        super().__init__(transport, limits, sender=sender, fingerprint=fingerprint)
        self.exchanges = exchanges
        self.clock = clock
        self.lock = lock if lock is not None else threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None  # the network thread's, once started
        self._outcomes: dict[int, tuple[str, Outcome]] = {}  # leader: xid -> (requester, its word), until our safe point
        # Leader: what a hello is answered with (our layout, every rank's address); None: hellos are not ours.
        self.introduction: tuple[PieceLayout, tuple[str, ...]] | None = None
        self._welcomes: dict[str, tuple[str, dict[str, Any]]] = {}  # addr asked -> (its id, its answer)
        self._welcomed = threading.Condition(self.lock)
        self._wanted: dict[int, tuple[str, list[str]]] = {}  # leader: tag -> (newcomer, its ranks' addresses)
        self._awaited: dict[int, tuple[str, dict[str, Tensor] | None]] = {}  # tag -> (the donor, its piece once here)
        self.piece_step = 0  # the donor's step at the piece awaited (``XPPIECE``'s ``step``)
        self.handlers = {XPREQ: self._on_request, XPREP: self._on_reply, XPNAK: self._on_refusal, XPEND: self._on_outcome,
                         XPHELLO: self._on_hello, XPWELCOME: self._on_welcome, XPSTATE: self._on_want,
                         XPPIECE: self._on_piece}

    @property
    def address(self) -> str:
        """Where partners' ranks reach this one (the bound address once started)."""
        return self.sender_address

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.transport.start(timeout=10)  # ours alone: started and closed with the link
        await super()._start()

    async def _close(self) -> None:
        await self.transport.close("piece link closed")

    # -- the training side -----------------------------------------------------------------------

    def ask(self, request: Send, addr: str) -> None:
        """Send a request ``RankExchanges.start`` made to the partner rank at ``addr``, from any thread (it leaves
        from the network thread). One that cannot leave gets no reply: its status turns failed at its deadline,
        and the group aborts the exchange."""
        self._post(addr, XPREQ, {"xid": request.xid, "a": float(request.meta["a"])}, request.tensors)

    def answer(self, addr: str, answer: Send) -> None:
        """A request's answer (``RankExchanges.serve_waiting``: our piece, or a refusal) to the rank at ``addr``, from
        any thread."""
        self._post(addr, answer.kind, {"xid": answer.xid}, answer.tensors)

    def tell(self, addr: str, xid: int, outcome: Outcome) -> None:
        """Leader to leader, from any thread: exchange ``xid``'s outcome, for every rank of the partner (``XPEND``)."""
        if outcome == Outcome.WAIT:
            raise ValueError("only a decided exchange is told")
        self._post(addr, XPEND, {"xid": xid, "outcome": int(outcome)})

    def _post(self, addr: str, kind: str, body: dict[str, Any], tensors: Mapping[str, Any] | None = None) -> None:
        if self._loop is None:
            raise RuntimeError("the piece link is not started")
        self._loop.call_soon_threadsafe(self.send, addr, kind, body, tensors)

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

    def want(self, addr: str, tag: int, addresses: Sequence[str]) -> None:
        """Newcomer's leader to the donor's leader at ``addr``: send each of our ranks (at ``addresses``) its piece."""
        self._post(addr, XPSTATE, {"tag": tag, "addresses": list(addresses)})

    def take_wanted(self, most: int) -> list[tuple[int, str, list[str]]]:
        """(tag, newcomer, its ranks' addresses) asked of us since the last call, at most ``most`` (the rest wait)."""
        with self.lock:
            tags = list(self._wanted)[:most]
            return [(tag, *self._wanted.pop(tag)) for tag in tags]

    def give(self, addr: str, tag: int, piece: Mapping[str, Tensor], step: int = 0) -> None:
        """Donor's rank to the newcomer's rank at ``addr``: our piece as of this safe point (the donor's ``step``
        then), from any thread."""
        self._post(addr, XPPIECE, {"tag": tag, "step": step}, piece)

    def await_piece(self, tag: int, donor: str) -> None:
        """From now on, keep ``donor``'s piece of ``tag`` (``XPPIECE``) for ``wait_piece``; any other is dropped."""
        with self.lock:
            self._awaited = {tag: (donor, None)}
            self.piece_step = 0

    def wait_piece(self, tag: int, timeout: float) -> dict[str, Tensor] | None:
        """The piece awaited (``await_piece``), or None if it has not come within ``timeout`` seconds."""
        with self._welcomed:
            self._welcomed.wait_for(lambda: self._awaited.get(tag, ("", None))[1] is not None, timeout)
            return self._awaited.pop(tag, ("", None))[1]

    def take_outcomes(self) -> dict[int, tuple[str, Outcome]]:
        """xid -> (requester, outcome) that partners' leaders told us since the last call (the leader hands them
        to every rank; a rank settles a held merge only on the word of the peer that asked for it)."""
        with self.lock:
            out, self._outcomes = self._outcomes, {}
        return out

    # -- the network side ------------------------------------------------------------------------

    def _on_request(self, msg: Message, frames: Sequence[object]) -> None:
        xid = _xid(msg.body)
        a = msg.body.get("a")
        if type(a) is not float:
            raise ProtocolError("a piece request's weight 'a' is a float")
        with self.lock:  # kept for the group's next safe point (every rank answers from the same one), or refused
            refusal = self.exchanges.receive(msg.sender, xid, msg.tensors, {"a": a}, self.clock(), msg.addr)
        if refusal is not None:
            self.send(msg.addr, refusal.kind, {"xid": xid})

    def _on_reply(self, msg: Message, frames: Sequence[object]) -> None:
        xid = _xid(msg.body)
        with self.lock:
            self.exchanges.reply(msg.sender, xid, msg.tensors)

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

    def _on_want(self, msg: Message, frames: Sequence[object]) -> None:
        tag, addresses = _tag(msg.body), msg.body.get("addresses")
        if self.introduction is None:
            self.stats.unexpected += 1  # only a leader gives its peer's pieces
            return
        if not (isinstance(addresses, list) and len(addresses) == len(self.introduction[1])
                and all(type(a) is str and 0 < len(a) <= MAX_ADDRESS for a in addresses)):
            raise ProtocolError("a state ask names one address (a string) for each of our ranks")
        with self.lock:
            if len(self._wanted) < MAX_OUTCOMES:
                self._wanted[tag] = (msg.sender, addresses)

    def _on_piece(self, msg: Message, frames: Sequence[object]) -> None:
        tag = _tag(msg.body)
        with self._welcomed:
            awaited = self._awaited.get(tag)
            if awaited is None or awaited[0] != msg.sender or awaited[1] is not None:
                self.stats.unexpected += 1
                return
            self._awaited[tag] = (msg.sender, dict(msg.tensors))
            step = msg.body.get("step", 0) if isinstance(msg.body, dict) else 0
            self.piece_step = step if type(step) is int and 0 <= step <= _XID_MAX else 0  # the donor's, for its leader
            self._welcomed.notify_all()

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


def _tag(body: Any) -> int:
    tag = body.get("tag") if isinstance(body, dict) else None
    if type(tag) is not int or not 0 <= tag <= _XID_MAX:
        raise ProtocolError("a piece download names itself by an integer 'tag'")
    return tag
