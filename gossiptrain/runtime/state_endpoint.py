"""The state-transfer driver: runs the sans-IO ``Fetcher`` and ``Donor`` in real time.

The protocol itself (events, actions, the two state machines, the wire
bodies) is ``gossiptrain.protocol.state_transfer``; this module gives it what a
state machine cannot have: the node's event loop and clock, wire
``Message``s turned into its events (``StateEndpoint.on_message``), a worker
thread for hashing snapshots, and the trainer's safe point.

``StateEndpoint`` is the glue ``PeerNode`` uses, in a real process and in the
simulator: it answers ``sreq`` as a donor, routes ``srep``/``snak`` to a
running download, and ``download`` drives a ``Fetcher`` on the node's loop.
``catch_up`` downloads and decodes a model's (and optimizer's) state;
``aside_state_dict`` fits an optimizer state downloaded before its optimizer
was known to the one found later.
``SnapshotHook`` runs at the trainer's safe point and hands the node a copy
of the state when a session waits for one.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from gossiptrain.config import RunConfig
from gossiptrain.errors import GossipError
from gossiptrain.net.kinds import SACK, SREP, SREQ
from gossiptrain.net.wire import Message
from gossiptrain.protocol.state_transfer import TransferResult
from gossiptrain.protocol.state_transfer.donor import Donor, Expire, SnapshotTaken
from gossiptrain.protocol.state_transfer.fetcher import Fetcher, FetchEvent, TransferStats, Unreachable, Wakeup
from gossiptrain.protocol.state_transfer.messages import (
    CLOSE,
    Accepted,
    Chunk,
    ChunkRequest,
    Refusal,
    Reply,
    RequestChunk,
)
from gossiptrain.runtime.clock import Clock
from gossiptrain.state.optimizer_state import (
    OptimizerTemplate,
    fitted_state_dict,
    optimizer_template,
    optimizer_tensors,
    parameter_names,
)
from gossiptrain.state.snapshot import (
    Entry,
    Snapshot,
    decode_state,
    entries_of,
    flatten,
    layout_of,
    meta_like,
    state_nbytes,
    state_tensors,
    table_layout,
    wire_table,
)

log = logging.getLogger(__name__)

__all__ = ["SnapshotHook", "StateCopy", "StateEndpoint", "aside_state_dict", "catch_up"]


class StateEndpoint:
    """``PeerNode``'s side of state transfer, on the node's event loop.

    ``send(addr, kind, body, tensors) -> bool`` and ``address_of(member)`` are
    the node's. ``offload`` hashes snapshots in a worker thread (a real peer:
    neither its training nor its network side waits for the hashing); the
    simulator hashes inline, which keeps its runs deterministic.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        send: Callable[[str, str, dict[str, Any], dict[str, torch.Tensor]], bool],
        address_of: Callable[[str], str | None],
        clock: Clock,
        latency: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.config = config.state
        self.donor = Donor(config.state, config.limits)
        self.transfer = TransferStats()
        self.offload = False
        self.fetcher: Fetcher | None = None  # the download running now, if any
        self._send = send
        self._address_of = address_of
        self._clock = clock
        self._latency = latency  # the link's round trip of small messages lately (None: unknown)
        self._inbox: asyncio.Queue[FetchEvent] | None = None
        self._snapshots: asyncio.Queue[StateCopy] = asyncio.Queue(maxsize=1)

    def stats(self) -> dict[str, Any]:
        return {**self.transfer.to_dict(), **self.donor.stats.to_dict()}

    def mark_ready(self) -> None:
        """Our state is worth giving from now on (after our own download, or when there was none)."""
        self.donor.ready = True

    # -- messages (the node's receive loop) --------------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Handle an sreq, srep, sack or snak; ProtocolError if it is malformed."""
        if msg.kind == SREQ:
            req = ChunkRequest.from_body(msg.sender, msg.addr, msg.body)
            # Answer a member at the address our membership knows (as exchanges do), a stranger where it says.
            req = replace(req, addr=self._address_of(req.sender) or req.addr)
            self._execute(self.donor.handle(req, self._clock.now()))
            return
        inbox = self._inbox
        if inbox is None:  # no download running: not even worth parsing (a manifest may list 65,536 hashes)
            self.transfer.state_stale += 1
            return
        event: FetchEvent = (
            Chunk.from_body(msg.sender, msg.body, msg.tensors) if msg.kind == SREP
            else Accepted.from_body(msg.sender, msg.body) if msg.kind == SACK
            else Refusal.from_body(msg.sender, msg.body)
        )
        try:
            inbox.put_nowait(event)
        except asyncio.QueueFull:  # the download is behind: it asks again or moves on after its timeout
            self.transfer.state_stale += 1

    def tick(self, now: float) -> None:
        """Expire idle donor sessions (the node's heartbeat calls this)."""
        self._execute(self.donor.handle(Expire(), now))

    def _execute(self, replies: list[Reply]) -> None:
        for r in replies:
            self._send(r.addr, r.kind, r.body, r.tensors)

    # -- snapshots (taken on the trainer thread, see SnapshotHook) ---------------------------

    def offer_snapshot(self, copy: "StateCopy") -> None:
        """A copy of the state for sessions waiting since ``copy.serial`` (call on the node's loop)."""
        if not self.offload:
            self._snapshot_taken(copy, *self._build(copy, self.donor.needs(copy.serial)))
            return
        if self._snapshots.full():  # a newer copy replaces one not yet hashed: it serves the same sessions and more
            self._snapshots.get_nowait()
        self._snapshots.put_nowait(copy)

    async def run(self) -> None:
        """Hash offloaded snapshots in a worker thread (a background task of the node)."""
        while True:
            copy = await self._snapshots.get()
            needs = self.donor.needs(copy.serial)  # here, on the loop that changes the sessions
            snaps = await asyncio.to_thread(self._build, copy, needs)
            self._snapshot_taken(copy, *snaps)

    def _build(self, copy: "StateCopy", needs: tuple[bool, bool]) -> tuple[Snapshot | None, Snapshot | None]:
        """The snapshots the waiting sessions want (``Donor.needs``): the model's state, and with the optimizer's."""
        plain, full = needs
        chunk = self.config.chunk_bytes
        model = copy.tensors[: copy.model_entries]
        with_optimizer = None
        if full and copy.model_entries < len(copy.tensors):
            table = wire_table(copy.tensors)
            layout = table_layout(copy.tensors)
            with_optimizer = Snapshot.build(
                copy.data, step=copy.step, layout=layout, chunk_bytes=chunk, tensors=table, samples=copy.samples,
                scalars=copy.scalars,
            )
        snapshot = None
        if plain or with_optimizer is None:
            data = copy.data[: copy.model_bytes]
            snapshot = Snapshot.build(
                data, step=copy.step, layout=table_layout(model), chunk_bytes=chunk, tensors=wire_table(model),
                samples=copy.samples,
            )
        return snapshot, with_optimizer

    def _snapshot_taken(self, copy: "StateCopy", snapshot: Snapshot | None, with_optimizer: Snapshot | None) -> None:
        base = snapshot or with_optimizer
        assert base is not None
        self._execute(self.donor.handle(SnapshotTaken(base, copy.serial, with_optimizer), self._clock.now()))

    # -- downloading -------------------------------------------------------------------------

    async def download(self, fetcher: Fetcher, members: Callable[[], Sequence[str]]) -> TransferResult:
        """Drive ``fetcher`` until it has the state or gives up; one download at a time."""
        if self._inbox is not None:
            raise GossipError("a state download is already running")
        inbox = self._inbox = asyncio.Queue(maxsize=4 * self.config.window + 4)
        self.transfer = fetcher.stats
        self.fetcher = fetcher
        clock = self._clock
        try:
            events: list[FetchEvent] = [Wakeup(members(), self._latency())]
            while True:
                while events:
                    for req in fetcher.handle(events.pop(0), clock.now()):
                        if not self._request(req) and req.index != CLOSE:
                            events.append(Unreachable(req.to, req.sid))
                if fetcher.result is not None:
                    return fetcher.result
                now = clock.now()
                if not inbox.empty():
                    events.append(inbox.get_nowait())
                    continue
                try:
                    events.append(await asyncio.wait_for(inbox.get(), timeout=max(0.0, fetcher.wakeup(now) - now)))
                except TimeoutError:
                    events.append(Wakeup(members(), self._latency()))
        except asyncio.CancelledError:  # our peer is leaving (Ctrl+C during its download): free the donor's slot
            for req in fetcher.abandon(clock.now(), "cancelled: this peer is leaving"):
                self._request(req)
            raise
        finally:
            self._inbox = None
            self.fetcher = None

    def _request(self, req: RequestChunk) -> bool:
        addr = self._address_of(req.to)
        body = {"sid": req.sid, "index": req.index, "manifest": req.manifest}
        if req.optim:
            body["optim"] = True
        return addr is not None and self._send(addr, SREQ, body, {})


