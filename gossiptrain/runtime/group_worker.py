"""``WorkerRank``: what ``Peer(..., group=g)`` does on a rank other than 0 (see ``gossiptrain.runtime.peer_group``).

It never joins the swarm and opens no socket: it mirrors the leader's
collectives, so a training loop written for ``Peer`` runs unchanged on
every rank. ``step()`` receives the leader's parameters after its safe
point, ``agree()`` its decisions, ``finish()`` the consensus the final
phase reached; what only a member can do (asking the swarm to stop) says so.

``WorkerRank`` holds those methods only. ``gossiptrain.runtime.peer``
makes them a ``Peer`` (``GroupWorker(WorkerRank, Peer)``: the steps,
shards, samples seen and context manager come from ``Peer``) and picks
``GroupWorker`` for a rank other than 0; this module knows nothing of
``Peer``, so the two import in one direction only.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from gossiptrain.config import RunConfig
from gossiptrain.errors import GossipError
from gossiptrain.runtime.factories import ModelFactory, OptimizerFactory
from gossiptrain.runtime.final_phase import FinalReport
from gossiptrain.runtime.optimizer_finder import FIND_OPTIMIZER, FindOptimizer
from gossiptrain.runtime.peer_group import PeerGroup, control_dict
from gossiptrain.runtime.preflight import refuse_unusable_model
from gossiptrain.runtime.wrapped import inner_model, inner_optimizer


class WorkerRank:
    """A worker of a peer made of several (rank > 0): the leader's model after every safe point, no network."""

    _split_model = False  # every rank holds the whole model (``SplitWorkerRank``: a piece of it)

    def __init__(
        self,
        model: torch.nn.Module | ModelFactory,
        join: str = "",
        *,
        group: Any = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory | FindOptimizer | None = FIND_OPTIMIZER,
        **member_only: Any,  # bind, advertise, security, ...: the leader's business
    ) -> None:
        self._closed = False
        self._node = None
        if isinstance(model, torch.nn.Module):  # as the leader does, before the first collective: all ranks refuse alike
            refuse_unusable_model(inner_model(model), pieces=self._split_model)
        self._group = PeerGroup(group)
        info = self._group.share(None)  # the leader's welcome, or its failure raised here
        self.config = RunConfig.from_dict(info["config"])
        self.fingerprint, self.id, self.shard = info["fingerprint"], info["id"], int(info["shard"])
        self.address, self.joined_via = info["address"], info["joined_via"]
        self.taken_from_swarm = list(info.get("taken_from_swarm", []))
        self.transfer = None
        self.model = inner_model(model if isinstance(model, torch.nn.Module) else model(self.config, self.shard))
        # Not named (Peer's default): a split rank finds its own at its first step (SplitWorkerRank)
        self._find_optimizer = isinstance(optimizer, FindOptimizer)
        self.optimizer = None if isinstance(optimizer, FindOptimizer) else inner_optimizer(
            optimizer(self.config, self.model) if callable(optimizer) else optimizer)
        self._step = 0
        self._samples: int | None = None
        self._control: dict[str, float] = {}
        self._start_worker(join, member_only)

    def _start_worker(self, join: str, member_only: dict[str, Any]) -> None:
        """Welcomed: take the leader's model (every rank holds it whole)."""
        assert self._group is not None
        self._group.check_whole(self.model)
        self._follow()

    def _follow(self) -> None:
        assert self._group is not None
        self._control = control_dict(self._group.sync(self.model))
        self._step = int(self._control.get("steps", self._step))

    # -- what a loop calls --------------------------------------------------------------------------

    def step(self, samples_seen: int | None = None) -> None:
        """The leader's model after its safe point (and its step count)."""
        self._check_worker()
        if samples_seen is not None:
            self._samples = samples_seen
        self._follow()

    def agree(self, flag: bool) -> bool:
        assert self._group is not None
        return self._group.agree(flag)

    @property
    def finish_requested(self) -> bool:
        return bool(self._control.get("finish_requested", 0.0))

    @property
    def members(self) -> int:
        return int(self._control.get("members", 0.0))

    def wait_for_peers(self, count: int, timeout: float | None = None, **_: Any) -> int:
        """Whatever the leader's rendezvous ended with: ``count`` if it was reached, else 0."""
        return count if self.agree(False) else 0

    def serve_before_training(self) -> None:
        pass

    def report(self, **_: float | None) -> None:
        pass  # the leader answers `gossiptrain status` for the peer

    def resume_at(self, step: int) -> None:
        self._step = step

    def averaging_state(self) -> dict[str, float]:
        return {}

    def restore_averaging(self, state: Mapping[str, float] | None) -> None:
        pass

    def finish(
        self, reason: str = "budget", final_model: Any = None, abort: Callable[[], bool] = lambda: False
    ) -> FinalReport:
        """Wait for the leader's final phase; the model is then the consensus it reached."""
        self._check_worker()
        self._follow()
        return FinalReport(reason)

    def request_stop(self, reason: str = "") -> None:
        raise GossipError("only rank 0 of a peer made of several workers is a swarm member: ask there")

    def transfer_summary(self) -> dict[str, Any]:
        return {"state_transfer": "none", "state_donors": []}

    def stats(self) -> dict[str, Any]:
        return {"steps": self._step, "members": self.members}

    def close(self) -> None:
        self._closed = True

    def _check_worker(self) -> None:
        if self._closed:
            raise GossipError("this peer is closed")
