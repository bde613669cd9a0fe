"""Tests for the Workload protocol, load_workload, batches, the metrics and the built-ins.

The built-in workloads are the ground every distributed test stands on: if
shards overlap or models differ across peers with one seed, averaging results
mean nothing. Metrics are held against scikit-learn.
"""

from __future__ import annotations

import itertools
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics

from gossiptrain.errors import WorkloadError
from gossiptrain.train.evaluation import EvalResult, classification_eval
from gossiptrain.train.workload import Workload, batches, builtin_workloads, load_workload
from peers.digits import DigitsWorkload
from peers.logreg import LogRegWorkload


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Training tests run single-threaded like one peer per core would; put
    # the setting back so other tests are unaffected.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(workload: Workload, seed: int, steps: int, lr: float) -> EvalResult:
    model = workload.build_model(seed)
    inputs, targets = workload.train_shard(0, 1, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in itertools.islice(batches(inputs, targets, 32, seed), steps):
        optimizer.zero_grad()
        workload.loss(model, x, y).backward()
        optimizer.step()
    return workload.evaluate(model)


# --- built-in workloads ----------------------------------------------------


def test_builtins_are_workloads_and_load_by_name() -> None:
    assert builtin_workloads() == ("charlm", "digits", "digits-small", "logreg")
    digits = load_workload("digits")
    small = load_workload("digits-small")
    logreg = load_workload("logreg")
    assert isinstance(digits, DigitsWorkload) and digits.name == "digits"
    assert isinstance(small, DigitsWorkload) and small.name == "digits-small" and (small.hidden, small.depth) == (256, 1)
    assert isinstance(logreg, LogRegWorkload) and logreg.name == "logreg"
    assert isinstance(digits, Workload) and isinstance(logreg, Workload)


WORKLOADS = [DigitsWorkload(hidden=16), LogRegWorkload(train_samples=500, test_samples=50)]


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
@settings(max_examples=30, deadline=None)
@given(count=st.integers(1, 16), seed=st.integers(0, 2**32))
def test_shards_are_disjoint_covering_balanced_and_deterministic(
    workload: Workload, count: int, seed: int
) -> None:
    shards = [workload.train_shard(i, count, seed) for i in range(count)]
    full_x, full_y = workload.train_shard(0, 1, seed)
    sizes = [x.shape[0] for x, _ in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == full_x.shape[0]
    # Rows are compared as whole (input, target) records: disjoint and covering
    # means the shards' multiset of rows is exactly the training split's.
    rows = torch.cat([torch.cat([x, y[:, None].float()], dim=1) for x, y in shards])
    full = torch.cat([full_x, full_y[:, None].float()], dim=1)
    got, got_counts = np.unique(rows.numpy(), axis=0, return_counts=True)
    want, want_counts = np.unique(full.numpy(), axis=0, return_counts=True)
    assert np.array_equal(got, want) and np.array_equal(got_counts, want_counts)
    for (x, y), index in zip(shards, range(count)):
        assert y.dtype == torch.int64 and y.shape == (x.shape[0],)
        again_x, again_y = workload.train_shard(index, count, seed)
        assert torch.equal(x, again_x) and torch.equal(y, again_y)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
@pytest.mark.parametrize("partition", ["dirichlet", "classes-per-peer"])
def test_non_iid_shards_are_disjoint_and_covering(workload: Workload, partition: str) -> None:
    # Label-skewed shards differ in size, but still split the training records exactly.
    kwargs = {"partition": partition, "alpha": 0.1, "classes_per_peer": 2}
    shards = [workload.train_shard(i, 5, 3, **kwargs) for i in range(5)]  # type: ignore[call-arg]
    full_x, full_y = workload.train_shard(0, 1, 3)
    rows = torch.cat([torch.cat([x, y[:, None].float()], dim=1) for x, y in shards])
    full = torch.cat([full_x, full_y[:, None].float()], dim=1)
    got, got_counts = np.unique(rows.numpy(), axis=0, return_counts=True)
    want, want_counts = np.unique(full.numpy(), axis=0, return_counts=True)
    assert np.array_equal(got, want) and np.array_equal(got_counts, want_counts)
    assert all(len(y) >= 1 for _, y in shards)
    if partition == "classes-per-peer":
        assert all(y.unique().numel() <= 2 for _, y in shards)


def test_shards_depend_on_seed_but_split_does_not() -> None:
    workload = DigitsWorkload(hidden=16)
    a, _ = workload.train_shard(0, 4, seed=1)
    b, _ = workload.train_shard(0, 4, seed=2)
    assert not torch.equal(a, b)
    # The held-out split is fixed: a second instance evaluates identically.
    model = workload.build_model(0)
    assert DigitsWorkload(hidden=16).evaluate(model) == workload.evaluate(model)


@pytest.mark.parametrize("index,count", [(-1, 2), (2, 2), (0, 0), (0, 10_000)])
def test_bad_shard_requests_raise(index: int, count: int) -> None:
    with pytest.raises(WorkloadError):
        LogRegWorkload(train_samples=100).train_shard(index, count, seed=0)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_build_model_is_deterministic_by_seed(workload: Workload) -> None:
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    a = workload.build_model(7).state_dict()
    b = workload.build_model(7).state_dict()
    c = workload.build_model(8).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    # Building a model leaves the global RNG alone (peers share a process in sim).
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_digits_model_sizes_match_their_docstrings() -> None:
    model = DigitsWorkload().build_model(0)
    assert sum(p.numel() for p in model.parameters()) == 1_126_410
    assert sum(p.numel() for p in load_workload("digits-small").build_model(0).parameters()) == 19_210


def test_evaluate_restores_mode_and_keeps_no_graph() -> None:
    workload = LogRegWorkload(train_samples=64, test_samples=64)
    model = workload.build_model(0)
    model.train()
    result = workload.evaluate(model)
    assert model.training
    model.eval()
    workload.evaluate(model)
    assert not model.training
    assert result.samples == 64 and 0.0 <= result.accuracy <= 1.0


def test_digits_sgd_reaches_093_within_a_few_hundred_steps(one_thread: None) -> None:
    # Calibration for the distributed tests: measured about 50-75 steps
    # (about 3 ms per step at batch 32 on one thread).
    result = _train(DigitsWorkload(), seed=0, steps=300, lr=0.05)
    assert result.accuracy >= 0.93, result


def test_digits_small_reaches_093_in_as_few_steps(one_thread: None) -> None:
    """The tests' stand-in learns like the reference workload: what they check of training still holds."""
    result = _train(load_workload("digits-small"), seed=0, steps=300, lr=0.05)
    assert result.accuracy >= 0.93, result


def test_logreg_sgd_approaches_the_teacher(one_thread: None) -> None:
    workload = LogRegWorkload()
    before = workload.evaluate(workload.build_model(0))
    result = _train(workload, seed=0, steps=300, lr=0.05)
    # Label noise caps accuracy near 0.97; an untrained model is near chance.
    assert result.accuracy >= 0.9, result
    assert result.loss < before.loss


# --- batches ---------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 50), batch_size=st.integers(1, 64), seed=st.integers(0, 2**31))
def test_batches_are_full_distinct_and_disjoint_within_an_epoch(
    n: int, batch_size: int, seed: int
) -> None:
    inputs = torch.arange(n, dtype=torch.float32)[:, None] * torch.ones(1, 3)  # (n, 3)
    targets = torch.arange(n)  # (n,)
    size = min(batch_size, n)
    per_epoch = n // size
    epochs = 3
    stream = list(itertools.islice(batches(inputs, targets, batch_size, seed), epochs * per_epoch))
    assert all(x.shape == (size, 3) and y.shape == (size,) for x, y in stream)
    assert all(torch.equal(x[:, 0].long(), y) for x, y in stream)  # rows stay paired
    for e in range(epochs):
        served = torch.cat([y for _, y in stream[e * per_epoch : (e + 1) * per_epoch]])
        assert served.unique().numel() == per_epoch * size  # no sample twice in an epoch
    again = list(itertools.islice(batches(inputs, targets, batch_size, seed), len(stream)))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(stream, again))


def test_batches_reshuffle_each_epoch_and_depend_on_seed() -> None:
    inputs, targets = torch.zeros(100, 1), torch.arange(100)
    first, second = itertools.islice(batches(inputs, targets, 100, seed=0), 2)
    other = next(batches(inputs, targets, 100, seed=1))
    assert not torch.equal(first[1], second[1])
    assert not torch.equal(first[1], other[1])


@pytest.mark.parametrize(
    "inputs,targets,batch_size",
    [
        (torch.zeros(4, 2), torch.zeros(3, dtype=torch.long), 2),
        (torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), 2),
        (torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), 0),
    ],
)
def test_batches_reject_bad_input_at_call_time(
    inputs: torch.Tensor, targets: torch.Tensor, batch_size: int
) -> None:
    with pytest.raises(WorkloadError):
        batches(inputs, targets, batch_size, seed=0)