async def catch_up(
    endpoint: StateEndpoint,
    model: torch.nn.Module,
    *,
    me: str,
    members: Callable[[], Sequence[str]],
    rng: random.Random,
    clock: Clock,
    optimizer: torch.optim.Optimizer | None = None,
    keep_optimizer: bool = False,
) -> tuple[TransferResult, list[torch.Tensor] | None]:
    """Download a live member's state for ``model``: the result and the decoded tensors (None if it failed).

    Runs on the node's loop; the caller installs the tensors (``install``) on
    its training thread, and ``result.optimizer_state`` (when not None) into
    ``optimizer`` with ``load_state_dict``. The optimizer state is asked for
    when ``optimizer`` is given and ``state.transfer_optimizer`` is set. With
    ``keep_optimizer`` and no ``optimizer`` (not known yet: ``Peer`` finds it
    at its first step) the donor's optimizer state, whatever it is, comes as
    ``result.optimizer_aside`` (see ``aside_state_dict``). A
    state that cannot be used (non-finite values) is fetched again from other
    donors, within the same bounds.
    """
    live = state_tensors(model)
    model_table = entries_of(model.state_dict(keep_vars=True).items())
    template: OptimizerTemplate | None = None
    if optimizer is not None and endpoint.config.transfer_optimizer:
        made = optimizer_template(model, optimizer)
        if isinstance(made, str):
            log.error("state transfer: cannot take optimizer state (%s): downloading the parameters only", made)
        else:
            template = made
    aside = keep_optimizer and optimizer is None and endpoint.config.transfer_optimizer
    fetcher = Fetcher(
        endpoint.config, me=me, size=state_nbytes(live), layout=layout_of(model), rng=rng, now=clock.now(),
        tensors=model_table, optimizer=template.entries if template is not None else None, any_optimizer=aside,
    )
    while True:
        result = await endpoint.download(fetcher, members)
        if not result.ok:
            s = fetcher.stats
            # Refused by everyone (a swarm starting: nobody trains yet) is normal; losing donors is worth a warning.
            only_refused = s.state_chunks_received == s.state_timeouts == s.state_checksum_failures == 0
            level = logging.INFO if only_refused else logging.WARNING
            log.log(level, "no state downloaded (%s): training from our own initial weights", result.reason)
            return result, None
        assert result.data is not None
        # Kept aside: the optimizer tensors the donor listed (the fetcher took its table), checked at binding.
        kept = result.tensors[len(live):] if result.optimizer and aside and result.tensors is not None else ()
        like = live + (list(template.like) if result.optimizer and template is not None else [])
        like += meta_like(kept)
        decoded = decode_state(like, result.data)
        problem = decoded if isinstance(decoded, str) else None
        optim_state: dict[str, Any] | None = None
        if isinstance(decoded, list) and result.optimizer and template is not None:
            fitted = template.state_dict(decoded[len(live):], result.scalars)
            if isinstance(fitted, str):
                problem = f"its optimizer state: {fitted}"
            else:
                optim_state = fitted
        if problem is None:
            assert isinstance(decoded, list)
            log.info(
                "state transfer: %d bytes from %s in %.3f s (donor step %d, digest %s%s)",
                result.data.numel(), ", ".join(result.donors), result.seconds, result.step, result.digest[:16],
                ", with optimizer state" if optim_state is not None else
                ", with optimizer state for the optimizer yet to step" if kept else "",
            )
            named = tuple((name, t) for (name, _, _), t in zip(kept, decoded[len(live):], strict=True)) if kept else ()
            return replace(result, optimizer_state=optim_state, optimizer_aside=named), decoded[: len(live)]
        fetcher.reject(problem)  # the next download() picks up with other donors


