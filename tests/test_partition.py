"""Tests for non-IID data partitions: the invariants every scheme keeps, and the skew each one makes.

Topology experiments on skewed data mean nothing if a sample lands on two
peers or on none, if peers of one run compute different partitions, or if
iid runs silently changed; these tests pin all of that down.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gossiptrain.config import RunConfig, TrainConfig
from gossiptrain.errors import ConfigError, WorkloadError
from gossiptrain.train.local_trainer import LocalTrainer
from gossiptrain.train.partition import SCHEMES, class_histogram, partition_indices
from gossiptrain.train.workload import shard_indices
from peers.digits import DigitsWorkload
from peers.logreg import LogRegWorkload

DIGITS = DigitsWorkload(hidden=16)
DIGITS_LABELS = DIGITS.train_shard(0, 1, 0)[1]  # (1437,) the training split's labels, in iid order


def _old_shard_indices(total: int, index: int, count: int, seed: int) -> Tensor:
    # The iid algorithm as released before partitions existed, copied verbatim:
    # iid shards must stay bit-identical so that existing runs train the same.
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(total, generator=generator)
    return torch.tensor_split(order, count)[index].clone()


def _all_shards(labels: Tensor, count: int, seed: int, scheme: str, alpha: float, k: int) -> list[Tensor]:
    return [partition_indices(labels, i, count, seed, scheme, alpha, k) for i in range(count)]


def _majority_fraction(labels: Tensor, shards: list[Tensor]) -> float:
    """Mean over shards of the share of the shard's most common class: 1/classes when iid, 1 when pure."""
    return float(np.mean([torch.bincount(labels[s]).max().item() / len(s) for s in shards]))


@st.composite
def _labels(draw: st.DrawFn, min_size: int) -> Tensor:
    # Few classes and tiny classes are the hard cases: empty draws, classes
    # with fewer samples than the shards that hold them.
    classes = draw(st.integers(1, 12))
    values = draw(st.lists(st.integers(0, classes - 1), min_size=min_size, max_size=min_size + 150))
    return torch.tensor(values, dtype=torch.int64)


