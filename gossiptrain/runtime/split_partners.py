"""Which split partner a split peer's leader averages with next, and where that partner's ranks listen (issue 48).

A split peer's ranks exchange piece by piece with the same ranks of a
partner (``gossiptrain.runtime.split_group``), so its leader must know where
every rank of the partner listens. Membership knows one address per member
(its leader's); the leader asks there once (``XPHELLO``, answered by the
partner's ``PeerNode`` with its layout and its ranks' addresses, or refused
naming both layouts) and keeps the answer for as long as the member lives.
Nothing here blocks the training loop: a hello goes out at one safe point and
its answer is read at a later one; a partner that has not answered within
``HELLO_TIMEOUT`` seconds (not started yet, or gone) is asked again later.
"""

from __future__ import annotations

import logging
import random
from typing import Callable, Collection, Sequence

from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.piece_exchange import welcome_addresses
from gossiptrain.protocol.pieces import PieceLayout
from gossiptrain.runtime.piece_link import PieceLink
from gossiptrain.runtime.split_group import Partner

log = logging.getLogger(__name__)

#: Seconds a hello waits for its answer before the member is asked again.
HELLO_TIMEOUT = 2.0
#: Hellos out at once, at most (a swarm of thousands is met a few members at a time).
MAX_HELLOS = 8


class PartnerBook:
    """The leader's partners: met (their ranks' addresses), being asked, or refused (another layout)."""

    def __init__(self, link: PieceLink, layout: PieceLayout, addresses: tuple[str, ...], *,
                 clock: Callable[[], float], rng: random.Random) -> None:
        self.link = link
        self.layout = layout
        self.addresses = addresses
        self.clock = clock
        self.rng = rng
        self.met: dict[str, Partner] = {}
        self.asking: dict[str, tuple[str, float]] = {}  # member id -> (the address asked, when)
        self.refused: dict[str, str] = {}  # member id -> why (its words), never asked again

    def pick(self, candidates: Sequence[tuple[str, str]], among: Collection[str] | None = None) -> Partner | None:
        """A partner met among ``candidates`` (id, member address: the live members but us), at random, and among
        ``among`` where given (the topology's neighbours this round); hellos to the candidates not met yet, so that
        a neighbour of a later round is met by then. Members gone from ``candidates`` are forgotten (a rejoined one
        is met again)."""
        now = self.clock()
        live = dict(candidates)
        for mid in [m for m in self.met if m not in live]:
            del self.met[mid]
        for mid, (addr, at) in list(self.asking.items()):
            answer = self.link.welcome_from(addr)
            if answer is not None:
                del self.asking[mid]
                self._answered(mid, answer[1])
            elif now - at > HELLO_TIMEOUT or mid not in live:
                del self.asking[mid]
        for mid, addr in candidates:
            if len(self.asking) >= MAX_HELLOS:
                break
            if mid not in self.met and mid not in self.asking and mid not in self.refused:
                self.asking[mid] = (addr, now)
                self.link.hello(addr, self.layout, self.addresses)
        wanted = set(among) if among is not None else None
        usable = [self.met[mid] for mid, _ in candidates if mid in self.met and (wanted is None or mid in wanted)]
        return self.rng.choice(usable) if usable else None

    def _answered(self, mid: str, body: dict[str, object]) -> None:
        try:
            self.met[mid] = Partner(mid, welcome_addresses(self.layout, body))
        except ProtocolError as e:
            self.refused[mid] = str(e)
            log.warning("not averaging with %s: %s", mid, e)
