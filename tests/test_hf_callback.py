"""Hugging Face Trainers become swarm members through ``GossipCallback``: they gossip, stop when asked, and leave.

Two real ``transformers.Trainer`` runs, in two threads of this process, train
a tiny randomly initialised GPT-2 (built from a config: nothing downloaded)
on synthetic token ids, each joining an in-process coordinator on its own
127.0.0.x address. Skipped, saying why, where the ``hf`` extra is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gossiptrain.errors import GossipError
from gossiptrain.net.addressing import free_loopback_port

from .conftest import fast_config
from .swarm import Procs, next_host

needs_hf = pytest.mark.skipif(
    find_spec("transformers") is None or find_spec("accelerate") is None,
    reason="needs transformers and accelerate, the hf extra: pip install 'gossiptrain[hf]'",
)

SEQ = 16  # tokens per sample
VOCAB = 64


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Synthetic text: each sample counts up from a start token by ``stride`` (mod the vocabulary), a learnable rule."""

    def __init__(self, stride: int, samples: int = 64) -> None:
        starts = torch.arange(samples) % VOCAB
        self.ids = (starts[:, None] + stride * torch.arange(SEQ)[None, :]) % VOCAB  # (samples, SEQ)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # every member starts from the same model
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ))


def trainer(tmp: Path, stride: int, max_steps: int, callbacks: list[Any], **more: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], save_strategy="no", logging_steps=5, use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, **more,
    )
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(stride), callbacks=callbacks)


def train_both(trainers: list[Any], timeout: float = 120) -> None:
    """``trainer.train()`` of each in its own thread; re-raises the first failure."""
    errors: list[BaseException] = []

    def run(t: Any) -> None:
        try:
            t.train()
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), "a Trainer did not finish"
    if errors:
        raise errors[0]


def swarm_join(coordinator_factory: Any) -> str:
    config = fast_config(**{"train.workload": "external", "train.shards": 2, "final.consensus_seconds": 0.3})
    return coordinator_factory(config).address.removeprefix("tcp://")


def loop_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "gossiptrain-loop"}


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)  # two Trainers share two busy cores


@needs_hf
@pytest.mark.timeout(120)
def test_two_trainers_gossip_end_with_one_model_and_leave(coordinator_factory: Any, tmp_path: Path) -> None:
    from gossiptrain.integrations import GossipCallback

    join = swarm_join(coordinator_factory)
    before = loop_threads()
    callbacks = [GossipCallback(join, bind=f"{next_host()}:0", wait_for_peers=2, wait_timeout=60) for _ in range(2)]
    trainers = [trainer(tmp_path / f"t{i}", stride=1 + i, max_steps=30, callbacks=[cb]) for i, cb in enumerate(callbacks)]
    start = {k: v.clone() for k, v in trainers[0].model.state_dict().items()}
    with callbacks[0], callbacks[1]:
        train_both(trainers)

    assert [t.state.global_step for t in trainers] == [30, 30]
    for cb in callbacks:
        assert cb.peer is not None and cb.final_report is not None
        stats = cb.peer.stats()
        assert stats["steps"] == 30 and stats["completed"] + stats["served"] > 0, stats
        assert cb.final_report.reason == "budget" and cb.final_report.all_done
        assert cb.peer.samples_seen == 30 * 4  # global steps times the batch
    # The final consensus leaves both with (about) one model; apart, training on other data, they would differ.
    a, b = (dict(t.model.named_parameters()) for t in trainers)
    apart = sum((b[k] - a[k]).norm() ** 2 for k in a) ** 0.5
    moved = sum((a[k] - start[k]).norm() ** 2 for k in a) ** 0.5
    assert apart < 0.1 * moved, (apart, moved)
    # Both peers left: their network threads are gone and they refuse further use.
    assert loop_threads() <= before
    with pytest.raises(GossipError, match="closed"):
        callbacks[0].peer.step()  # type: ignore[union-attr]


@needs_hf
@pytest.mark.timeout(120)
def test_a_members_stop_request_ends_the_other_trainer_early(coordinator_factory: Any, tmp_path: Path) -> None:
    from transformers import TrainerCallback

    from gossiptrain.integrations import GossipCallback

    class StopAt(TrainerCallback):
        """As `gossiptrain stop` would: at step 5, ask the whole swarm to finish."""

        def __init__(self, gossip: GossipCallback) -> None:
            self.gossip = gossip

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 5:
                assert self.gossip.peer is not None
                self.gossip.peer.request_stop("test over")

    join = swarm_join(coordinator_factory)
    callbacks = [GossipCallback(join, bind=f"{next_host()}:0", wait_for_peers=2, wait_timeout=60) for _ in range(2)]
    trainers = [
        trainer(tmp_path / "t0", stride=1, max_steps=100_000, callbacks=[callbacks[0], StopAt(callbacks[0])]),
        trainer(tmp_path / "t1", stride=2, max_steps=100_000, callbacks=[callbacks[1]]),
    ]
    with callbacks[0], callbacks[1]:
        train_both(trainers)
    steps = [t.state.global_step for t in trainers]
    # The asker stopped at its step 5 or just after; the other wherever the stop found it (it may be behind: CI
    # once saw 3), long before its budget.
    assert steps[0] >= 5 and steps[1] >= 1 and all(s < 100_000 for s in steps), steps
    assert [cb.final_report.reason for cb in callbacks if cb.final_report] == ["stop", "stop"]


