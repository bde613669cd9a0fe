"""What a peer checks about the user's model and machine before it trains, so a mistake costs one line, not a run.

- A model no swarm can average is refused before anything is contacted:
  one with only buffers became the swarm's model and then crashed inside
  ``step()`` (``Tensor list must have at least one tensor``); one on the
  ``meta`` device crashed at its first exchange.
- Several peers on one machine at torch's default thread count (one
  intra-op thread per core) oversubscribe it and spin against each other:
  the README's two-peer example ran 4-5x slower than at one thread each.
  That is worth one warning per process, with the number to set.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from typing import Iterable

import torch

from gossiptrain.errors import ConfigError
from gossiptrain.net.addressing import CLIENT_PATH, parse_hostport, plain_address

log = logging.getLogger(__name__)


def refuse_unusable_model(model: torch.nn.Module, *, pieces: bool = False) -> None:
    """``ConfigError`` (a ValueError) for a model no swarm can average: no parameters, DTensor parameters (unless
    ``pieces``: a split peer's, whose ranks each average their shard), or tensors on the meta device."""
    params = dict(model.named_parameters())
    if not params:
        buffers = [name for name, _ in model.named_buffers()]
        held = f" (only buffers: {', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''})" if buffers else ""
        raise ConfigError(
            f"the model has no parameters{held}: a peer averages parameters, so give Peer a model with at least one "
            "torch.nn.Parameter"
        )
    for name, p in params.items():
        if not pieces and hasattr(p, "to_local") and hasattr(p, "placements"):  # a DTensor: FSDP2, tensor parallelism
            raise ConfigError(
                f"the model's parameter {name!r} is a DTensor (sharded or placed across ranks, as FSDP2 does): a peer "
                "of one worker gossips whole local tensors; pass the process group of the ranks it is sharded over "
                "(Peer(..., group=...)), and each rank averages its own shard"
            )
    for kind, named in (("parameter", params.items()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.is_meta:
                raise ConfigError(
                    f"the model's {kind} {name!r} is on the meta device (it has no data): materialize the model before "
                    "Peer(...), e.g. model.to_empty(device='cpu'), then initialize or load its weights"
                )


def host_of(address: str) -> str | None:
    """The host of a member's address (``tcp://host:port``, a CURVE key or ``/client`` after it), None if none."""
    try:
        return parse_hostport(plain_address(address).removesuffix(CLIENT_PATH))[0]
    except ConfigError:
        return None


def same_machine(host: str | None, mine: str | None) -> bool:
    """Whether ``host`` is ours: the same address, or both loopback (127.0.0.x and ::1 are one machine)."""
    if host is None or mine is None:
        return False
    if host == mine:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback and ipaddress.ip_address(mine).is_loopback
    except ValueError:
        return False


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ThreadCheck:
    """One warning per process when the peers on this machine run more torch threads than it has cores.

    ``due`` is cheap and says whether anything changed since the last look
    (the view's size, torch's thread count); ``judge`` counts the members on
    this machine and warns. The CLI peer runs one thread and never warns.
    """

    warned = False  # per process: said once, never again

    def __init__(self) -> None:
        self._last: tuple[int, int] = (0, 0)  # (members in view, torch threads) at the last look

    def due(self, members: int) -> bool:
        """Whether to count the members on this machine now: something changed, and it could be too many threads."""
        key = (members, torch.get_num_threads())
        if ThreadCheck.warned or key == self._last:
            return False
        self._last = key
        return members > 1 and key[1] > 1

    def judge(self, addresses: Iterable[str], mine: str) -> None:
        """Warn if the members at ``addresses`` on our machine, at this thread count each, exceed its cores."""
        me = host_of(mine)
        here = sum(same_machine(host_of(a), me) for a in addresses)
        threads, cores = torch.get_num_threads(), usable_cores()
        if here > 1 and here * threads > cores:
            ThreadCheck.warned = True
            log.warning(
                "%d peers on this machine each run %d torch threads on its %d cores: they oversubscribe it and train "
                "several times slower; call torch.set_num_threads(%d) in each before training (the CLI peer runs 1)",
                here, threads, cores, max(1, cores // here),
            )
