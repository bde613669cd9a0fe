"""What an address says by its form alone: a CURVE key, a client-mode member. Plain strings, no I/O.

Kept apart from ``gossiptrain.net.addressing`` (which resolves hosts and
reads keys) so that the sans-IO protocol cores can tell a client-mode
member's address from a dialable one.
"""

from __future__ import annotations

#: A secure member's address ends in this, then its CURVE public key in hex.
CURVE_QUERY = "?curve="
#: A client-mode member's URL ends in this (before any CURVE key): nobody can dial it (it is behind NAT or a
#: firewall), so messages for it go back over connections it opened itself (``Transport.become_client``).
CLIENT_PATH = "/client"


def client_address(address: str) -> str:
    """``address`` marked as a client-mode member's (``CLIENT_PATH`` after the URL, any CURVE key kept)."""
    url, sep, key = address.partition(CURVE_QUERY)
    return address if url.endswith(CLIENT_PATH) else url + CLIENT_PATH + sep + key


def is_client_address(address: str) -> bool:
    """Whether ``address`` is a client-mode member's: reached only over a connection it opened."""
    return CLIENT_PATH in address and address.partition(CURVE_QUERY)[0].endswith(CLIENT_PATH)


def plain_address(address: str) -> str:
    """An address without its CURVE key, for messages people read."""
    return address.partition(CURVE_QUERY)[0]
