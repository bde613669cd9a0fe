"""Choose a transport backend by URI scheme.

Code above the transport asks for ``listen(url, limits)`` and never names a
backend, so a peer runs unchanged on ``tcp://`` and in the simulator's
``sim://``. Each backend registers itself here in one line.
"""

from __future__ import annotations

from typing import Any, Callable

from gossiptrain.config import Limits
from gossiptrain.errors import ConfigError
from gossiptrain.net.transport.base import Transport, TransportStats
from gossiptrain.net.transport.sim import SimTransport
from gossiptrain.net.transport.tcp import TcpTransport

__all__ = ["Transport", "TransportStats", "listen", "register", "schemes"]

#: Builds an unstarted transport bound (once started) at a URL of its scheme;
#: backend options (tcp's ``security``) come as keywords.
Factory = Callable[..., Transport]

_factories: dict[str, Factory] = {}


def register(scheme: str, factory: Factory) -> None:
    """Make ``listen`` build ``scheme://...`` URLs with ``factory`` (replacing any earlier one)."""
    if not scheme.isascii() or not scheme.isalnum() or scheme != scheme.lower():
        raise ValueError(f"transport scheme must be lowercase letters and digits, got {scheme!r}")
    _factories[scheme] = factory


def schemes() -> tuple[str, ...]:
    """The URL schemes ``listen`` knows, sorted."""
    return tuple(sorted(_factories))


def listen(url: str, limits: Limits, **options: Any) -> Transport:
    """An unstarted transport that will listen at ``url``; ConfigError names a bad URL.

    ``options`` go to the backend's constructor (``security=`` for tcp://).
    """
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ConfigError(f"invalid transport URL {url!r}: expected scheme://address ({_known()})")
    factory = _factories.get(scheme.lower())
    if factory is None:
        raise ConfigError(f"invalid transport URL {url!r}: unknown scheme {scheme!r} ({_known()})")
    try:
        return factory(url, limits, **options)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"invalid transport URL {url!r}: {e}") from None


def _known() -> str:
    return "known schemes: " + ", ".join(schemes())


register("tcp", TcpTransport)
register("sim", SimTransport)  # needs an active SimNetwork (gossiptrain.sim sets one up)
