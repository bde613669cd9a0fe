"""Sealing a message end to end between two secure client-mode members, for the relay between them.

CURVE secures each connection, not the path: a relay (the coordinator,
passing messages between two members behind NAT) would read what it
passes. So in a secure swarm the sender seals a relayed message for its
target with their two CURVE keys (Curve25519, as X25519 keys): a key
agreed by X25519, stretched by HKDF-SHA256 and bound to both public keys,
and ChaCha20-Poly1305 over the whole message, with a random nonce and the
two addresses as associated data (a sealed message cannot be replayed to
another member, or passed off as the other direction's). The relay sees
ciphertext cut into frames; the target opens it with its secret key and
the sender's public key, which the sender's address carries, and drops
anything that does not open: a relay can drop or delay, never read, forge
or alter.

Uses the ``cryptography`` package (the ``nat`` extra); without it a secure
client uses no relay (``available``).
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from functools import lru_cache
from typing import Sequence

from zmq.utils import z85

from gossiptrain.config import Limits

_INFO = b"gossiptrain relay v1"
_NONCE = 12
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_NUMBER = struct.Struct("<Q")
_SENDERS_KEPT = 4096  # senders whose last number a target remembers (the least recently heard forgotten)


class SealError(ValueError):
    """A sealed message did not open: not sealed for us by the member it names, altered, or malformed."""


def available() -> bool:
    """Whether sealing can be done here (the ``cryptography`` package is installed)."""
    try:
        import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401
    except ImportError:
        return False
    return True


def _raw(key: bytes) -> bytes:
    """32 raw bytes of a CURVE key given in Z85 (40 characters, as in key files and on the wire) or raw."""
    return z85.decode(key) if len(key) == 40 else key


@lru_cache(maxsize=1024)
def _pair_key(secret: bytes, public: bytes, other: bytes) -> bytes:
    """The symmetric key two members share: X25519 of our secret and their public key, through HKDF."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    shared = X25519PrivateKey.from_private_bytes(_raw(secret)).exchange(X25519PublicKey.from_public_bytes(_raw(other)))
    low, high = sorted((_raw(public), _raw(other)))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO + low + high).derive(shared)


class Counter:
    """The numbers a sender puts on what it seals: nanoseconds of the wall clock, and always more than the last
    (a restarted sender starts past what it sent before, as long as the clock does not go back)."""

    def __init__(self) -> None:
        self._last = 0

    def next(self) -> int:
        self._last = max(time.time_ns(), self._last + 1)
        return self._last


class Seen:
    """A target's record of the last number each sender's sealed messages carried: only greater ones pass."""

    def __init__(self, kept: int = _SENDERS_KEPT) -> None:
        self._last: OrderedDict[str, int] = OrderedDict()
        self._kept = kept

    def fresh(self, sender: str, number: int) -> bool:
        """Whether ``number`` is past the last one ``sender`` sent (then remembered); False for a replay."""
        if number <= self._last.get(sender, 0):
            return False
        self._last[sender] = number
        self._last.move_to_end(sender)
        while len(self._last) > self._kept:
            self._last.popitem(last=False)
        return True


def _aad(sender: str, target: str) -> bytes:
    return sender.encode() + b"\0" + target.encode()


def seal(
    frames: Sequence[bytes | memoryview], *, secret: bytes, public: bytes, other: bytes, sender: str, target: str,
    chunk: int, number: int,
) -> list[bytes]:
    """``frames`` sealed from ``sender`` (our keys) for ``target`` (its public key ``other``), numbered
    ``number`` (``Counter.next``): frames of at most ``chunk`` bytes."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    views = [memoryview(f).cast("B") for f in frames]
    plain = b"".join([_NUMBER.pack(number), _COUNT.pack(len(views)), *(_LENGTH.pack(v.nbytes) for v in views), *views])
    nonce = os.urandom(_NONCE)
    sealed = nonce + ChaCha20Poly1305(_pair_key(secret, public, other)).encrypt(nonce, plain, _aad(sender, target))
    return [sealed[i : i + chunk] for i in range(0, len(sealed), chunk)]


def unseal(
    frames: Sequence[bytes | memoryview], *, secret: bytes, public: bytes, other: bytes, sender: str, target: str,
    limits: Limits, seen: Seen,
) -> list[bytes]:
    """The frames ``sender`` (public key ``other``) sealed for us at ``target``; SealError if they do not open,
    break ``limits``, or were opened before (``seen``: a replay)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    sealed = b"".join(bytes(f) for f in frames)
    if len(sealed) <= _NONCE:
        raise SealError("too short to be sealed")
    try:
        key = _pair_key(secret, public, other)
        plain = ChaCha20Poly1305(key).decrypt(sealed[:_NONCE], sealed[_NONCE:], _aad(sender, target))
    except (InvalidTag, ValueError) as e:
        raise SealError(f"does not open: {type(e).__name__}") from None
    head = _NUMBER.size + _COUNT.size
    if len(plain) < head:
        raise SealError("no number and frame count")
    (number,) = _NUMBER.unpack_from(plain)
    (count,) = _COUNT.unpack_from(plain, _NUMBER.size)
    if count == 0 or count > limits.max_frames or len(plain) < head + count * _LENGTH.size:
        raise SealError(f"{count} frames (limit {limits.max_frames})")
    lengths = [_LENGTH.unpack_from(plain, head + i * _LENGTH.size)[0] for i in range(count)]
    at = head + count * _LENGTH.size
    if any(n > limits.max_frame_bytes for n in lengths) or at + sum(lengths) != len(plain):
        raise SealError("frame lengths do not add up or break the limits")
    if not seen.fresh(sender, number):
        raise SealError(f"a replay: number {number} is not past the last one from {sender}")
    out = []
    for n in lengths:
        out.append(plain[at : at + n])
        at += n
    return out
