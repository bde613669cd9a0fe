"""The swarm is one large-batch run: adaptive optimizers step with Adam's square-root scaling rule.

A swarm of n peers that average well moves its mean model by the mean of
n local updates per step: that is one step of a batch n times larger, as
DDP with n workers is. A user who trained with one process picked a
learning rate for their batch; at n times that batch, the same rate makes
the swarm no faster per sample than one peer. Measured (the simulator,
charlm, Adam at lr 0.003, 3 peers of 300 steps on contiguous thirds of the
text, 2 exchanges per step): validation loss 2.142 where one process of 300
steps on all the text reaches 2.144 and one of 900 steps 2.028: three
times the samples bought nothing.

DDP users scale the learning rate with the batch: linearly for SGD (Goyal
et al. 2017), by the square root for Adam and its kin (Malladi et al.,
NeurIPS 2022, "On the SDEs and scaling rules for adaptive gradient
algorithms"). ``gossip.lr_scaling = "auto"`` (the default) applies the
square-root rule to adaptive optimizers (Adam, AdamW, Adamax, NAdam, RAdam,
Adagrad, RMSprop): each optimizer step runs at ``sqrt(members)`` times the
user's learning rate, ``members`` being the live members in this peer's
view (itself included), at most ``MAX_SCALED_MEMBERS``. SGD is left as it
is: with momentum 0.9 even the square root was too much (simulated, 4
peers, digits-small, 3 classes per shard, lr 0.05, 2 cores, seeds 0-4,
time to a mean accuracy of 0.93 held 3 samples: on 1 Gbit/s links 0.76 s
unscaled against 1.26-2.01 s or never scaled, on 100 Mbit/s never in 8 s
against 0.76-1.01 s). ``"sqrt"`` asks for the rule with any optimizer,
``"none"`` turns it off.

The rate is scaled only while ``optimizer.step()`` runs (a pre- and a
post-step hook), so a learning-rate scheduler, a checkpoint of the
optimizer and the user's own reads all see the rate they set.

Measured, same simulator bed (``cores=2``, 1 ms links at 100 Mbit/s,
seed 0; ratio to one process trained on all the samples, target at most
1.05): 3 peers 2.136 against 2.028 (1.053), scaled 2.088 (1.030); seed 1
2.119 against 1.976 (1.072), scaled 2.042 (1.033); 4 peers scaled 2.062
against 2.006 (1.028); over 10 Mbit/s links (0.24 exchanges per step)
2.181 -> 2.100.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

#: Optimizers whose step size does not grow with the gradient's scale: the square-root rule is theirs.
ADAPTIVE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)
#: ``gossip.lr_scaling`` values.
MODES: tuple[str, ...] = ("auto", "none", "sqrt")
#: Members counted at most: batch-size scaling rules hold up to a point (the critical batch size), and a
#: rate 8 times the user's (64 members) is past what anyone measured here.
MAX_SCALED_MEMBERS = 16


def factor(members: int) -> float:
    """The learning-rate multiplier for a view of ``members`` (ourselves included)."""
    return math.sqrt(max(1, min(members, MAX_SCALED_MEMBERS)))


def wants_scaling(mode: str, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``mode`` scales this optimizer's steps."""
    if optimizer is None or mode == "none":
        return False
    return mode == "sqrt" or isinstance(optimizer, ADAPTIVE)


class SwarmLrScaling:
    """Scales every param group's ``lr`` by ``factor(members())`` for the duration of each ``optimizer.step()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, members: Callable[[], int]) -> None:
        self.optimizer = optimizer
        self.members = members
        self.last_factor = 1.0
        self.suspended = False  # by the stability guard (gossiptrain.protocol.stability): the user's rate
        self._saved: list[Any] = []
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._saved:  # the last step raised before its post hook ran: its rates are still scaled
            self._post(optimizer, args, kwargs)
        f = self.last_factor = 1.0 if self.suspended else factor(self.members())
        self._saved = [group["lr"] for group in optimizer.param_groups]
        if f != 1.0:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * f  # a tensor lr stays a tensor

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, lr in zip(optimizer.param_groups, self._saved):
            group["lr"] = lr
        self._saved = []

    def suspend(self) -> None:
        """The stability guard backs off: steps at the user's rate until ``resume``."""
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False

    def close(self) -> None:
        """Remove the hooks: the optimizer steps at the user's rate again (a peer that left the swarm)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