# --- load_workload ---------------------------------------------------------


def _user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    # A fresh module name per test: sys.modules caches imports across tests.
    name = f"user_workload_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


USER_WORKLOAD = """
    from peers.logreg import LogRegWorkload

    class Small(LogRegWorkload):
        name = "small"

        def __init__(self):
            super().__init__(dim=4, train_samples=40, test_samples=20)

    def make():
        return Small()

    instance = Small()
    not_a_workload = 42

    def makes_junk():
        return "junk"

    def explodes():
        raise RuntimeError("boom")
"""


@pytest.mark.parametrize("attr", ["Small", "make", "instance"])
def test_user_module_attr_may_be_class_factory_or_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attr: str
) -> None:
    module = _user_module(tmp_path, monkeypatch, USER_WORKLOAD)
    workload = load_workload(f"{module}:{attr}")
    assert isinstance(workload, Workload) and workload.name == "small"
    x, y = workload.train_shard(0, 2, seed=0)
    assert x.shape == (20, 4) and y.shape == (20,)


@pytest.mark.parametrize("default", ["workload", "Workload"])
def test_bare_module_uses_its_default_attribute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default: str
) -> None:
    body = f"from peers.logreg import LogRegWorkload\n{default} = LogRegWorkload(dim=3)\n"
    module = _user_module(tmp_path, monkeypatch, body)
    workload = load_workload(module)
    assert isinstance(workload, LogRegWorkload) and workload.dim == 3


