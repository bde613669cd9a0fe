"""State transfer: a newcomer downloads a live member's model before it trains.

A peer that joins or rejoins with its initial weights is far from where the
swarm has got to: it needs many exchanges to catch up, and each of them
pulls its partner back toward the start. Downloading the current state of a
live member first makes it useful from its first step.

Two sans-IO state machines, driven like the averaging and membership cores
(``handle(event, now) -> actions``; no sockets, no clock), one module each:

- ``fetcher.Fetcher``, the newcomer: picks donors among the live members of
  its view and asks them for the chunks of their flattened state, a few
  requests in flight, leaving a donor that stops answering, refuses or
  leaves for another. What it downloads, and the checks every chunk and
  the assembled state pass, is ``assembly.Assembly``'s, so that the choice
  of donors and the pace of requests stay apart from what makes a state
  acceptable.
- ``donor.Donor``, every member: answers sessions from one snapshot of its
  state taken at the trainer's next safe point.

``messages`` holds what the two ends send each other (the wire bodies,
checked as they are turned into events) and so belongs to neither. This
package's own module holds ``TransferResult``, how a download ended: the
drivers, ``Peer.transfer`` and the simulator's peers hand it on, so that it
is importable without either state machine.

The stream's format (bytes, tensor tables, manifests, snapshots) is
``gossiptrain.state.snapshot``; optimizer state, ``gossiptrain.state.optimizer_state``.

This package is sans-IO: events are built from plain values (``from_body``),
never from wire messages, so that it can be tested step by step and runs
the same in a real process and in the simulator. The driver that feeds it
(``StateEndpoint``, ``catch_up``, ``SnapshotHook``) is
``gossiptrain.runtime.state_endpoint``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gossiptrain.state.snapshot import Entry

__all__ = ["TransferResult"]


@dataclass(frozen=True)
class TransferResult:
    """How a download ended: ``data`` is the verified state when ``ok``."""

    ok: bool
    reason: str  # why it failed, or "" when ok
    data: torch.Tensor | None = None
    donors: tuple[str, ...] = ()  # who supplied the chunks kept, in chunk order
    digest: str = ""  # hash list digest of the assembled chunks (the donor's digest when one donor served all)
    step: int = 0  # the last donor's step
    seconds: float = 0.0
    tensors: tuple[Entry, ...] | None = None  # what ``data`` holds (the model's state, then any optimizer state)
    samples: int = 0  # the last donor's training samples seen
    scalars: tuple[tuple[str, int | float], ...] = ()  # the last donor's non-tensor optimizer state
    optimizer: bool = False  # ``data`` holds the optimizer state after the model's
    optimizer_problem: str = ""  # why the optimizer state asked for was not downloaded
    optimizer_state: dict[str, Any] | None = None  # decoded for ``Optimizer.load_state_dict`` (catch_up fills it in)
    # The optimizer state as named tensors, downloaded while no optimizer was known (``Fetcher(any_optimizer=True)``;
    # catch_up fills it in, its scalars are ``scalars``): for the optimizer found at its first step.
    optimizer_aside: tuple[tuple[str, torch.Tensor], ...] = ()
    nothing_to_fetch: bool = False  # every donor asked said it is not training yet (a fresh swarm): nothing was needed
