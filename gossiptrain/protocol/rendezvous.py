"""A rendezvous without a master: who is ready to train, gossiped as a grow-only set.

``gossiptrain peer --wait-for N`` and ``Peer.wait_for_peers(N)`` hold a
peer's first step until N members are *ready*: joined and past their state
download, the point after which a member's model is final and it trains at
once. Counting members in the membership view instead released the first
peers while the last ones were still building their models or downloading
state; those then downloaded from a peer that had already trained (starts
2 s apart on loopback, up to 3.7 s over a shaped link).

Each member keeps the set of members it knows to be ready, itself included
once it is. The set only grows and merging is a union, so every member's set
converges whatever the order of messages. A waiting member sends its set to
up to ``fanout`` members not known to be ready when it arrives and again
every ``interval`` seconds (``alive``: the members it can send to); a ready
member answers a set that lacks it, or any member it knows to be ready, with
its own, so that members who cannot reach each other (two behind NAT) learn
of each other through those who can reach both. The first member whose set reaches its count tells every live
member at once (``go``), so the others start one message later rather than
one gossip round later; a member released by a ``go`` does not repeat it.
A ready member known to have died or left is not counted; one we have not
heard of yet is (its arrival reached us before its join did: the
membership view lags a gossip round behind).

A member that lies can only release a rendezvous early (it cannot hold one
back: a peer still starts when its own set is full). Sans-IO like the other
protocol cores: the driver (``gossiptrain.runtime.peer_network``) sends what
the methods return and calls ``tick`` by ``next_timer``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gossiptrain.errors import ProtocolError

_MAX_ID = 64  # as membership's member ids


@dataclass(frozen=True)
class SendReady:
    """Send our ready set to member ``to``; ``go``: our count is reached, start now."""

    to: str
    ready: tuple[str, ...]
    go: bool = False


def ready_from_wire(body: dict[str, Any], limit: int) -> tuple[tuple[str, ...], bool]:
    """The (ids, go) a ready message carries; ProtocolError if malformed or over ``limit`` ids."""
    ids, go = body.get("ready"), body.get("go", False)
    if not isinstance(ids, list) or len(ids) > limit:
        raise ProtocolError(f"ready must be a list of at most {limit} member ids")
    if not all(type(i) is str and 0 < len(i) <= _MAX_ID for i in ids) or type(go) is not bool:
        raise ProtocolError("ready holds member ids (strings of 1-64 characters) and go a bool")
    return tuple(ids), go


class Rendezvous:
    """One member's side. ``alive``, passed to every call, is the live view (ids, ourselves included): whom to ask.

    ``gone(id)``: whether the membership knows that member dead or left.
    """

    def __init__(
        self, me: str, *, interval: float, max_ids: int, rng: random.Random, fanout: int = 8,
        gone: Callable[[str], bool] = lambda member: False,
    ) -> None:
        self.me = me
        self.gone = gone
        self.interval = interval
        self.max_ids = max_ids
        self.fanout = fanout
        self._rng = rng
        self.ready: set[str] = set()
        self.wanted = 0  # the count we wait for (0: we do not wait)
        self.released = False  # our count was reached: we train
        self._next = math.inf

    @property
    def arrived(self) -> bool:
        return self.me in self.ready

    @property
    def waiting(self) -> bool:
        """Whether we wait for our count (``tick`` does nothing otherwise: a driver need not build its view)."""
        return self._waiting()

    def count(self) -> int:
        """Members known to be ready and not known to be gone, ourselves included."""
        return sum(1 for m in self.ready if not self.gone(m))

    def next_timer(self) -> float:
        return self._next if self._waiting() else math.inf

    def arrive(self, now: float, alive: Sequence[str]) -> list[SendReady]:
        """We are ready to train (joined, state downloaded): count us, and tell others if we wait."""
        self.ready.add(self.me)
        return self._progress(now, alive, announce=True)

    def wait(self, count: int, now: float, alive: Sequence[str]) -> list[SendReady]:
        """Wait for ``count`` ready members (ourselves included); ``released`` says when they are there."""
        if count < 1:
            raise ValueError(f"a rendezvous waits for at least 1 member, not {count}")
        self.wanted, self.released = count, False
        return self._progress(now, alive, announce=True)

    def handle(self, sender: str, ids: Sequence[str], go: bool, now: float, alive: Sequence[str]) -> list[SendReady]:
        """A member's ready set: merge it, answer it if it lacks us, start if our count is reached."""
        for i in ids:
            if len(self.ready) >= self.max_ids:
                break  # bounded: an id past the bound is someone we never need (a live view is smaller)
            self.ready.add(i)
        out: list[SendReady] = []
        broadcast = self._waiting() and self._reached() and not go  # our go below reaches the sender too
        # Answered when it lacks us, or anyone we know ready: members that cannot reach each other (two behind
        # NAT) learn of each other through those that can reach both.
        if self.arrived and not broadcast and (self.me not in ids or not self.ready.issubset(ids)):
            out.append(SendReady(sender, self._set()))
        return out + self._progress(now, alive, announce=False, told=go)

    def met(self, members: Sequence[str]) -> list[SendReady]:
        """Members just came into our view (verified): ask them at once while we wait, not at the next interval."""
        if not self._waiting() or self._reached():
            return []
        ids = self._set()
        return [SendReady(m, ids) for m in members if m not in self.ready and m != self.me]

    def tick(self, now: float, alive: Sequence[str]) -> list[SendReady]:
        """Ask again, every ``interval`` while we wait, members we do not know to be ready."""
        if not self._waiting():
            return []
        if self._reached():
            return self._progress(now, alive, announce=False)
        if now < self._next:
            return []
        return self._ask(now, alive)

    # -- inside --------------------------------------------------------------------------------

    def _waiting(self) -> bool:
        return self.wanted > 0 and not self.released and self.arrived

    def _reached(self) -> bool:
        return self.wanted > 0 and self.arrived and self.count() >= self.wanted

    def _progress(self, now: float, alive: Sequence[str], *, announce: bool, told: bool = False) -> list[SendReady]:
        if not self._waiting():
            return []
        if self._reached():
            self.released = True
            if told:  # whoever told us told everyone
                return []
            ids = self._set()
            # Every live member, and every member we counted: one whose arrival reached us before our
            # membership verified it (a candidate yet, gossiptrain.protocol.candidates) would otherwise
            # wait for its own next ask (starts 0.5 s apart on loopback, experiments/wan.py).
            return [SendReady(m, ids, go=True) for m in sorted({*alive, *self.ready}) if m != self.me]
        return self._ask(now, alive) if announce else []

    def _ask(self, now: float, alive: Sequence[str]) -> list[SendReady]:
        self._next = now + self.interval
        unknown = [m for m in alive if m not in self.ready]
        # Every member we can ask is ready and we still wait: those we count on are ones we cannot send to
        # (behind NAT); whoever we ask answers with what it knows.
        pool = unknown or [m for m in alive if m != self.me]
        ids = self._set()
        return [SendReady(m, ids) for m in self._rng.sample(pool, min(self.fanout, len(pool)))]

    def _set(self) -> tuple[str, ...]:
        return tuple(sorted(self.ready))