@pytest.mark.parametrize(
    "attr,cause",
    [
        ("missing", "has no attribute 'missing'"),
        ("not_a_workload", "not a Workload"),
        ("makes_junk", "not a Workload"),
        ("explodes", "boom"),
    ],
)
def test_bad_attributes_raise_workload_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attr: str, cause: str
) -> None:
    module = _user_module(tmp_path, monkeypatch, USER_WORKLOAD)
    with pytest.raises(WorkloadError, match=cause) as info:
        load_workload(f"{module}:{attr}")
    assert f"{module}:{attr}" in str(info.value)


def test_bare_module_without_default_attribute_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _user_module(tmp_path, monkeypatch, "x = 1\n")
    with pytest.raises(WorkloadError, match="neither") as info:
        load_workload(module)
    assert module in str(info.value)


def test_module_failing_to_import_is_not_called_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _user_module(tmp_path, monkeypatch, "import no_such_dependency_xyz\n")
    with pytest.raises(WorkloadError, match="importing module") as info:
        load_workload(f"{module}:thing")
    assert module in str(info.value) and "no_such_dependency_xyz" in str(info.value)


@pytest.mark.parametrize(
    "name,cause",
    [
        ("no_such_module_xyz", "not found"),
        ("no_such_package_xyz.sub:attr", "not found"),
        ("peers.no_such_module:attr", "not found"),
        ("nonsense-name!", "not found"),
        (":attr", "expected one of"),
        ("peers.digits:", "expected one of"),
        ("a:b:c", "expected one of"),
    ],
)
def test_unknown_or_malformed_names_raise(name: str, cause: str) -> None:
    with pytest.raises(WorkloadError, match=cause) as info:
        load_workload(name)
    assert repr(name) in str(info.value)


