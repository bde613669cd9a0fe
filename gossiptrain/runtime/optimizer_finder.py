"""Finding the optimizer that steps a peer's model, for loops that never name it.

Quasi-global momentum, the swarm's learning-rate scaling and optimizer state
transfer all need the optimizer, and the README's loop (``Peer(model,
join=...)``) never passes it: such a loop silently got plain averaging of the
parameters and nothing else. torch calls its global step pre-hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) at every
optimizer's ``step()``, before that optimizer's own pre-hooks, so a peer
watches them: the first ``step()`` of an optimizer whose ``param_groups``
hold a parameter of its model (the same tensor; some of them is enough: the
others are the user's business) binds it, inside the hook, before that step
runs. Hooks the binding adds to the optimizer (the rate scaling) therefore
already apply to that very step, and a state downloaded before training is
loaded before the step reads it. An optimizer over other parameters only is
never bound; it is checked once (again only if its groups change). The
post-step hook is not needed: nothing happens after a step that the safe
point does not do.

**Several optimizers over one model** (a GAN's generator and discriminator
in one module, each with its own optimizer) are each bound, in the order
they first step: each gets its own quasi-global momentum and rate scaling,
as each would have if it were alone. Refusing them (a ``ConfigError`` at the
second one's first step) was the other choice; it was not taken because the
loop ran before with plain averaging, and an upgrade must not turn a loop
that trained into one that raises at its first step (the defaults do no
harm). What cannot be shared is the optimizer state: a newcomer's download
carries one optimizer's state, so once a second optimizer steps the peer
offers none (one log line says so); pass ``optimizer=`` explicitly to share
one, or ``optimizer=None`` for plain averaging.

A process holds one torch hook however many peers it runs (tests run
several in threads): installed with the first watching peer, removed with
the last. Each ``close()`` takes its peer off the list the hook reads (a new
tuple, never one being iterated), so a peer's hook does not outlive it and
another thread's optimizer step never sees torch's hook dictionary change
under it except at the first start and the last close.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from gossiptrain.runtime.wrapped import inner_model, inner_optimizer

log = logging.getLogger(__name__)


class FindOptimizer:
    """The type of ``FIND_OPTIMIZER``: ``Peer``'s default, told apart from an explicit ``optimizer=None``."""

    def __repr__(self) -> str:
        return "FIND_OPTIMIZER"


#: ``Peer(optimizer=...)``'s default: find the optimizer that steps the model at its first ``step()``.
FIND_OPTIMIZER = FindOptimizer()

_lock = threading.Lock()  # guards the two below: the finders watching and torch's hook
_watching: tuple["OptimizerFinder", ...] = ()  # replaced whole, so the hook iterates a tuple nobody changes
_handle: RemovableHandle | None = None


def _each_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook: every optimizer's ``step()``, before its own pre-hooks."""
    for finder in _watching:
        finder.saw(optimizer)


def watching() -> int:
    """How many finders are started and not closed in this process (0: torch's hook is removed)."""
    return len(_watching)


class OptimizerFinder:
    """Calls ``on_found(optimizer)`` once per optimizer that steps ``model``'s parameters, at its first step, before it."""

    def __init__(self, model: torch.nn.Module, on_found: Callable[[torch.optim.Optimizer], None]) -> None:
        self.model = inner_model(model)
        self.on_found = on_found
        self.found: list[torch.optim.Optimizer] = []  # bound, in the order they first stepped
        # Checked and not ours, with its number of param groups then (an added group is checked again).
        self._others: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._bind_lock = threading.Lock()  # two threads stepping one new optimizer at once bind it once
        self._started = False

    def start(self) -> "OptimizerFinder":
        """Watch every optimizer step in this process from now on, until ``close()``."""
        global _watching, _handle
        with _lock:
            if self._started:
                return self
            self._started = True
            _watching = (*_watching, self)
            if _handle is None:
                _handle = register_optimizer_step_pre_hook(_each_step)
        return self

    def close(self) -> None:
        """Stop watching; the last finder of the process removes torch's hook. Idempotent."""
        global _watching, _handle
        with _lock:
            if not self._started:
                return
            self._started = False
            _watching = tuple(f for f in _watching if f is not self)
            if not _watching and _handle is not None:
                _handle.remove()
                _handle = None

    def saw(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer's ``step()`` is about to run: bind it if it is a new one of ours."""
        opt = inner_optimizer(optimizer)  # accelerate's AcceleratedOptimizer: the torch optimizer inside
        if not self._started or any(opt is f for f in self.found):
            return
        groups = len(opt.param_groups)
        if self._others.get(opt) == groups:
            return
        if not self._steps_ours(opt):
            self._others[opt] = groups
            return
        with self._bind_lock:
            if any(opt is f for f in self.found):
                return
            self.found.append(opt)
        # Outside the lock: binding may step a throwaway copy of the optimizer (optimizer_template), which
        # comes back here, to be found not ours.
        self.on_found(opt)

    def _steps_ours(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps at least one of the model's parameters (the tensor itself, not an equal one)."""
        mine = {id(p): p for p in self.model.parameters()}  # read now: a parameter may have been replaced
        return any(mine.get(id(p)) is p for group in optimizer.param_groups for p in group["params"])
