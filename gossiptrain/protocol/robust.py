"""Robust aggregation: limiting what a valid but poisoned model can do to ours.

Validation (dtype, shape, finiteness, run) stops broken updates; it cannot
stop a member that sends well-formed parameters scaled by 100. Two standard
defences, both local to the receiver:

- ``NormClip`` judges each remote model before it is merged. A model whose
  norm is over ``OUTLIER`` times the norms we see (our own, and the median
  of recent accepted models) is refused and counts toward quarantine: even
  clipped, its direction would be applied at every exchange and add up.
  Then the difference it would apply, ``remote - own``, is scaled down to
  at most ``clip`` times the median norm of recent accepted differences
  (never below ``FLOOR`` times the models' norms, so that peers starting
  from identical weights do not clip each other to nothing). Only norms
  that passed enter the histories, so a poisoner cannot ratchet them up.
  A far-behind honest peer (a newcomer) has an ordinary norm: its large
  difference is clipped, not refused. Our own norm is no reference when
  it is near zero (a model initialised to zeros, as logreg's is) and no
  model was accepted yet: every honest model would be "10 times ours" and
  refused, and, none accepted, the history would never fill. Then, once
  ``SWARM_SENDERS`` partners have offered models, the swarm's norms judge:
  the median over senders of the norm each last offered (one value per
  sender, so one poisoner among honest partners cannot move it). With
  fewer partners heard, a near-zero model of ours still refuses theirs:
  one offer alone cannot tell "ours is tiny" from "theirs is scaled".
- ``trimmed_mean``: when several neighbours are merged at once, each
  coordinate drops its largest and smallest values before averaging.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from typing import Sequence

import torch

#: Accepted norms remembered; their medians set the limits.
HISTORY = 32
#: Accepted differences before their median sets the clip limit (until then only FLOOR does).
WARMUP = 4
#: The clip limit is never below this fraction of the larger model norm.
FLOOR = 0.1
#: A model this many times larger than the norms we see is refused.
OUTLIER = 10.0
#: Senders whose offers must be known before their median norm may overrule our own (nothing accepted yet):
#: with three, one poisoner is outvoted; with fewer, our own norm judges, near zero or not.
SWARM_SENDERS = 3


class NormClip:
    """Refuses models of outlying norm; clips the differences of the others."""

    def __init__(self, clip: float) -> None:
        self.clip = clip
        self.diffs: deque[float] = deque(maxlen=HISTORY)
        self.models: deque[float] = deque(maxlen=HISTORY)
        self.clipped = 0
        self.refused = 0
        self.offered: OrderedDict[str, float] = OrderedDict()  # sender -> the norm it last offered (HISTORY senders)

    def factor(self, diff_norm: float, remote_norm: float, own_norm: float, sender: str = "") -> float | None:
        """Scale in (0, 1] for moving by a difference of ``diff_norm``, or None to refuse the model."""
        self.offered[sender] = remote_norm
        self.offered.move_to_end(sender)
        while len(self.offered) > HISTORY:
            self.offered.popitem(last=False)
        reference = max(own_norm, statistics.median(self.models)) if self.models else own_norm
        if not self.models and remote_norm > OUTLIER * own_norm and len(self.offered) >= SWARM_SENDERS:
            reference = max(own_norm, statistics.median(self.offered.values()))  # ours near zero: the swarm's judge
        if reference > 0 and remote_norm > OUTLIER * reference:
            self.refused += 1
            return None
        self.models.append(remote_norm)
        limit = FLOOR * max(own_norm, remote_norm)
        if len(self.diffs) >= WARMUP:
            limit = max(limit, self.clip * statistics.median(self.diffs))
        if diff_norm <= limit:
            self.diffs.append(diff_norm)
            return 1.0
        self.clipped += 1
        return limit / diff_norm


def norms(remote: Sequence[torch.Tensor], own: Sequence[torch.Tensor]) -> tuple[float, float, float]:
    """(||remote - own||, ||remote||, ||own||) over all tensors together (float64 accumulation)."""
    diff = theirs = mine = 0.0
    with torch.no_grad():
        for r, o in zip(remote, own):
            r64, o64 = r.detach().double(), o.detach().double()
            diff += float((r64 - o64).pow(2).sum())
            theirs += float(r64.pow(2).sum())
            mine += float(o64.pow(2).sum())
    return diff**0.5, theirs**0.5, mine**0.5


def trimmed_mean(models: Sequence[Sequence[torch.Tensor]], trim: float) -> list[torch.Tensor]:
    """Coordinate-wise mean of ``models`` without the ``ceil(trim * m)`` extremes at each end (at least one if m >= 3)."""
    m = len(models)
    cut = int(-(-trim * m // 1)) if trim > 0 else 0
    if m >= 3:
        cut = max(cut, 1)
    cut = min(cut, (m - 1) // 2)  # keep at least one value
    out = []
    for tensors in zip(*models):
        stacked = torch.stack(list(tensors))  # (m, *shape)
        if cut:
            stacked = stacked.sort(dim=0).values[cut : m - cut]  # (m - 2 cut, *shape)
        out.append(stacked.mean(dim=0))
    return out