def test_external_is_reserved() -> None:
    with pytest.raises(WorkloadError, match="reserved") as info:
        load_workload("external")
    assert "Python API" in str(info.value)


def test_importing_the_runtime_does_not_import_peers() -> None:
    import subprocess
    import sys

    code = "import sys, gossiptrain.train.workload; print('peers' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "False"


# --- classification_eval ---------------------------------------------------


def _logits() -> st.SearchStrategy[np.ndarray]:
    # Small integers make argmax ties and never-predicted classes common.
    def arrays(n: int, c: int) -> st.SearchStrategy[np.ndarray]:
        return st.one_of(
            hnp.arrays(np.float32, (n, c), elements=st.integers(-2, 2).map(float)),
            hnp.arrays(np.float32, (n, c), elements=st.floats(-8, 8, width=32)),
        )

    return st.tuples(st.integers(1, 40), st.integers(2, 6)).flatmap(lambda nc: arrays(*nc))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), logits=_logits())
def test_classification_eval_agrees_with_sklearn(data: st.DataObject, logits: np.ndarray) -> None:
    n, c = logits.shape
    targets = np.array(data.draw(st.lists(st.integers(0, c - 1), min_size=n, max_size=n)))
    result = classification_eval(torch.from_numpy(logits), torch.from_numpy(targets), c)

    preds = logits.argmax(axis=1)
    p, r, f, _ = metrics.precision_recall_fscore_support(
        targets, preds, average="macro", zero_division=0
    )
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    loss = metrics.log_loss(targets, probs, labels=list(range(c)))
    assert result.samples == n
    assert result.accuracy == pytest.approx(metrics.accuracy_score(targets, preds), abs=1e-6)
    assert result.precision == pytest.approx(p, abs=1e-6)
    assert result.recall == pytest.approx(r, abs=1e-6)
    assert result.f1 == pytest.approx(f, abs=1e-6)
    assert result.loss == pytest.approx(loss, abs=1e-6)


def test_classification_eval_known_values() -> None:
    # Class 2 is never predicted: its precision counts as 0, like zero_division=0.
    logits = torch.tensor([[5.0, 0, 0], [0, 5, 0], [0, 5, 0], [5, 0, 0]])
    targets = torch.tensor([0, 1, 2, 2])
    result = classification_eval(logits, targets, 3)
    assert result.accuracy == 0.5
    assert result.precision == pytest.approx((1 / 2 + 1 / 2 + 0) / 3)
    assert result.recall == pytest.approx((1 + 1 + 0) / 3)
    assert result.to_dict() == {
        "loss": result.loss,
        "accuracy": 0.5,
        "precision": result.precision,
        "recall": result.recall,
        "f1": result.f1,
        "samples": 4,
    }


@pytest.mark.parametrize(
    "logits,targets",
    [
        (torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)),  # wrong class count
        (torch.zeros(3, 3), torch.zeros(2, dtype=torch.long)),  # length mismatch
        (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)),  # empty
        (torch.zeros(2, 3), torch.tensor([0, 3])),  # target out of range
    ],
)
def test_classification_eval_rejects_bad_shapes(
    logits: torch.Tensor, targets: torch.Tensor
) -> None:
    with pytest.raises(WorkloadError):
        classification_eval(logits, targets, 3)


def test_the_bundled_digits_split_is_scikit_learns_and_loading_it_imports_no_sklearn() -> None:
    """peers/data/digits.safetensors holds sklearn's digits and the fixed stratified split, exactly."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from peers.digits import BUNDLED, bundled_split

    stored, fresh = load_file(str(BUNDLED)), bundled_split()
    assert stored.keys() == fresh.keys() and all(torch.equal(stored[k], fresh[k]) for k in fresh)
    assert len(stored["train_index"]) == 1437 and len(stored["test_index"]) == 360
    assert set(stored["train_index"].tolist()).isdisjoint(stored["test_index"].tolist())
    code = "import sys; from peers.digits import DigitsWorkload; DigitsWorkload(); print(any(m.startswith('sklearn') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
