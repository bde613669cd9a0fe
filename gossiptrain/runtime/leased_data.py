"""Leased data in a running peer: the lease machine shared by the training thread and the network side.

The lease machine (``gossiptrain.protocol.leases``) is sans-IO and not
thread-safe; a peer's training loop asks it for chunks and reports samples
trained on its own thread, while the peer's event loop merges the tables
other members send and pushes ours. ``LeaseClient`` holds the machine under
one lock (every call is short: no I/O, no waiting under it) and wakes a
trainer that waits for a chunk when a merge may have freed one.

``LeasedSampler`` is what the Python API hands a user's ``DataLoader``
(``Peer.sampler``): the indices of the chunks this peer holds, in order.
``LeasedBatches`` is the CLI peer's and the simulator's form: batches of a
dataset held in memory, samples counted as trained only after the step
that trained them.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from gossiptrain.config import DataConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.leases import ChunkPlan, Leases, LeaseSettings, SendLeases, default_chunks
from gossiptrain.protocol.leases.chunks import MIN_CHUNK_SAMPLES
from gossiptrain.protocol.leases.core import WINDOW_MIN_SECONDS

log = logging.getLogger(__name__)

#: Waits for a chunk before a window too small for the swarm is reported (a newcomer waits a few at its start).
WARN_AFTER_WAITS = 100


def plan_for(samples: int, config: DataConfig, seed: int) -> ChunkPlan:
    """The swarm's chunk plan for a dataset of ``samples``: the same on every member of one run."""
    return ChunkPlan(samples, config.chunks or default_chunks(samples), seed)


def settings_for(config: DataConfig) -> LeaseSettings:
    return LeaseSettings(interval=config.gossip_interval, lease_time=config.lease_time, ahead=config.ahead_seconds,
                         max_held=config.max_held, steal_after=3 * config.gossip_interval)