def aside_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, result: TransferResult
) -> dict[str, Any] | str:
    """``optimizer.load_state_dict``'s argument from ``result.optimizer_aside``, or why it does not fit ``optimizer``.

    The state came before ``optimizer`` was known (``catch_up(keep_optimizer=True)``),
    so it is checked now as a download for it would have been: against its
    template, name, dtype and shape of every tensor, and type of every scalar.
    """
    return fitted_state_dict(model, optimizer, result.optimizer_aside, result.scalars)


# -- the donor's safe point --------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StateCopy:
    """What the trainer copied at a safe point for the sessions waiting since request ``serial``."""

    data: torch.Tensor  # (bytes,) uint8: the model's state, then the optimizer's tensors (if any)
    step: int
    serial: int
    tensors: tuple[Entry, ...]  # what ``data`` holds, in order
    model_entries: int  # the first this many of ``tensors`` are the model's state
    model_bytes: int
    samples: int = 0
    scalars: tuple[tuple[str, int | float], ...] = ()


class SnapshotHook:
    """Runs at the trainer's safe point: copies the state when a donor session waits for a snapshot.

    The copy (one memcpy of the state, and of the optimizer's with
    ``state.transfer_optimizer`` and an ``optimizer``) is all the trainer
    pays; ``submit`` hands it to the node's loop (``StateEndpoint.offer_snapshot``),
    where it is hashed and served. ``Donor.wanted`` is written by the loop
    and read here; ``_served`` only here, so no lock is needed.
    """

    def __init__(
        self,
        endpoint: StateEndpoint,
        model: torch.nn.Module,
        submit: Callable[[StateCopy], None],
        clock: Clock,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.clock = clock
        self.tensors = state_tensors(model)
        self.table = entries_of(model.state_dict(keep_vars=True).items())
        self.layout = table_layout(self.table)
        self.submit = submit
        self.optimizer: torch.optim.Optimizer | None = None
        self._names = parameter_names(model)
        self._served = 0
        self._warned = False
        self.give_optimizer(optimizer)

    def give_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Offer ``optimizer``'s state with ours from now on (with ``state.transfer_optimizer``); None: the model's alone.

        Set late where the optimizer is found at its first step (``gossiptrain.runtime.optimizer_finder``).
        """
        self.optimizer = optimizer if self.endpoint.config.transfer_optimizer else None
        self._warned = False

    def __call__(self, step: int, samples: int = 0) -> None:
        """Our safe point after local step ``step``, having trained on ``samples`` samples in all."""
        donor = self.endpoint.donor
        donor.stepped(step, self.clock.now())
        wanted = donor.wanted
        if wanted == self._served:
            return
        self._served = wanted
        tensors, table = list(self.tensors), self.table
        scalars: tuple[tuple[str, int | float], ...] = ()
        if self.optimizer is not None:
            listed = optimizer_tensors(self._names, self.optimizer)
            if isinstance(listed, str):
                if not self._warned:
                    log.warning("state transfer: cannot give our optimizer state: %s", listed)
                    self._warned = True
            else:
                tensors += [t for _, t in listed[0]]
                table = table + entries_of(listed[0])
                scalars = tuple(listed[1])
        data = flatten(tensors)
        model_bytes = state_nbytes(self.tensors)
        self.submit(StateCopy(data, step, wanted, table, len(self.table), model_bytes, samples, scalars))