# --- invariants of every scheme ---------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    count=st.integers(1, 20),
    seed=st.integers(0, 2**32),
    scheme=st.sampled_from(SCHEMES),
    alpha=st.floats(0.05, 10),
    k=st.integers(1, 6),
)
def test_shards_are_disjoint_covering_nonempty_and_deterministic(
    data: st.DataObject, count: int, seed: int, scheme: str, alpha: float, k: int
) -> None:
    labels = data.draw(_labels(min_size=count))
    present = labels.unique().numel()
    if scheme == "classes-per-peer" and (k > present or count * k < present):
        # Without enough slots some class would belong to no shard: refused, never dropped.
        with pytest.raises(WorkloadError, match="classes-per-peer"):
            partition_indices(labels, 0, count, seed, scheme, alpha, k)
        return
    shards = _all_shards(labels, count, seed, scheme, alpha, k)
    assert all(s.dtype == torch.int64 and s.ndim == 1 and s.numel() >= 1 for s in shards)
    merged = torch.cat(shards)
    assert torch.equal(merged.sort().values, torch.arange(len(labels)))  # disjoint and covering
    if scheme != "iid":
        assert all(torch.equal(s, s.sort().values) for s in shards)
    if scheme == "classes-per-peer":
        assert all(labels[s].unique().numel() <= k for s in shards)
    if scheme == "dirichlet-even":
        assert max(s.numel() for s in shards) - min(s.numel() for s in shards) <= 1
    again = _all_shards(labels, count, seed, scheme, alpha, k)
    assert all(torch.equal(a, b) for a, b in zip(shards, again))


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 3000), data=st.data(), seed=st.integers(0, 2**32))
def test_iid_is_bit_identical_to_the_old_shards(total: int, data: st.DataObject, seed: int) -> None:
    count = data.draw(st.integers(1, min(total, 20)))
    index = data.draw(st.integers(0, count - 1))
    old = _old_shard_indices(total, index, count, seed)
    labels = torch.randint(0, 7, (total,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(partition_indices(labels, index, count, seed, "iid", 0.5, 2), old)
    assert torch.equal(shard_indices(total, index, count, seed), old)  # the old call still works
    assert torch.equal(shard_indices(labels, index, count, seed), old)


def test_builtin_workloads_keep_their_iid_shards() -> None:
    x, y = DIGITS.train_shard(2, 5, seed=3)
    full_x, full_y = DIGITS._data.train_x, DIGITS._data.train_y
    old = _old_shard_indices(len(full_y), 2, 5, 3)
    assert torch.equal(x, full_x[old]) and torch.equal(y, full_y[old])


def test_seed_changes_non_iid_partitions() -> None:
    for scheme in ("dirichlet", "classes-per-peer"):
        a = partition_indices(DIGITS_LABELS, 0, 8, 1, scheme, 0.5, 2)
        b = partition_indices(DIGITS_LABELS, 0, 8, 2, scheme, 0.5, 2)
        assert not torch.equal(a, b), scheme


# --- the skew each scheme makes ---------------------------------------------


def test_small_alpha_is_far_more_skewed_than_large_alpha() -> None:
    def skew(scheme: str, alpha: float) -> float:
        per_seed = [_majority_fraction(DIGITS_LABELS, _all_shards(DIGITS_LABELS, 8, s, scheme, alpha, 2)) for s in range(5)]
        return float(np.mean(per_seed))

    tiny, middle, huge, iid = skew("dirichlet", 0.05), skew("dirichlet", 1.0), skew("dirichlet", 100.0), skew("iid", 0.5)
    # Evened, the draw keeps its skew: a shard is mostly the samples one shard of the draw held.
    assert skew("dirichlet-even", 0.05) > 0.5 and skew("dirichlet-even", 100.0) < 0.2
    # Ten balanced classes over 8 shards: an iid shard's majority class holds
    # about 0.13 of it; Dir(0.05) gives most classes to one shard (about 0.7).
    assert tiny > 0.5 and huge < 0.2 and iid < 0.2, (tiny, huge, iid)
    assert tiny > middle > huge
    assert tiny - huge > 0.4


@settings(max_examples=25, deadline=None)
@given(count=st.integers(5, 20), seed=st.integers(0, 2**32))
def test_two_classes_per_peer_on_digits(count: int, seed: int) -> None:
    shards = _all_shards(DIGITS_LABELS, count, seed, "classes-per-peer", 0.5, 2)
    held = [set(DIGITS_LABELS[s].tolist()) for s in shards]
    assert all(len(h) == 2 for h in held)  # every class has plenty of samples: exactly k
    assert set().union(*held) == set(range(10))  # count * k >= 10: every class used
    for c in range(10):
        # A class's samples are split evenly among the shards holding it.
        parts = [int((DIGITS_LABELS[s] == c).sum()) for s in shards if c in set(DIGITS_LABELS[s].tolist())]
        assert max(parts) - min(parts) <= 1 and sum(parts) == int((DIGITS_LABELS == c).sum())


def test_an_empty_shard_takes_one_sample_from_the_largest() -> None:
    # Class 0 has one sample but two holders (4 shards x 1 class over 2
    # classes): one holder would be empty without the fix.
    labels = torch.tensor([0] + [1] * 30)
    shards = _all_shards(labels, 4, 0, "classes-per-peer", 0.5, 1)
    sizes = sorted(len(s) for s in shards)
    assert sizes[0] == 1 and sum(sizes) == 31
    assert all(labels[s].unique().numel() == 1 for s in shards)
    # Dir(0.05) over 20 shards of 25 samples leaves many shards empty before the fix.
    small = torch.arange(25) % 3
    assert all(len(s) >= 1 for s in _all_shards(small, 20, 0, "dirichlet", 0.05, 2))


# --- class_histogram and errors ---------------------------------------------


def test_class_histogram_counts_the_chosen_samples() -> None:
    labels = torch.tensor([2, 0, 2, 1, 2, 0])
    assert class_histogram(labels, torch.tensor([0, 2, 3]), 4) == [0, 1, 2, 0]
    assert class_histogram(labels, None, 3) == [2, 1, 3]
    shard = partition_indices(DIGITS_LABELS, 3, 8, 0, "dirichlet", 0.1, 2)
    hist = class_histogram(DIGITS_LABELS, shard, 10)
    assert sum(hist) == len(shard) and hist == np.bincount(DIGITS_LABELS[shard].numpy(), minlength=10).tolist()
    with pytest.raises(WorkloadError, match=r"\[0, 2\)"):
        class_histogram(labels, None, 2)


@pytest.mark.parametrize(
    "args,error,match",
    [
        ((DIGITS_LABELS, 0, 4, 0, "zipf", 0.5, 2), ConfigError, "partition 'zipf' is unknown"),
        ((DIGITS_LABELS, 0, 4, 0, "dirichlet", 0.0, 2), ConfigError, "alpha"),
        ((DIGITS_LABELS, 0, 4, 0, "classes-per-peer", 0.5, 0), ConfigError, "classes_per_peer"),
        ((DIGITS_LABELS, 0, 4, 0, "classes-per-peer", 0.5, 11), WorkloadError, "only 10"),
        ((DIGITS_LABELS, 0, 4, 0, "classes-per-peer", 0.5, 2), WorkloadError, "cover only 8 of 10"),
        ((torch.zeros(3, dtype=torch.long), 0, 4, 0, "dirichlet", 0.5, 2), WorkloadError, "3 training samples into 4"),
        ((DIGITS_LABELS, 4, 4, 0, "iid", 0.5, 2), WorkloadError, "shard index 4 of 4"),
        ((DIGITS_LABELS.float(), 0, 4, 0, "dirichlet", 0.5, 2), WorkloadError, "integer class labels"),
        ((DIGITS_LABELS - 1, 0, 4, 0, "dirichlet", 0.5, 2), WorkloadError, ">= 0"),
    ],
)
def test_bad_requests_raise_naming_the_problem(args: tuple, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        partition_indices(*args)


def test_a_sample_count_alone_is_only_enough_for_iid() -> None:
    with pytest.raises(WorkloadError, match="needs the labels"):
        shard_indices(100, 0, 4, 0, partition="dirichlet")


# --- configuration ----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"partition": "non-iid"}, "train.partition"),
        ({"partition_alpha": 0.0}, "train.partition_alpha"),
        ({"partition_alpha": -1.0}, "train.partition_alpha"),
        ({"partition_alpha": float("inf")}, "train.partition_alpha"),
        ({"partition_alpha": float("nan")}, "train.partition_alpha"),
        ({"partition_classes": 0}, "train.partition_classes"),
    ],
)
def test_config_rejects_bad_partitions_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        TrainConfig(**kwargs)


def test_config_knows_every_scheme_and_takes_them_from_strings() -> None:
    # config spells the scheme names out (it must not import torch): keep the two lists in step.
    assert [TrainConfig(partition=s).partition for s in SCHEMES] == list(SCHEMES)
    with pytest.raises(ConfigError, match="known schemes: iid, dirichlet, dirichlet-even, classes-per-peer"):
        TrainConfig(partition="nope")
    cfg = RunConfig().with_overrides({"train.partition": "dirichlet", "train.partition_alpha": "0.1", "train.partition_classes": "3"})
    assert (cfg.train.partition, cfg.train.partition_alpha, cfg.train.partition_classes) == ("dirichlet", 0.1, 3)
    assert cfg.fingerprint() != RunConfig().with_overrides({"train.partition": "dirichlet"}).fingerprint()
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


# --- through the trainer ----------------------------------------------------


def test_trainer_exposes_and_logs_the_shard_histogram(caplog: pytest.LogCaptureFixture) -> None:
    config = TrainConfig(partition="dirichlet", partition_alpha=0.1, shards=4, seed=5, batch_size=8)
    with caplog.at_level(logging.INFO, logger="gossiptrain.train.local_trainer"):
        trainer = LocalTrainer(DIGITS, DIGITS.build_model(0), config, shard=1)
    _, targets = DIGITS.train_shard(1, 4, 5, partition="dirichlet", alpha=0.1, classes_per_peer=2)
    assert len(trainer.class_histogram) == 10
    assert sum(trainer.class_histogram) == trainer.samples == len(targets)
    assert trainer.class_histogram == np.bincount(targets.numpy(), minlength=10).tolist()
    line = f"shard 1/4 (dirichlet alpha=0.1): {trainer.samples} samples, classes {trainer.class_histogram}"
    assert line in caplog.messages
    before = [p.detach().clone() for p in trainer.model.parameters()]
    loss = trainer.step()  # the skewed shard trains like any other
    assert math.isfinite(loss) and trainer.steps == 1 and 0 < trainer.samples_seen <= config.batch_size
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


class _ThreeArgumentWorkload(LogRegWorkload):
    """A user's workload written before partitions: train_shard takes (index, count, seed) only."""

    def train_shard(self, index: int, count: int, seed: int) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return super().train_shard(index, count, seed)


def test_old_workloads_work_with_iid_and_refuse_other_partitions() -> None:
    workload = _ThreeArgumentWorkload(dim=4, classes=3, train_samples=120, test_samples=30)
    trainer = LocalTrainer(workload, workload.build_model(0), TrainConfig(shards=3), shard=0)
    assert trainer.samples == 40 and sum(trainer.class_histogram) == 40 and len(trainer.class_histogram) == 3
    config = TrainConfig(shards=3, partition="classes-per-peer", partition_classes=1)
    with pytest.raises(WorkloadError, match="does not take the keywords"):
        LocalTrainer(workload, workload.build_model(0), config, shard=0)


def test_logreg_classes_per_peer_through_the_trainer() -> None:
    workload = LogRegWorkload(dim=4, classes=4, train_samples=400, test_samples=40)
    config = TrainConfig(workload="logreg", shards=4, partition="classes-per-peer", partition_classes=1)
    hists = [LocalTrainer(workload, workload.build_model(0), config, shard=i).class_histogram for i in range(4)]
    assert all(sum(1 for n in h if n) == 1 for h in hists)  # one class each
    assert np.sum(hists, axis=0).tolist() == np.bincount(workload._train[1].numpy(), minlength=4).tolist()
