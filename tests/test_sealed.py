"""Sealing relayed messages end to end (gossiptrain.net.sealed): only the target opens what the sender sealed."""

from __future__ import annotations

import pytest
import zmq

pytest.importorskip("cryptography", reason="sealing needs the cryptography package (the nat extra; make test installs it)")
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.config import Limits
from gossiptrain.net.sealed import Counter, SealError, Seen, seal, unseal

ALICE, BOB, MALLORY = (zmq.curve_keypair() for _ in range(3))  # (public, secret), Z85
A_AT, B_AT = "tcp://198.19.1.2:4000/client?curve=aa", "tcp://198.19.2.2:4000/client?curve=bb"
LIMITS = Limits()
NUMBERS = Counter()


def sealed_for_bob(frames: list[bytes], chunk: int = 1 << 20, number: int | None = None) -> list[bytes]:
    return seal(frames, secret=ALICE[1], public=ALICE[0], other=BOB[0], sender=A_AT, target=B_AT, chunk=chunk,
                number=NUMBERS.next() if number is None else number)


def opened_by_bob(
    frames: list[bytes], *, sender: str = A_AT, target: str = B_AT, other: bytes = ALICE[0], seen: Seen | None = None
) -> list[bytes]:
    return unseal(frames, secret=BOB[1], public=BOB[0], other=other, sender=sender, target=target, limits=LIMITS,
                  seen=seen or Seen())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=8), st.integers(16, 5000))
def test_what_alice_seals_for_bob_opens_as_it_was_in_frames_of_at_most_the_chunk(frames: list[bytes], chunk: int) -> None:
    out = sealed_for_bob(frames, chunk)
    assert all(len(f) <= chunk for f in out)
    assert opened_by_bob(out) == frames


def test_nobody_else_opens_it_and_nothing_altered_or_redirected_does() -> None:
    frames = [b"xreq", b"parameters " * 50]
    out = sealed_for_bob(frames)
    assert not any(b"parameters" in f for f in out)  # what a relay sees
    with pytest.raises(SealError):  # mallory, with her own key
        unseal(out, secret=MALLORY[1], public=MALLORY[0], other=ALICE[0], sender=A_AT, target=B_AT, limits=LIMITS,
               seen=Seen())
    with pytest.raises(SealError):  # claimed to come from mallory
        opened_by_bob(out, other=MALLORY[0])
    with pytest.raises(SealError):  # passed off as the other direction's, or to another address
        opened_by_bob(out, sender=B_AT, target=A_AT)
    altered = bytearray(out[0])
    altered[20] ^= 1
    with pytest.raises(SealError):
        opened_by_bob([bytes(altered)])
    with pytest.raises(SealError):
        opened_by_bob([out[0][:8]])


def test_what_opens_is_still_held_to_the_limits() -> None:
    too_many = sealed_for_bob([b"x"] * (LIMITS.max_frames + 1))
    with pytest.raises(SealError, match="frames"):
        opened_by_bob(too_many)


def test_a_sealed_message_opens_once_and_only_in_increasing_order() -> None:
    seen = Seen()
    first, second = sealed_for_bob([b"one"]), sealed_for_bob([b"two"])
    assert opened_by_bob(second, seen=seen) == [b"two"]
    with pytest.raises(SealError, match="replay"):  # sent before the one already opened
        opened_by_bob(first, seen=seen)
    with pytest.raises(SealError, match="replay"):  # the same again
        opened_by_bob(second, seen=seen)
    assert opened_by_bob(sealed_for_bob([b"three"]), seen=seen) == [b"three"]
    numbers = Counter()
    drawn = [numbers.next() for _ in range(1000)]
    assert all(b > a for a, b in zip(drawn, drawn[1:]))
