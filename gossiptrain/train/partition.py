"""Splitting a training split among peers: iid, or skewed by label (non-IID).

Gossip topologies only differ in how fast they mix information that peers
do not share. With iid shards every peer already sees the whole
distribution and a ring looks as good as a complete graph; label-skewed
shards make the topology matter, as in real decentralized settings.

Everything here is a pure function of the label tensor and a seed (seeded
generators, never the global RNG), so every peer of a run computes the same
partition on its own, and the shards of one seed are disjoint and together
cover the whole training split, whatever the scheme.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gossiptrain.errors import ConfigError, WorkloadError

__all__ = ["SCHEMES", "check_scheme", "class_histogram", "describe", "partition_indices"]

#: Partition schemes, by the name ``train.partition`` takes.
SCHEMES = ("iid", "dirichlet", "dirichlet-even", "classes-per-peer")

# Mixed into the numpy seed so that a scheme's draws never coincide with
# another scheme's (or a future one's) for the same run seed.
_STREAM = {"dirichlet": 1, "classes-per-peer": 2, "dirichlet-even": 1}  # dirichlet-even: the same draw, evened


def check_scheme(scheme: str, alpha: float, classes_per_peer: int) -> None:
    """Raise ConfigError naming the first bad partition setting."""
    if scheme not in SCHEMES:
        raise ConfigError(f"partition {scheme!r} is unknown; known schemes: {', '.join(SCHEMES)}")
    if not (alpha > 0 and np.isfinite(alpha)):
        raise ConfigError(f"partition alpha must be a positive number, got {alpha}")
    if classes_per_peer < 1:
        raise ConfigError(f"partition classes_per_peer must be >= 1, got {classes_per_peer}")


def describe(scheme: str, alpha: float, classes_per_peer: int) -> str:
    """A short label for logs: 'iid', 'dirichlet alpha=0.1', 'classes-per-peer k=2'."""
    if scheme in ("dirichlet", "dirichlet-even"):
        return f"{scheme} alpha={alpha:g}"
    if scheme == "classes-per-peer":
        return f"classes-per-peer k={classes_per_peer}"
    return scheme


def partition_indices(
    labels: Tensor,
    index: int,
    count: int,
    seed: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    classes_per_peer: int = 2,
) -> Tensor:
    """Indices (n,) int64 into ``labels`` (N,) of shard ``index`` of ``count``.

    - ``iid``: one permutation from ``seed`` cut into ``count`` contiguous
      parts whose sizes differ by at most one. The indices come in that
      permutation's order (not sorted): bit-identical to the shards of
      earlier releases, so iid runs train exactly as before.
    - ``dirichlet``: each class's samples are split among the shards in
      proportions drawn from Dir(alpha) (Hsu et al. 2019). Small alpha gives
      each shard few dominant classes; large alpha approaches iid.
    - ``dirichlet-even``: the same draw, then the shards' samples, shard
      after shard, cut into ``count`` parts whose sizes differ by at most
      one (as the RelaySGD paper's code splits CIFAR-10, Vogels et al. 2021):
      the skew of ``dirichlet`` without the tiny shards a small alpha draws.
    - ``classes-per-peer``: shard i holds ``classes_per_peer`` classes,
      assigned round-robin over a seeded shuffle of the classes; a class's
      samples are split evenly among the shards that hold it. Needs
      ``count * classes_per_peer >= classes`` so that every sample has a shard.

    Non-iid shards are sorted. No shard is empty: a shard left empty by the
    draw takes one sample from the largest shard (see ``_fill_empty``).
    """
    check_scheme(scheme, alpha, classes_per_peer)
    if labels.ndim != 1:
        raise WorkloadError(f"partition: labels must be one-dimensional, got shape {tuple(labels.shape)}")
    total = labels.shape[0]
    if count < 1 or not 0 <= index < count:
        raise WorkloadError(f"shard index {index} of {count}: need 0 <= index < count")
    if count > total:
        raise WorkloadError(f"cannot cut {total} training samples into {count} non-empty shards")
    if scheme == "iid":
        return _iid(total, index, count, seed)
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise WorkloadError(f"partition {scheme!r} needs integer class labels, got {labels.dtype}")
    y = labels.cpu().numpy().astype(np.int64)  # (N,)
    if y.min() < 0:
        raise WorkloadError(f"partition {scheme!r}: class labels must be >= 0, got {int(y.min())}")
    rng = np.random.default_rng([_STREAM[scheme], seed % 2**64])
    if scheme == "dirichlet-even":
        drawn = [part for shard in _dirichlet(y, count, alpha, rng) for part in shard]  # shard after shard
        return torch.from_numpy(np.sort(np.array_split(np.concatenate(drawn), count)[index])).to(torch.int64)  # (n,)
    if scheme == "dirichlet":
        shards = _dirichlet(y, count, alpha, rng)
    else:
        shards = _classes_per_peer(y, count, classes_per_peer, rng)
    _fill_empty(shards)
    return torch.from_numpy(np.sort(np.concatenate(shards[index]))).to(torch.int64)  # (n,)


def class_histogram(labels: Tensor, indices: Tensor | None, num_classes: int) -> list[int]:
    """Samples per class (num_classes,) among ``labels[indices]`` (all labels if None)."""
    chosen = labels if indices is None else labels[indices]  # (n,)
    if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= num_classes):
        raise WorkloadError(
            f"class_histogram: labels must lie in [0, {num_classes}), "
            f"got [{int(chosen.min())}, {int(chosen.max())}]"
        )
    return torch.bincount(chosen.to(torch.int64), minlength=num_classes).tolist()


def _iid(total: int, index: int, count: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(total, generator=generator)  # (total,)
    return torch.tensor_split(order, count)[index].clone()  # (n,)


# A partition under construction: per shard, a list of index arrays (one per
# class it received), concatenated only for the shard asked for.
_Shards = list[list[np.ndarray]]


def _by_class(y: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Per present class, in label order: its sample indices, shuffled."""
    return [rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)]


