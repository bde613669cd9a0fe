"""Whether a newcomer can be dialled at the address it advertises: measured when it joins, not assumed.

Every exchange, probe and state transfer a member starts goes to the other
member's advertised address over a connection it opens itself. A peer
behind NAT, or one advertising an address where it does not listen, can
open connections but accept none: the others cannot start anything with it.

So the member answering a join (the coordinator or any live member) dials
the newcomer back: it sends a ``reach`` probe carrying the nonce of the join
request to the advertised address, over a connection it dials for the probe
(one it kept from an earlier process at that address, a peer restarted on a
fixed port, is still re-dialling that process and would drop the probe; the
nonce makes the proof this join's). The welcome
itself goes back over the newcomer's own connection
(``Transport.reply``), so a newcomer nobody can dial is still answered, and
learns why nobody will start an exchange with it: its probe never comes.

``ReachCheck`` is the newcomer's side; ``probe_body`` and ``nonce_of`` the
two ends of the message. Sans-IO, like the other protocol cores: the caller
passes the time, sends, and waits. A newcomer found unreachable joins again as
a client-mode member: its address ends in ``/client``
(``gossiptrain.net.addressing.client_address``), which is how every member
learns, with the rest of its membership entry, that it cannot be dialled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from gossiptrain.errors import ConfigError, ProtocolError

#: ``--reachable``: measure it (the default), or take the user's word without a probe.
AUTO, YES, NO = "auto", "yes", "no"
MODES = (AUTO, YES, NO)
#: Where ``gossiptrain peer --reachable`` leaves its choice for ``Peer``, which reads it when not told.
REACHABLE_ENV = "GOSSIPTRAIN_REACHABLE"

_NONCE_BOUND = 1 << 63  # as the membership probes' sequence numbers


def check_mode(mode: str, what: str = "--reachable") -> str:
    """``mode`` if it is one of ``MODES``, else a ConfigError naming them."""
    if mode not in MODES:
        raise ConfigError(f"{what} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def new_nonce(rng: random.Random) -> int:
    """A probe's nonce: unguessable from an OS-seeded generator (``random.SystemRandom``)."""
    return rng.randrange(1, _NONCE_BOUND)


def probe_body(nonce: int) -> dict[str, Any]:
    """The body of a ``reach`` probe for a join request that carried ``nonce``."""
    return {"nonce": nonce}


def nonce_of(body: Any) -> int:
    """The nonce a ``reach`` probe carries; ProtocolError if malformed."""
    return checked_nonce(body.get("nonce") if isinstance(body, dict) else None, "a reach probe's nonce")


def checked_nonce(value: Any, what: str = "a join's reach nonce") -> int:
    """``value`` if it is a nonce (an int in (0, 2**63)); ProtocolError naming ``what`` otherwise."""
    if type(value) is not int or not 0 < value < _NONCE_BOUND:
        raise ProtocolError(f"{what} must be an int in (0, 2**63)")
    return value


@dataclass(frozen=True)
class Verdict:
    """Whether others can dial this member at ``address``, and how that is known."""

    reachable: bool
    address: str  # the advertised address, as people read it (without a CURVE key)
    how: str  # "measured" by ``answerer``'s probe, or "--reachable yes|no": the user's word, not checked
    answerer: str = ""  # who answered the join (and dialled back, when measured), as people read it
    waited: float = 0.0  # seconds the probe was waited for, when it never came

    def line(self, member_id: str) -> str:
        """The one line a peer prints: what is known, and what follows from it."""
        at = self.address
        if self.reachable:
            if self.how == "measured":
                return f"peer {member_id} at {at} is reachable: {self.answerer} dialled it back"
            return f"peer {member_id} at {at} is taken to be reachable ({self.how}: not checked)"
        if self.how == "measured":
            why = (
                f"is not reachable from the member that answered its join ({self.answerer} dialled it "
                f"back and nothing arrived within {self.waited:g} s)"
            )
        else:
            why = f"is not reachable ({self.how})"
        return (
            f"peer {member_id} at {at} {why}: it trains as a client-mode member (its address now ends in "
            "/client), opening every connection itself; members answer, probe and exchange with it over those, "
            "other clients through a relay (a peer run with --relay, else the coordinator). To be reachable, set "
            "--advertise to an address others can dial (a public address, a forwarded port)"
        )


class ReachCheck:
    """A newcomer's side: the nonce its join carries, and the verdict once the probe came or the wait ran out.

    With ``--reachable yes`` or ``no`` nothing is probed (``nonce`` is None)
    and the verdict is the user's word at once.
    """

    def __init__(self, mode: str, rng: random.Random) -> None:
        self.mode = check_mode(mode)
        self.nonce: int | None = new_nonce(rng) if mode == AUTO else None
        self.probed = False  # our probe arrived (possibly before the welcome did)
        self._deadline: float | None = None
        self._waited = 0.0
        self._answerer = ""

    def on_probe(self, nonce: int) -> bool:
        """A ``reach`` probe arrived at our advertised address; True if it is ours (its nonce is our join's)."""
        if self.nonce is None or nonce != self.nonce:
            return False
        self.probed = True
        return True

    def welcomed(self, answerer: str, now: float, wait: float) -> None:
        """We were welcomed by ``answerer`` (as people read it): its probe has ``wait`` seconds from ``now`` to arrive."""
        self._answerer = answerer
        self._deadline = now + wait
        self._waited = wait

    def verdict(self, address: str, now: float) -> Verdict | None:
        """The verdict for our ``address`` (as people read it), or None while the probe may still come."""
        if self.mode != AUTO:
            return Verdict(self.mode == YES, address, f"--reachable {self.mode}", self._answerer)
        if self.probed:
            return Verdict(True, address, "measured", self._answerer)
        if self._deadline is None or now < self._deadline:
            return None
        return Verdict(False, address, "measured", self._answerer, self._waited)

    def wake_at(self) -> float | None:
        """When the verdict is due at the latest (None before the welcome)."""
        return self._deadline
