"""Answering joins, the same way on the coordinator and on every peer (so ``--join`` may name either).

A join is charged to its source and dropped unanswered over the per-source
rate (``gossiptrain.protocol.admission``), then decided by the pure
``gossiptrain.protocol.joining.answer_join``, answered, and the newcomer
handed to the subclass (the coordinator records it, a peer adds it to its
membership view as a placeholder until it starts).

The answer goes back over the newcomer's own connection
(``Endpoint.reply``), so a newcomer nobody can dial at the address it
advertises (behind NAT, say) is answered all the same. A newcomer that asks
(its request carries a nonce) is dialled back there with a ``reach`` probe:
whether that arrives tells it whether others can start exchanges with it
(``gossiptrain.protocol.reachability``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import OrderedDict
from typing import Any, Callable, Sequence

from gossiptrain.config import Limits, RunConfig
from gossiptrain.net.addressing import CURVE_QUERY, key_id
from gossiptrain.net.kinds import REACH, REFUSE, WELCOME
from gossiptrain.net.transport import Transport
from gossiptrain.net.wire import Message
from gossiptrain.protocol.admission import JoinLimiter, join_source
from gossiptrain.protocol.joining import JoinRequest, answer_join
from gossiptrain.protocol.member import Member
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.reachability import probe_body
from gossiptrain.runtime.clock import Clock
from gossiptrain.runtime.endpoint import Endpoint

log = logging.getLogger(__name__)

#: Welcomes remembered by the newcomer's token, so that a retry after a lost welcome gets the same id and shard:
#: the most recent this many, for this long (a join's attempts span well under a minute with the defaults).
WELCOMES_KEPT = 4096
WELCOME_KEPT_S = 120.0


class JoinAnsweringEndpoint(Endpoint):
    """An endpoint that answers joins; subclasses say whom to introduce and what to do with a newcomer.

    Subclasses provide ``config``, ``clock``, ``rng``, ``spec`` (the swarm's
    model, once known) and counters ``joins_answered``, ``joins_refused`` and
    ``joins_throttled`` in ``stats``; they route ``kinds.JOIN`` to ``_on_join``.
    """

    config: RunConfig
    clock: Clock
    rng: random.Random
    spec: ParamSpec | None

    def __init__(self, transport: Transport, limits: Limits, **endpoint: Any) -> None:
        super().__init__(transport, limits, **endpoint)
        self.join_limiter = JoinLimiter.from_limits(limits)  # one token bucket per source
        # A join's token -> (the id and shard we gave it, when): a retry whose welcome was lost gets the same again
        self._welcomes: OrderedDict[int, tuple[str, int, float]] = OrderedDict()

    def _join_sample(self) -> tuple[Sequence[Member], Callable[[int], int]]:
        """Members to introduce a newcomer to, and how to pick its shard (given the shard count)."""
        raise NotImplementedError

    def _coordinator_address(self) -> str:
        """The coordinator's address for the newcomer to report to ("" if none is known)."""
        raise NotImplementedError

    def _welcomed(self, newcomer: Member, request: JoinRequest) -> None:
        """A newcomer was admitted (its welcome is sent right after)."""

    def _welcome_given(self, token: int | None) -> tuple[str, int, float] | None:
        """The id and shard we welcomed ``token`` with in the last ``WELCOME_KEPT_S`` seconds, if any."""
        now = self.clock.now()
        while self._welcomes and now - next(iter(self._welcomes.values()))[2] > WELCOME_KEPT_S:
            self._welcomes.popitem(last=False)
        return self._welcomes.get(token) if token is not None else None

    def _remember_welcome(self, token: int | None, newcomer: Member) -> None:
        if token is None:
            return
        self._welcomes[token] = (newcomer.id, newcomer.shard, self.clock.now())
        self._welcomes.move_to_end(token)
        while len(self._welcomes) > WELCOMES_KEPT:
            self._welcomes.popitem(last=False)

    def _on_join(self, msg: Message, frames: Sequence[object]) -> None:
        if not self.join_limiter.allow(join_source(self.transport.source_of(frames), msg.addr), self.clock.now()):
            self.stats.joins_throttled += 1  # type: ignore[attr-defined]
            return
        request = JoinRequest.from_body(msg.body)
        member_id = key_id(msg.addr) if CURVE_QUERY in self.sender_address else None
        if CURVE_QUERY in self.sender_address and member_id is None:
            self.stats.joins_refused += 1  # type: ignore[attr-defined]
            self.reply(frames, REFUSE, {"reason": "this swarm is secure: a member's address must carry its CURVE key"})
            return
        sample, pick_shard = self._join_sample()
        again = self._welcome_given(request.token)
        if again is not None:  # our welcome to this newcomer was lost (or is late): the same id and shard again
            member_id = member_id or again[0]
            if request.shard < 0:
                request = dataclasses.replace(request, shard=again[1])
        kind, body = answer_join(
            request,
            config=self.config,
            spec=self.spec,
            sample=sample,
            pick_shard=pick_shard,
            coordinator=self._coordinator_address(),
            rng=self.rng,
            member_id=member_id,  # secure: the id its key entitles it to (gossiptrain.net.addressing.key_id_of)
        )
        if kind == WELCOME:
            self.stats.joins_answered += 1  # type: ignore[attr-defined]
            newcomer = Member(body["id"], msg.addr, body["shard"], incarnation=0)
            self._remember_welcome(request.token, newcomer)
            self._welcomed(newcomer, request)
            log.info("welcomed %s at %s (shard %d)", newcomer.id, newcomer.addr, newcomer.shard)
            if request.reach is not None:  # first: its connection is being made while the welcome travels
                # Over a connection dialled now. One kept from an earlier member at this address (the same peer
                # restarted there) is still re-dialling the gone process: a probe sent on it is dropped at once.
                self.transport.forget(msg.addr)
                self.send(msg.addr, REACH, probe_body(request.reach))
        else:
            self.stats.joins_refused += 1  # type: ignore[attr-defined]
            log.warning("refused a join from %s: %s", msg.addr, body["reason"])
        self.reply(frames, kind, body)
