"""The exception hierarchy: every error gossiptrain raises on purpose is a GossipError.

Callers catch ``GossipError`` to handle anything the runtime reports; the
children say which layer refused what. A decode failure is always a
``ProtocolError`` so that a receiver can drop a bad message with one except.
"""

from __future__ import annotations


class GossipError(Exception):
    """Base of every error raised deliberately by gossiptrain."""


class ConfigError(GossipError, ValueError):
    """A configuration value is invalid; the message names the field."""


class ProtocolError(GossipError):
    """Bytes from the network do not form a valid message, or break a limit."""


class JoinError(GossipError):
    """Joining a swarm failed: nobody answered, or the swarm refused us."""


class MismatchError(JoinError):
    """The swarm refused us because our run or model differs from its own."""


class TransportClosed(GossipError):
    """The transport was closed while an operation was waiting on it."""


class WorkloadError(GossipError):
    """A workload could not be found, imported or built."""


class CheckpointError(GossipError):
    """A checkpoint could not be written, or none that is complete and intact could be read or loaded."""
