"""A loop written with accelerate or DDP hands ``Peer`` its wrapped model and optimizer; the peer takes what is inside.

Unwrapped by hand before, an ``AcceleratedOptimizer`` given to ``Peer`` was
no ``torch.optim.SGD``: quasi-global momentum stayed off without a word.
A DDP model's names carry ``module.``, so its join would be refused by a
swarm of single-process peers.
"""

from __future__ import annotations

import threading
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gossiptrain import Peer
from gossiptrain.runtime.wrapped import inner_model, inner_optimizer

from .conftest import fast_config
from .swarm import next_host, wait_for

needs_accelerate = pytest.mark.skipif(
    find_spec("accelerate") is None, reason="needs accelerate, in the hf extra: pip install 'gossiptrain[hf]'"
)


def test_ddp_and_plain_objects(tmp_path: Path) -> None:
    import torch.distributed as dist

    model = torch.nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert inner_model(model) is model and inner_optimizer(sgd) is sgd and inner_optimizer(None) is None
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert inner_model(ddp) is model
        assert [n for n, _ in ddp.named_parameters()] == ["module.weight", "module.bias"]
    finally:
        dist.destroy_process_group()


@needs_accelerate
def test_an_accelerated_optimizer_is_the_torch_one_inside() -> None:
    from accelerate import Accelerator

    model = torch.nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepared_model, prepared = Accelerator(cpu=True).prepare(model, sgd)
    assert prepared is not sgd and not isinstance(prepared, torch.optim.SGD)  # what the loop steps
    assert inner_optimizer(prepared) is sgd and inner_model(prepared_model) is prepared_model


@needs_accelerate
@pytest.mark.timeout(120)
def test_two_accelerate_loops_gossip_with_the_optimizer_inside_and_end_with_one_model(coordinator_factory: Any) -> None:
    """The README's accelerate loop, two of them: SGD with momentum gets its quasi-global buffer, the swarm one model."""
    from accelerate import Accelerator

    coord = coordinator_factory(fast_config(**{"train.workload": "external", "train.shards": 2, "state.enabled": False,
                                               "gossip.momentum_mode": "quasi-global"}))
    join = coord.address.removeprefix("tcp://")
    steps = 60
    results: list[dict[str, Any]] = [{}, {}]
    errors: list[BaseException] = []
    ready = threading.Barrier(2, timeout=60)

    def loop(index: int) -> None:
        try:
            torch.manual_seed(index)
            accelerator = Accelerator(cpu=True)
            model = torch.nn.Linear(16, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            model, optimizer = accelerator.prepare(model, optimizer)
            start = [p.detach().clone() for p in model.parameters()]
            peer = Peer(model, join=join, bind=f"{next_host()}:0", optimizer=optimizer, transfer_state=False)
            try:
                wait_for(lambda: peer.members == 2, 30, "both loops to see each other")
                ready.wait()
                data = torch.Generator().manual_seed(100 + index)
                for _ in range(steps):
                    x = torch.randn(8, 16, generator=data)
                    y = (x[:, index] > 0).long() + 2 * index  # each loop its own two classes: models apart alone
                    loss = F.cross_entropy(model(x), y)
                    optimizer.zero_grad()
                    accelerator.backward(loss)
                    optimizer.step()
                    peer.step()
                results[index].update(
                    inner=peer.optimizer is optimizer.optimizer, momentum=bool(peer._momentum and peer._momentum.enabled),
                    exchanges=peer.stats()["completed"] + peer.stats()["served"], report=peer.finish(),
                    model=[p.detach().clone() for p in model.parameters()], start=start,
                )
            finally:
                peer.close()
        except BaseException as e:  # re-raised below
            errors.append(e)
            ready.abort()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors
    for r in results:
        assert r["inner"] and r["momentum"] and r["exchanges"] > 0, r
        assert r["report"].all_done
    apart = sum(float((a - b).norm() ** 2) for a, b in zip(results[0]["model"], results[1]["model"])) ** 0.5
    moved = sum(float((a - b).norm() ** 2) for a, b in zip(results[0]["model"], results[0]["start"])) ** 0.5
    assert apart < 0.1 * moved, (apart, moved)  # the final phase left one model
