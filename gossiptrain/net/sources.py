"""What one source is, for limits per source: the join and report buckets and the transport's incoming bound.

Pure (no sockets), so the protocol cores and the transport share the one rule.
"""

from __future__ import annotations

import ipaddress


def source_of_ip(ip: str) -> str:
    """An IPv4 address as it is, an IPv6 address as its /64 (one host holds many of its addresses); else ``ip``."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
