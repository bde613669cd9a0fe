"""Incoming connections, bounded per source and in all: a flood of them costs descriptors we can afford.

libzmq accepts every TCP connection to a ROUTER and keeps it until the
other end closes it; it has no cap per source or in all. One host opening
thousands of connections (idle, or completing the ZMTP handshake and then
silent) would use up the process's file descriptors, which checkpoints,
metrics files and our own outgoing connections need too. The transport
therefore watches its listening socket's monitor: for each accepted
connection it reads the peer's IP from the descriptor (``peer_of``) and
asks ``IncomingGuard`` whether to keep it; a connection over the bounds is
shut down at once (``shut_down``: ``shutdown(2)`` on a duplicate of the
descriptor, which ends the connection for libzmq too, and libzmq then
closes its own descriptor). Connections that never complete a handshake
are closed by libzmq after ``limits.handshake_seconds``.

Monitor events arrive a moment after the fact, and a descriptor number may
be reused meanwhile, so the guard keys connections by descriptor (a second
``accepted`` of a number replaces the first) and, before refusing a source
at its bound, re-checks (every ``HEAL_EVERY`` refusals) that the
descriptors it counts are still connections from their sources
(``still_from``): the counts heal themselves if an event was missed.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
from collections import Counter
from typing import Callable

from gossiptrain.net.sources import source_of_ip

log = logging.getLogger(__name__)

#: Descriptors kept free of network connections: checkpoints, metrics files, logs, torch's own.
FD_RESERVE = 256
#: Refusals between two re-checks of the counts (each re-check reads every counted descriptor once).
HEAL_EVERY = 64
#: Incoming connections kept whatever the descriptor limit leaves (each member of a swarm this size may dial us).
MIN_INCOMING = 256


class IncomingGuard:
    """Counts accepted connections per source; says which to keep."""

    def __init__(self, per_source: int, total: int, still_from: Callable[[int, str], bool] = lambda fd, source: True) -> None:
        self.per_source = per_source
        self.total = total
        self.still_from = still_from
        self.refused = 0  # accepted connections it said to shut down (the transport counts them as incoming_refused)
        self._source: dict[int, str] = {}  # descriptor -> source of the connection we counted under it
        self._count: Counter[str] = Counter()
        self._refused_since_heal = HEAL_EVERY  # the first refusal checks the counts first

    def __len__(self) -> int:
        return len(self._source)

    def count(self, source: str) -> int:
        return self._count[source]

    def accepted(self, fd: int, source: str) -> bool:
        """A connection from ``source`` on descriptor ``fd``: True to keep it, False to shut it down."""
        self.disconnected(fd)  # a number seen again: the connection counted under it is gone
        if self._over(source) and self._refused_since_heal >= HEAL_EVERY:
            self._refused_since_heal = 0
            self._heal()
        if self._over(source):
            self.refused += 1
            self._refused_since_heal += 1
            return False
        self._source[fd] = source
        self._count[source] += 1
        return True

    def _over(self, source: str) -> bool:
        return self._count[source] >= self.per_source or len(self._source) >= self.total

    def disconnected(self, fd: int) -> None:
        source = self._source.pop(fd, None)
        if source is not None:
            self._count[source] -= 1
            if self._count[source] <= 0:
                del self._count[source]

    def _heal(self) -> None:
        """Forget counted descriptors that are no longer connections from their source (a missed event)."""
        for fd, src in list(self._source.items()):
            if not self.still_from(fd, src):
                self.disconnected(fd)


def peer_of(fd: int, local_port: int) -> str | None:
    """The source (IP) of the accepted TCP connection on ``fd`` to ``local_port``; None if ``fd`` is not one now."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        with socket.socket(fileno=dup) as s:  # closes the duplicate only
            if s.getsockname()[1] != local_port:
                return None  # reused meanwhile by something else (one of our own outgoing connections)
            return source_of_ip(s.getpeername()[0])
    except OSError:  # not a socket (reused for a file), or not connected any more
        return None


def shut_down(fd: int) -> None:
    """End the connection on ``fd`` for its owner too (libzmq sees the end and closes its descriptor)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        with socket.socket(fileno=dup) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError as e:
        if e.errno not in (errno.ENOTCONN, errno.ENOTSOCK, errno.EBADF):
            log.debug("could not shut down descriptor %d: %s", fd, e)


def descriptor_budget(max_incoming: int, max_connections: int) -> int:
    """Incoming connections this process can hold beside ``FD_RESERVE`` and its outgoing ones.

    Raises the soft RLIMIT_NOFILE to the hard limit first (once is enough;
    again is harmless): the common default of 1,024 is what a flood would
    exhaust first. Each outgoing connection may hold about 3 descriptors
    (a DEALER's mailbox, its TCP socket, a monitor while it dials).
    """
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    except (OSError, ValueError):  # not allowed (a container's limit), or no such limit here
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    room = soft - FD_RESERVE - 3 * max_connections
    if room >= max_incoming:
        return max_incoming
    # A small limit (a hard RLIMIT_NOFILE of 1,024, say) would leave almost nothing: keep MIN_INCOMING anyway
    # (a member of a swarm of that many is dialled by each) and say what to raise.
    budget = max(min(max_incoming, MIN_INCOMING), room)
    log.warning("the file descriptor limit (%d) leaves room for %d incoming connections beside %d outgoing ones "
                "(limits.max_incoming %d); raise it (ulimit -n) for a larger swarm", soft, budget, max_connections,
                max_incoming)
    return budget
