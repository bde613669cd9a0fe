"""``GossipCallback``: a Hugging Face ``Trainer`` that is a member of a gossip swarm.

::

    from gossiptrain.integrations import GossipCallback

    with GossipCallback(join="coordinator-host:7070") as gossip:
        Trainer(model, args, train_dataset=data, callbacks=[gossip]).train()

The Trainer keeps its own loop; the callback drives a ``gossiptrain.Peer``
from the Trainer's events, exactly where a hand-written loop would call it:

- ``on_train_begin``: join the swarm with the Trainer's model and optimizer
  (``Peer(model, join=..., optimizer=...)``; the join downloads a live
  member's state, as any joining peer does).
- ``on_step_end`` (after each optimizer step, so once per gradient
  accumulation cycle): ``peer.step(samples_seen=...)``, the safe point where
  finished exchanges are applied; when the swarm was asked to stop
  (``gossiptrain stop``, a member's ``request_stop``) it sets
  ``control.should_training_stop``.
- ``on_log`` / ``on_evaluate``: ``peer.report(...)`` for ``gossiptrain status``.
- ``on_train_end``: ``peer.finish(...)`` (the final consensus, optionally the
  swarm's merged model), then ``peer.close()``.

The Trainer does not call ``on_train_end`` when training raises (or on
Ctrl+C), so a peer would stay in the swarm, its threads running, until the
process exits. Use the callback as a context manager (its exit closes the
peer whatever happened), or call ``close()`` yourself in a ``finally``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # the optional extra is not installed
    raise ImportError(
        "gossiptrain.integrations.GossipCallback needs Hugging Face transformers (and accelerate, for its Trainer): "
        "pip install 'gossiptrain[hf]'"
    ) from e

import torch

from gossiptrain.config import RunConfig, SecurityConfig
from gossiptrain.errors import ConfigError, GossipError
from gossiptrain.runtime.final_phase import FinalReport
from gossiptrain.runtime.peer import Peer

log = logging.getLogger(__name__)


class GossipCallback(TrainerCallback):
    """Makes the ``Trainer`` it is given to a swarm member; one peer per ``train()`` call.

    ``join``, ``bind``, ``advertise``, ``config``, ``security``, ``seed``,
    ``join_attempts`` and ``transfer_state`` go to ``gossiptrain.Peer`` as
    they are (``transfer_state=False`` when you resume from a checkpoint on
    purpose: the join would otherwise replace it with a live member's state).
    ``wait_for_peers=n`` waits, before the first step, until ``n`` members
    (this one included) are ready, at most ``wait_timeout`` seconds: a run
    whose members should start together. ``final_model``, a path or URL,
    makes this member write the swarm's merged model at the end.

    Data: each Trainer trains on the dataset you give it (``peer.shard``/
    ``peer.num_shards`` are known only once training begins, after the
    Trainer built its data loader), unless it trains leased chunks of a
    dataset every member holds (``sampler``: a faster member trains more, a
    dead member's chunks are taken over). What it does not do: save the peer's
    averaging state in the Trainer's checkpoints.

    After training, ``peer`` is the (closed) peer, for ``peer.stats()``, and
    ``final_report`` says how the final phase went (None when it did not run).

    A multi-process Trainer (torchrun, DDP: ``args.world_size > 1``) is one
    member: every rank's callback makes ``Peer(..., group=...)`` over the
    Trainer's process group, rank 0 joins, and after each optimizer step the
    other ranks receive rank 0's parameters (``gossiptrain.runtime.peer_group``);
    all ranks stop at the same step when the swarm asks (``Peer.agree``).
    """

    def __init__(
        self,
        join: str,
        *,
        bind: str | None = None,
        advertise: str | None = None,
        config: RunConfig | None = None,
        security: SecurityConfig | None = None,
        seed: int | None = None,
        join_attempts: int | None = None,
        transfer_state: bool = True,
        wait_for_peers: int | None = None,
        wait_timeout: float | None = None,
        final_model: str | Path | None = None,
    ) -> None:
        self.join = join
        self._peer_kwargs: dict[str, Any] = dict(
            bind=bind, advertise=advertise, config=config, security=security, seed=seed,
            join_attempts=join_attempts, transfer_state=transfer_state,
        )
        self.wait_for_peers = wait_for_peers
        self.wait_timeout = wait_timeout
        self.final_model = final_model
        self.peer: Peer | None = None
        self.final_report: FinalReport | None = None
        self._open = False  # self.peer is a live member (Peer has no public "closed")
        self._samples_per_step = 0

    def sampler(self, num_samples: int, *, seed: int | None = None) -> "torch.utils.data.Sampler[int]":
        """The Trainer's sampler over leased chunks of a dataset of ``num_samples`` that every member holds
        (``Peer.sampler``; the run's ``data.*`` settings), made once this member has joined. The Trainer builds
        its data loader before the callback joins, so give it this through a two-line subclass::

            class LeasedTrainer(Trainer):
                def _get_train_sampler(self, *args, **kwargs):
                    return gossip.sampler(len(self.train_dataset))

        One pass over it is one epoch of the swarm; its length, which the Trainer reads to plan epochs and
        schedules, is this member's share if the ``wait_for_peers`` members (1 if not given) split it evenly:
        give the Trainer ``max_steps`` for a schedule of an exact length. A Trainer of several processes cannot
        lease yet (``Peer.leases`` says so when it joins)."""
        return _SamplerOnJoin(self, num_samples, seed)

    # -- the Trainer's events ---------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any,
    ) -> None:
        """Join the swarm: the Trainer's model and optimizer exist from here on (its scheduler too)."""
        group = _process_group(args)
        if model is None:
            raise GossipError("GossipCallback.on_train_begin got no model: is this a transformers Trainer?")
        if self._open:  # an earlier train() raised without a `with` or close(): that member is stale
            log.warning("closing the peer of an earlier train() that did not end")
            self.close()
        self.final_report = None
        self.peer = Peer(model, join=self.join, optimizer=optimizer, group=group, **self._peer_kwargs)
        self._open = True
        # The samples one optimizer step trains on: the Trainer's total batch, over all its processes.
        self._samples_per_step = args.train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
        if state.global_step > 0 and self.peer.steps == 0:  # resumed from a checkpoint, no step from a donor
            self.peer.resume_at(state.global_step)
        if self.wait_for_peers:
            self.peer.wait_for_peers(self.wait_for_peers, timeout=self.wait_timeout)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        """After each optimizer step: the peer's safe point; stop training when the swarm was asked to."""
        peer = self._live_peer()
        peer.step(samples_seen=state.global_step * self._samples_per_step)
        if peer.agree(peer.finish_requested):  # rank 0's word on every rank: they stop at the same step
            control.should_training_stop = True
        return control

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        logs: dict[str, Any] | None = None, **kwargs: Any,
    ) -> None:
        """The training loss the Trainer logs (every ``logging_steps``), for ``gossiptrain status``."""
        if self._open and self.peer is not None and logs:
            self.peer.report(loss=_number(logs.get("loss")))

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        metrics: dict[str, Any] | None = None, **kwargs: Any,
    ) -> None:
        """``eval_loss`` and ``eval_accuracy`` (a ``compute_metrics`` that returns ``accuracy``), when present."""
        if self._open and self.peer is not None and metrics:
            self.peer.report(
                test_loss=_number(metrics.get("eval_loss")), test_acc=_number(metrics.get("eval_accuracy"))
            )

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """The final phase (consensus with the others, maybe the merged model), then leave."""
        if not self._open:
            return
        peer = self.peer
        assert peer is not None
        try:
            reason = "stop" if peer.finish_requested else "budget"
            self.final_report = peer.finish(reason, final_model=self.final_model)
        finally:
            self.close()

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Leave the swarm now, without the final phase. Idempotent; ``peer`` stays readable."""
        if self._open and self.peer is not None:
            self._open = False
            self.peer.close()

    def __enter__(self) -> "GossipCallback":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _live_peer(self) -> Peer:
        if not self._open or self.peer is None:
            raise GossipError("GossipCallback has no live peer: it joins in on_train_begin (is it in the Trainer's callbacks?)")
        return self.peer


class _SamplerOnJoin(torch.utils.data.Sampler[int]):
    """``GossipCallback.sampler``: the peer's ``LeasedSampler``, built at the first pass (the peer joins in
    ``on_train_begin``, after the Trainer built its data loader and before it reads a batch)."""

    def __init__(self, callback: GossipCallback, num_samples: int, seed: int | None) -> None:
        if num_samples < 1:
            raise ConfigError(f"GossipCallback.sampler: a dataset of {num_samples} samples has nothing to lease")
        self.callback, self.num_samples, self.seed = callback, num_samples, seed
        self._inner: Any = None
        self._of: Peer | None = None  # the peer it was built for (a second train() joins again)

    def __len__(self) -> int:
        if self._inner is not None:
            return len(self._inner)
        return max(1, self.num_samples // max(1, self.callback.wait_for_peers or 1))

    def __iter__(self) -> Any:
        peer = self.callback._live_peer()
        if self._inner is None or self._of is not peer:
            self._inner, self._of = peer.sampler(self.num_samples, seed=self.seed), peer
        return iter(self._inner)


def _process_group(args: TrainingArguments) -> Any:
    """The Trainer's process group when it runs several processes (None: one), initialised by then."""
    if getattr(args, "world_size", 1) <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"GossipCallback: args.world_size is {args.world_size} but torch.distributed is not initialised: "
            "start the Trainer with torchrun (or accelerate launch)"
        )
    return dist.group.WORLD


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