def _dirichlet(y: np.ndarray, count: int, alpha: float, rng: np.random.Generator) -> _Shards:
    shards: _Shards = [[] for _ in range(count)]
    for members in _by_class(y, rng):
        proportions = rng.dirichlet(np.full(count, alpha))  # (count,)
        # Cut points from the cumulative proportions: the parts always add up
        # to the class, whatever the rounding.
        cuts = np.floor(np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)  # (count-1,)
        for shard, part in zip(shards, np.split(members, cuts)):
            shard.append(part)
    return shards


def _classes_per_peer(y: np.ndarray, count: int, k: int, rng: np.random.Generator) -> _Shards:
    classes = _by_class(y, rng)
    n_classes = len(classes)
    if k > n_classes:
        raise WorkloadError(
            f"partition classes-per-peer: {k} classes per peer, but the training split has only {n_classes}"
        )
    if count * k < n_classes:
        raise WorkloadError(
            f"partition classes-per-peer: {count} shards x {k} classes cover only {count * k} of "
            f"{n_classes} classes; use more shards or a larger train.partition_classes"
        )
    order = rng.permutation(n_classes)  # (C,)
    # Shard i takes k consecutive slots of the shuffled class ring: distinct
    # classes (k <= C), and every class is taken since count * k >= C.
    holders: list[list[int]] = [[] for _ in range(n_classes)]
    for shard in range(count):
        for slot in range(shard * k, shard * k + k):
            holders[order[slot % n_classes]].append(shard)
    shards: _Shards = [[] for _ in range(count)]
    for members, owners in zip(classes, holders):
        for owner, part in zip(owners, np.array_split(members, len(owners))):
            shards[owner].append(part)
    return shards


def _fill_empty(shards: _Shards) -> None:
    """Give each empty shard one sample taken from the largest shard.

    A tiny alpha, or a class with fewer samples than shards holding it, can
    leave a shard with nothing to train on. Moving one sample is the least
    disturbance to the drawn partition, and it keeps the shards disjoint and
    covering. Deterministic: the largest shard (lowest index on ties) gives
    up the last sample of its last non-empty part. Since count <= samples,
    the largest shard has at least two samples whenever one is empty.
    A shard filled this way holds one class, so classes-per-peer's bound holds.
    """
    for empty in range(len(shards)):
        if sum(len(part) for part in shards[empty]):
            continue
        sizes = [sum(len(part) for part in shard) for shard in shards]
        donor = shards[int(np.argmax(sizes))]
        last = max(i for i, part in enumerate(donor) if len(part))
        shards[empty] = [donor[last][-1:]]
        donor[last] = donor[last][:-1]