@needs_hf
@pytest.mark.timeout(120)
def test_two_trainers_lease_chunks_of_one_dataset_through_the_callbacks_sampler(coordinator_factory: Any, tmp_path: Path) -> None:
    """`GossipCallback.sampler`: both Trainers read one dataset's leased chunks; each sample goes to one of them."""
    from transformers import Trainer, TrainingArguments

    from gossiptrain.integrations import GossipCallback

    join = swarm_join(coordinator_factory)
    callbacks = [GossipCallback(join, bind=f"{next_host()}:0", wait_for_peers=2, wait_timeout=60) for _ in range(2)]
    data = Tokens(stride=1, samples=1024)  # every member holds the same dataset
    seen: list[list[int]] = [[], []]

    class Counted(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self, who: int) -> None:
            self.who = who

        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            seen[self.who].append(i)
            return data[i]

    def leased(i: int, cb: GossipCallback) -> Any:
        class LeasedTrainer(Trainer):  # the two lines the docstring of GossipCallback.sampler shows
            def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
                return cb.sampler(len(self.train_dataset))

        args = TrainingArguments(output_dir=str(tmp_path / f"t{i}"), max_steps=16, per_device_train_batch_size=4,
                                 learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True,
                                 disable_tqdm=True, dataloader_num_workers=0)
        return LeasedTrainer(model=tiny_gpt2(), args=args, train_dataset=Counted(i), callbacks=[cb])

    trainers = [leased(i, cb) for i, cb in enumerate(callbacks)]
    assert len(trainers[0].get_train_dataloader()) == 1024 // 2 // 4  # before joining: a half share, in batches
    with callbacks[0], callbacks[1]:
        train_both(trainers)
    assert [t.state.global_step for t in trainers] == [16, 16]
    for cb, mine in zip(callbacks, seen):
        stats = cb.peer.stats()  # type: ignore[union-attr]
        # 16 batches of 4, and a batch or two the loader read ahead (accelerate looks one batch past the last step);
        # the sampler counted what it gave out, 16 samples at a time.
        assert 16 * 4 <= len(mine) <= 18 * 4 and len(mine) - 16 <= stats["samples_trained"] <= len(mine), (len(mine), stats)
    # About 2 x 64 of 1,024 samples, all of the first epoch: a sample went to both Trainers only where both claimed
    # its chunk before hearing of the other's claim, and the loser counted what it had trained of it.
    twice = [cb.peer.stats() for cb in callbacks]  # type: ignore[union-attr]
    both = set(seen[0]) & set(seen[1])
    assert len(both) <= sum(st["samples_trained_twice"] for st in twice), (len(both), twice)
    assert all(len(set(mine)) == len(mine) for mine in seen)  # neither read a sample twice
    assert all(st["lease_epoch"] == 0 for st in twice)


@needs_hf
@pytest.mark.timeout(60)
def test_a_trainer_that_raises_inside_the_with_block_leaves_the_swarm(coordinator_factory: Any, tmp_path: Path) -> None:
    from transformers import TrainerCallback

    from gossiptrain.integrations import GossipCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 3:
                raise RuntimeError("out of memory, say")

    join = swarm_join(coordinator_factory)
    before = loop_threads()
    gossip = GossipCallback(join, bind=f"{next_host()}:0")
    t = trainer(tmp_path, stride=1, max_steps=30, callbacks=[gossip, Crash()])
    with pytest.raises(RuntimeError, match="out of memory"):
        with gossip:
            t.train()  # the Trainer calls no on_train_end on the way out: the with block closes the peer
    assert gossip.peer is not None and gossip.peer.steps == 3 and gossip.final_report is None
    assert loop_threads() <= before
    with pytest.raises(GossipError, match="closed"):
        gossip.peer.step()


@needs_hf
def test_a_two_process_trainer_is_one_member_whose_ranks_end_with_the_same_model(
    procs: Procs, coordinator_factory: Any, tmp_path: Path
) -> None:
    """As under torchrun: rank 0 joins, rank 1 follows it; beside a single-process Trainer they gossip."""
    
    from gossiptrain.integrations import GossipCallback

    coord = coordinator_factory(fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 120}))
    join = coord.address.removeprefix("tcp://")
    port = free_loopback_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    ranks = [procs.start(str(r), str(port), join, str(outs[r]), "20", name=f"rank{r}", module="tests.hf_ranks")
             for r in range(2)]
    with GossipCallback(join, bind=f"{next_host()}:0", wait_for_peers=2, wait_timeout=60) as solo:  # another member
        train_both([trainer(tmp_path / "solo", 3, 100, [solo])])
    assert [p.wait(120) for p in ranks] == [0, 0], [p.output()[-3000:] for p in ranks]
    leader, worker = (json.loads(o.read_text()) for o in outs)
    assert (leader["kind"], worker["kind"]) == ("Peer", "GroupWorker") and leader["id"] == worker["id"]
    assert leader["steps"] == worker["steps"] == 20 and leader["digest"] == worker["digest"]
    assert leader["exchanges"] > 0


@needs_hf
def test_a_callback_used_outside_a_trainer_says_it_has_no_peer() -> None:
    from gossiptrain.integrations import GossipCallback

    cb = GossipCallback("127.0.0.1:1")
    with pytest.raises(GossipError, match="no live peer.*on_train_begin"):
        cb.on_step_end(SimpleNamespace(world_size=1), SimpleNamespace(global_step=1), SimpleNamespace())
    cb.close()  # nothing to close: no error


def test_importing_the_package_needs_no_transformers_and_using_it_without_names_the_extra() -> None:
    code = (
        "import sys\n"
        "import gossiptrain.integrations\n"
        "assert 'transformers' not in sys.modules, 'imported transformers'\n"
        "sys.modules['transformers'] = None  # as if it were not installed\n"
        "try:\n"
        "    gossiptrain.integrations.GossipCallback\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "pip install 'gossiptrain[hf]'" in run.stdout
