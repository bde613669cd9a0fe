"""Addresses, owned by the network layer: HOST:PORT parsing, tcp:// URLs, CURVE keys in addresses, routes.

A secure member's address carries its CURVE public key
(``tcp://host:port?curve=<64 hex digits>``), so whoever dials it can
authenticate the answer; people read addresses without the key
(``plain_address``). A client-mode member's (one nobody can dial) ends its
URL in ``/client``: ``tcp://host:port/client``, with the key after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import re
import socket

from zmq.utils import z85

from gossiptrain.errors import ConfigError
from gossiptrain.net.address_forms import (  # noqa: F401  (re-exported: the string forms, in their own module)
    CLIENT_PATH,
    CURVE_QUERY,
    client_address,
    is_client_address,
    plain_address,
)

_CURVE_HEX = re.compile(r"[0-9a-f]{64}")


def parse_hostport(text: str, what: str = "address") -> tuple[str, int]:
    """'host:port', '[::1]:port' or 'tcp://host:port' -> (host, port), with a clear error."""
    raw = text.removeprefix("tcp://")
    host, sep, port = raw.rpartition(":")
    if not sep or not host.strip("[]") or not (port.isascii() and port.isdigit()):
        raise ConfigError(f"{what} {text!r} must look like HOST:PORT (e.g. 127.0.0.1:7070)")
    if int(port) > 65535:
        raise ConfigError(f"{what} {text!r}: port {int(port)} is out of range (0-65535)")
    return host.strip("[]"), int(port)


async def connection_refused(url: str, timeout: float = 1.0) -> bool | None:
    """Whether nothing listens at ``url``: True if every TCP connection to it is refused, False if one is accepted.

    None where it cannot tell: not a tcp:// URL, no answer within
    ``timeout``, no route. A connection accepted is closed at once, before
    any handshake, so the listener counts it as a failed handshake: look
    only when an answer is overdue.
    """
    if not url.startswith("tcp://"):
        return None
    try:
        host, port = parse_hostport(plain_address(url))
    except ConfigError:
        return None
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
    except (OSError, TimeoutError):
        return None
    refused = 0
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(s, sockaddr), timeout)
            except ConnectionRefusedError:
                refused += 1
                continue
            except (OSError, TimeoutError):
                continue
            return False
    return True if infos and refused == len(infos) else None


#: Hosts that mean "every interface" to bind(): what a listener may be bound to, never an address to dial.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def is_wildcard(host: str) -> bool:
    """Whether ``host`` (brackets allowed) is a wildcard bind address (0.0.0.0, ::), not one anyone can dial."""
    return host.strip("[]") in WILDCARD_HOSTS


def parse_host(text: str, what: str = "host") -> str:
    """'10.0.0.5', 'fd00::5', '[fd00::5]' or a name -> the host as ``tcp_url`` takes it (IPv6 without brackets).

    For an address others dial (``--advertise``): a wildcard is nobody's
    address, and HOST:PORT is a mistake (the port is the bound one), so both
    are a ConfigError that says so.
    """
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if is_wildcard(host):
        raise ConfigError(
            f"{what} {text!r} is a wildcard, nobody's address: give an address of this machine the others can reach"
        )
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(
                f"{what} {text!r} must be a host (a name, an IPv4 or IPv6 address), not HOST:PORT: the port is the bound one"
            ) from None
    return host


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now, released at once: for what cannot bind port 0 and say which it got (a
    gloo rendezvous, sshd, a join address nothing listens at). Another process may take it meanwhile: local use only."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tcp_url(host: str, port: int) -> str:
    """tcp://host:port, with an IPv6 host in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def route_address(remote_host: str) -> str:
    """The local address of the interface that routes to ``remote_host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(remote_host, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve join host {remote_host!r}: {e.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"


def advertised_host(join_host: str, bind_host: str | None, advertise: str | None) -> str:
    """The host a peer tells others to dial: ``advertise`` if given (checked: a wildcard or a HOST:PORT is refused,
    named), else the host it binds to, else (bound to every interface, or not at all) the local address of the
    interface that routes to the join host, so that a peer joining a remote host never advertises 127.0.0.1."""
    if advertise is not None:
        return parse_host(advertise, "advertise address")
    if bind_host is not None and not is_wildcard(bind_host):
        return bind_host
    return route_address(join_host)


def curve_address(url: str, public_key: bytes) -> str:
    """``url`` with a CURVE public key (Z85, as in key files) attached: how a secure member is addressed."""
    return f"{url}{CURVE_QUERY}{z85.decode(public_key).hex()}"


def split_curve_address(address: str) -> tuple[str, bytes | None]:
    """(plain URL, the server's Z85 public key or None); ValueError if the key part is malformed."""
    url, sep, key = address.partition(CURVE_QUERY)
    if not sep:
        return address, None
    if not _CURVE_HEX.fullmatch(key):
        raise ValueError(f"the key after {CURVE_QUERY!r} must be 64 lowercase hex digits")
    return url, z85.encode(bytes.fromhex(key))


_KEY_ID = re.compile(r"k[0-9a-f]{20}")


def key_id_of(public_key: bytes) -> str:
    """The member id a CURVE public key (32 raw bytes, or Z85 as in key files) entitles its holder to.

    In a secure swarm a member's id is derived from its key, as libp2p's
    peer ids are: ``k`` and 20 hex digits of its BLAKE2b hash. Nobody can
    then claim another's id, since an address carries the key it derives
    from and only the key's holder completes a handshake there.
    """
    raw = z85.decode(public_key) if len(public_key) == 40 else public_key
    return "k" + hashlib.blake2b(raw, digest_size=10).hexdigest()


def key_id(address: str) -> str | None:
    """The member id a secure member's address entitles it to (``key_id_of`` its key); None without a key."""
    _, sep, key = address.partition(CURVE_QUERY)
    if not sep or not _CURVE_HEX.fullmatch(key):
        return None
    return key_id_of(bytes.fromhex(key))


def is_key_id(member_id: str) -> bool:
    """Whether ``member_id`` has the form of a key-derived id (what a secure swarm's members are called)."""
    return _KEY_ID.fullmatch(member_id) is not None


def parse_listen(spec: str, flag: str) -> tuple[str, int]:
    """Where a local service listens (``--prometheus``, ``--listen``): ``PORT`` or ``HOST:PORT`` -> (host, port).

    The host is 127.0.0.1 unless given: nothing is served beyond this machine unless asked for.
    """
    if spec.isascii() and spec.isdigit():
        spec = f"127.0.0.1:{spec}"
    return parse_hostport(spec, flag)


def with_host_if_wildcard(address: str, host: str) -> str:
    """``address`` with ``host`` in place of a wildcard one (0.0.0.0, ::), its port and CURVE key kept.

    A coordinator bound to 0.0.0.0 knows itself by that address, and names
    it so in its welcomes; a newcomer that dialled it at ``host`` reports
    there instead of to itself.
    """
    url, sep, key = address.partition(CURVE_QUERY)
    try:
        bound, port = parse_hostport(url.removeprefix("tcp://"), "address")
    except ConfigError:
        return address
    if not is_wildcard(bound):
        return address
    return tcp_url(host, port) + sep + key