class LeaseClient:
    """One member's lease machine behind a lock, for the training thread and the network side alike."""

    def __init__(
        self, me: str, plan: ChunkPlan, config: DataConfig, *, live: Callable[[], Sequence[str]], now: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.plan = plan
        self.now = now
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.machine = Leases(me, plan, live=live, rng=rng, settings=settings_for(config))
        self.refused = 0  # tables from members with another plan (another dataset size or chunk count)
        self.warned = False  # that the window holds too little of the swarm's work (_check_window)

    # -- the training side ------------------------------------------------------------------------

    def holding(self, samples: int = 0) -> list[tuple[int, int]]:
        """Every chunk we hold, in order, with what of each was trained (``Leases.holding``)."""
        with self._lock:
            got = self.machine.holding(self.now(), samples)
            if not got:
                self._check_window()
            return got

    def wait_chunk(self, timeout: float, *, trained: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """(chunk, samples of it trained already) to train next, waiting up to ``timeout`` seconds (real time)
        for a merge to free one; None: nothing to claim yet. ``trained``: (chunk, samples) to count as trained
        first, under the same lock (a sampler's last report of the chunk it finished)."""
        with self._lock:
            if trained is not None:
                self.machine.trained(trained[0], trained[1], self.now())
            got = self.machine.next_chunk(self.now())
            if got is None and timeout > 0:
                self._check_window()
                self._changed.wait(timeout)
                got = self.machine.next_chunk(self.now())
            return got

    def _check_window(self) -> None:
        """We wait for a chunk: say once why, where the cause is the data's cut (see WINDOW_MIN_SECONDS)."""
        held = self.machine.window_seconds(self.now())
        if self.warned or held is None or held >= WINDOW_MIN_SECONDS or self.machine.stats.lease_waits < WARN_AFTER_WAITS:
            return
        self.warned = True
        log.warning(
            "leased data: the swarm trains its window of %d chunks (%.0f epochs of %d samples) in %.2f s, faster than "
            "its lease tables spread, so peers wait for chunks (%d waits so far). Lease fewer, larger chunks "
            "(data.chunks, now %d an epoch) or a larger dataset.",
            self.machine.table.window, self.machine.table.window / self.plan.chunks, self.plan.samples, held,
            self.machine.stats.lease_waits, self.plan.chunks,
        )

    def trained(self, g: int, samples: int) -> None:
        with self._lock:
            self.machine.trained(g, samples, self.now())

    def stats(self) -> dict[str, Any]:
        """Counters, the swarm's epoch and this epoch's chunks done (``Peer.stats()``, metrics, status)."""
        with self._lock:
            done, chunks = self.machine.epoch_progress()
            return {**self.machine.stats.to_dict(), "lease_epoch": self.machine.epoch, "lease_epoch_chunks_done": done,
                    "lease_epoch_chunks": chunks, "lease_chunks_held": len(self.machine.held)}

    def position(self) -> dict[str, Any]:
        """What a checkpoint keeps: the chunks we hold and what of each we trained (``resume`` takes it back)."""
        with self._lock:
            return {"plan": self.plan.to_wire(), "held": [[h.g, h.trained] for h in self.machine.held], "me": self.machine.me}

    def resume(self, position: dict[str, Any]) -> bool:
        """Take back a checkpoint's claims (``position``) if it is of this plan; whether it was."""
        if position.get("plan") != self.plan.to_wire():
            return False
        with self._lock:
            self.machine.resume([(g, t) for g, t in position["held"]], position.get("me", ""))
        return True

    # -- the network side -------------------------------------------------------------------------

    def next_timer(self) -> float:
        with self._lock:
            return self.machine.next_timer()

    def tick(self) -> list[SendLeases]:
        with self._lock:
            return self.machine.tick(self.now())

    def handle(self, sender: str, body: Any) -> list[SendLeases]:
        """A member's lease message: ``{"plan": [...], "table": {...}, "reply": bool}``; ProtocolError if malformed."""
        if not isinstance(body, dict) or not isinstance(body.get("reply", False), bool):
            raise ProtocolError("a lease message is a map with a bool reply")
        if body.get("plan") != self.plan.to_wire():
            self.refused += 1  # another run's data (or a member that leases another dataset): not ours to merge
            return []
        with self._lock:
            out = self.machine.handle(sender, body.get("table"), self.now(), reply=body.get("reply", False))
            self._changed.notify_all()
            return out

    def message(self, action: SendLeases) -> dict[str, Any]:
        return {"plan": self.plan.to_wire(), "table": action.body, "reply": action.reply}


#: Samples of a chunk a sampler yields before it counts them as trained (a lock and a table update each time,
#: not per sample); the rest of a chunk is counted with the claim of the next: two locks a chunk of the default
#: cut of a small dataset (MIN_CHUNK_SAMPLES to twice that), one for smaller chunks.
REPORT_EVERY = MIN_CHUNK_SAMPLES


class LeasedSampler(torch.utils.data.Sampler[int]):
    """The dataset indices of the chunks this peer holds, chunk after chunk: a ``DataLoader``'s ``sampler``.

    One pass (``iter``) ends when the swarm has finished the epoch that was
    current when the pass began, so ``for epoch in ...: for batch in
    loader`` reads as it does with static data. A sample counts as trained
    when it is yielded (counted REPORT_EVERY at a time): a ``DataLoader`` that
    prefetches holds a few batches the swarm already counts
    (``prefetch_factor`` x ``num_workers``), lost if the peer dies with them. ``len`` is this peer's share of an epoch if the
    live members split it evenly: an estimate (a faster peer trains more).
    """

    def __init__(self, client: LeaseClient, members: Callable[[], int], *, wait: float = 0.05) -> None:
        self.client = client
        self.members = members
        self.wait = wait

    def __len__(self) -> int:
        return max(1, self.client.plan.samples // max(1, self.members()))

    def __iter__(self) -> Iterator[int]:
        client = self.client
        epoch = client.machine.epoch
        g, given = -1, 0  # the chunk being given out, and how many of its samples were given and not yet counted
        try:
            while client.machine.epoch <= epoch:
                got = client.wait_chunk(self.wait, trained=(g, given) if given else None)
                given = 0
                if got is None or client.machine.epoch > epoch:  # (that report may have finished the epoch)
                    continue
                g, done = got
                for index in client.plan.indices(g)[done:]:
                    given += 1  # before the yield: a loop that stops here has taken this one
                    yield index
                    if given == REPORT_EVERY:
                        client.trained(g, given)
                        given = 0
        finally:  # the pass ended, or the loop that read it stopped (break, an error, the generator closed)
            if given:
                client.trained(g, given)


class LeasedBatches:
    """Batches of ``inputs``/``targets`` (the whole dataset, in the plan's index order) from the chunks we hold.

    ``next()`` gives the next batch, or None when no chunk can be claimed
    now; ``commit()`` after the step that trained it counts its samples.
    """

    def __init__(self, client: LeaseClient, inputs: Tensor, targets: Tensor, batch_size: int) -> None:
        if len(targets) != client.plan.samples:
            raise ValueError(f"the leased dataset holds {len(targets)} samples, its plan {client.plan.samples}")
        self.client = client
        self.inputs, self.targets = inputs, targets  # (N, ...), (N,)
        self.batch_size = batch_size
        self._pending: list[tuple[int, int]] = []  # (chunk, samples) of the batch given out and not committed yet

    def next(self) -> tuple[Tensor, Tensor] | None:
        self._pending = []
        picked: list[int] = []
        for g, done in self.client.holding(self.batch_size):
            take = self.client.plan.indices(g)[done : done + self.batch_size - len(picked)]
            picked += take
            self._pending.append((g, len(take)))
            if len(picked) == self.batch_size:
                break
        if not picked:
            return None
        index = torch.tensor(picked)
        return self.inputs[index], self.targets[index]  # (B, ...), (B,)

    def commit(self) -> None:
        for g, n in self._pending:
            self.client.trained(g, n)
        self._pending = []
