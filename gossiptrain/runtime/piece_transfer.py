"""A split peer's state transfer, rank by rank (issue 48): every rank a donor of its piece, a newcomer's ranks
downloading theirs.

State transfer runs rank by rank with the protocol whole-model peers
use (``gossiptrain.protocol.state_transfer``) over each rank's own socket:
every rank is a donor of its piece (a copy taken at the safe point after
a newcomer's session opened, hashed on the network thread, served in
``state.chunk_bytes`` chunks), and a newcomer's rank downloads its piece
from the same rank of the donors its leader met (``download``). So a
piece of any size travels in bounded messages, every chunk is checked
against the donor's manifest, and a donor that stops answering costs its
timeout and no chunk already verified: the next donor is asked for the
rest. The pieces of one download come from the safe points where each
donor rank's session opened: one safe point, or a few steps apart where
the requests crossed a step; a resumed download joins two donors'
snapshots, as a whole-model peer's does (gossip keeps them close). With
``state.transfer_optimizer`` a rank's stream carries its optimizer's state
after its piece (``piece_optimizer_state``: its shard's, at local shapes),
kept on a newcomer until its optimizer is bound (``bind_optimizer``).

``SplitGroup`` owns one ``PieceTransfer`` per rank: it calls ``donate`` at
every local step's safe point and ``download`` once, on every rank, before
the first exchange; the rank's ``PieceLink`` routes the transfer's messages
to ``endpoint``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import torch

from gossiptrain.config import Limits, RunConfig, StateConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.piece_exchange import RankExchanges
from gossiptrain.protocol.state_transfer.fetcher import Fetcher
from gossiptrain.runtime import piece_optimizer_state
from gossiptrain.runtime.clock import REAL_CLOCK
from gossiptrain.runtime.loop_thread import LoopThread
from gossiptrain.runtime.peer_group import PeerGroup
from gossiptrain.runtime.piece_link import PieceLink
from gossiptrain.runtime.state_endpoint import StateCopy, StateEndpoint
from gossiptrain.state.snapshot import decode_state, entries_of, flatten, meta_like, state_nbytes, table_layout

log = logging.getLogger(__name__)

#: Donors a newcomer's leader meets (and every rank may download from), at most.
DONORS = 3


class PieceTransfer:
    """One rank's side of its split peer's state transfer (see the module docstring); ``download`` is a collective."""

    def __init__(
        self, group: PeerGroup, exchanges: RankExchanges, model: torch.nn.Module, *, me: str, loop: LoopThread,
        lock: threading.RLock, limits: Limits, state: StateConfig | None, rng: random.Random,
    ) -> None:
        self.group = group
        self.rank = group.rank
        self.exchanges = exchanges
        self.model = model
        self.me = me
        self.loop = loop
        self.lock = lock  # the split group's: the training side's safe point and the link's network side
        self._rng = rng  # the leader's: the seed every rank picks its first donor by
        # In real time: donor sessions and downloads run on the real network (the link's loop)
        self.endpoint = StateEndpoint(RunConfig(limits=limits, state=state or StateConfig()), send=self._send,
                                      address_of=self._donor_address, clock=REAL_CLOCK)
        self.link: PieceLink | None = None  # the rank's link, once made (it routes our messages to ``endpoint``)
        self._donor_addresses: dict[str, str] = {}  # while downloading: each donor's rank of our index
        self.downloaded_step = 0  # the donor's step at the pieces downloaded (``download``)
        # This rank's optimizer (``bind_optimizer``), whose state newcomers get with state.transfer_optimizer, and a
        # donor's state downloaded before it was bound (it is then loaded into it)
        self.optimizer: torch.optim.Optimizer | None = None
        self._optimizer_aside: tuple[piece_optimizer_state.Named, piece_optimizer_state.Scalars] | None = None
        # How this rank's download went for its optimizer state, as a whole-model peer's transfer_summary says it:
        # none, waiting (for the optimizer to be bound), installed, refused (it did not fit the optimizer)
        self.optimizer_transfer = "none"
        self._warned_optimizer = False
        self._snapshot_asked = 0  # the last of the donor's ``wanted`` serials a copy of our piece was taken for

    def download(self, next_donor: Callable[[], Any] | None, timeout: float,
                 installed: Callable[[], None] | None = None) -> str | None:
        """A newcomer's state download, on every rank (a collective; only the leader's ``next_donor`` counts: the
        next member to download from, None when there is none). The leader meets up to ``DONORS`` donors; every
        rank then downloads its piece from the same rank of one of them, in verified chunks, as a whole-model peer
        downloads its state (``Fetcher``: a donor that stops answering or refuses is left for another, and the
        download resumes from the chunks already verified; all ranks start with the same donor). Installed on every
        rank or on none, within ``timeout`` seconds in all. Before the first exchange. Who gave the chunks (",
        "-joined; ``downloaded_step``: the leader's donor's step then), or None (each rank keeps its own piece).
        ``installed``: called once the piece is in (the split group's methods start mid-run)."""
        deadline = time.monotonic() + timeout
        donors: list[list[Any]] = []
        while self.rank == 0 and next_donor is not None and len(donors) < DONORS and time.monotonic() < deadline:
            donor = next_donor()
            if donor is None:
                break
            donors.append([donor.id, list(donor.addresses)])
        plan = self.group.all_json([self._rng.getrandbits(62), donors] if donors else None)[0]
        try:
            if plan is None:
                return None
            seed, donors = int(plan[0]), plan[1]
            result = self._fetch(random.Random(seed), {str(d): str(where[self.rank]) for d, where in donors}, deadline)
            verdicts = self.group.all_json(None if result is None else [result[1], result[2]])
            if not all(verdicts):
                if self.rank == 0:
                    log.warning("state download: not every rank's piece came, or fits: each keeps its own")
                return None
            with self.lock:
                assert result is not None
                self.exchanges.install(result[0])
            if installed is not None:
                installed()
            if result[3] is not None:  # the donor rank's optimizer state: loaded now, or once the optimizer is bound
                self._optimizer_aside = result[3]
                self.optimizer_transfer = "waiting"
                if self.optimizer is not None:
                    self._load_optimizer_state()
            self.downloaded_step = int(verdicts[0][0])
            return ", ".join(sorted({d for v in verdicts for d in v[1]}))
        finally:
            self.endpoint.mark_ready()  # our piece is worth giving from now on

    def _fetch(self, rng: random.Random, donors: dict[str, str], deadline: float
               ) -> tuple[dict[str, torch.Tensor], int, list[str], tuple[Any, Any] | None] | None:
        """This rank's piece downloaded from the same rank of ``donors`` (id -> that rank's address) before
        ``deadline``: (the piece by name, the donor's step, who gave its chunks, the donor rank's optimizer state
        where state.transfer_optimizer asked for it and it came: named tensors and scalars), or None (logged)."""
        with self.lock:
            piece = self.exchanges.snapshot()
        like = list(piece.values())
        table = entries_of(piece.items())
        seconds = max(0.001, deadline - time.monotonic())
        asked = self.endpoint.config.transfer_optimizer
        made = piece_optimizer_state.template(self.model, self.optimizer) if asked and self.optimizer else None
        if isinstance(made, str):
            log.warning("state download: rank %d takes no optimizer state (%s)", self.rank, made)
            made = None
        fetcher = Fetcher(replace(self.endpoint.config, max_seconds=seconds), me=self.me, size=state_nbytes(like),
                          layout=table_layout(table), rng=rng, now=REAL_CLOCK.now(), tensors=table,
                          optimizer=made.entries if made is not None else None,
                          any_optimizer=asked and self.optimizer is None)
        self._donor_addresses = donors
        try:
            while True:
                result = self.loop.run(self.endpoint.download(fetcher, lambda: list(donors)), timeout=seconds + 10)
                if not result.ok:
                    log.warning("state download: rank %d's piece: %s", self.rank, result.reason)
                    return None
                assert result.data is not None
                # The optimizer's tensors, after the piece's: as the template says, or as the donor listed them
                theirs = list(result.tensors[len(like):]) if result.optimizer and result.tensors is not None else []
                extra: list[torch.Tensor] = []
                if result.optimizer:
                    extra = list(made.like) if made is not None else meta_like(theirs)
                values = decode_state(like + extra, result.data)
                if isinstance(values, str):
                    fetcher.reject(values)  # fetched again from other donors, within the same bounds
                    continue
                with self.lock:
                    got = dict(zip(piece, values))
                    self.exchanges.fits(got)
                names = [name for name, _, _ in (made.entries if made is not None else theirs)]
                state = (list(zip(names, values[len(like):], strict=True)), result.scalars) if result.optimizer else None
                return got, result.step, list(result.donors), state
        except (ProtocolError, ValueError, TimeoutError) as e:
            log.warning("state download: rank %d's piece does not go in: %s", self.rank, e)
            return None
        finally:
            self._donor_addresses = {}

    def _donor_address(self, member: str) -> str | None:
        """Where a donor's rank of our index listens, while we download (the transfer's ``address_of``)."""
        return self._donor_addresses.get(member)

    def _send(self, addr: str, kind: str, body: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        return self.link is not None and self.link.send(addr, kind, body, tensors)

    def donate(self, step: int, local_steps: int) -> None:
        """Donor, at every local step's safe point (``local_steps`` of them so far): our piece as it now is, copied
        for the newcomers' sessions that wait for one (``Donor.wanted``; hashed and served on the network thread).
        ``step``: the group's count (the leader's), the manifest's."""
        assert self.link is not None
        donor = self.endpoint.donor
        now = REAL_CLOCK.now()
        donor.stepped(local_steps, now)
        if donor.sessions:
            self.link.expire(now)
        wanted = donor.wanted
        if wanted == self._snapshot_asked:
            return
        self._snapshot_asked = wanted
        with self.lock:
            piece = self.exchanges.snapshot()
        tensors, table, scalars = list(piece.values()), entries_of(piece.items()), ()
        model_bytes = state_nbytes(tensors)
        if self.endpoint.config.transfer_optimizer and self.optimizer is not None:  # its state after the piece's
            listed = piece_optimizer_state.listed(self.model, self.optimizer)
            if isinstance(listed, str):
                if not self._warned_optimizer:
                    log.warning("state transfer: rank %d cannot give its optimizer state: %s", self.rank, listed)
                    self._warned_optimizer = True
            else:
                tensors += [t for _, t in listed[0]]
                table, scalars = table + entries_of(listed[0]), listed[1]
        with self.lock:
            data = flatten(tensors)
        self.link.offer(StateCopy(data, step, wanted, table, len(piece), model_bytes, scalars=scalars))

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """This rank's optimizer (given, or found at its first step): newcomers get its state (state.transfer_optimizer),
        and a donor's state downloaded before it was known is loaded into it now."""
        self.optimizer = optimizer
        if self._optimizer_aside is not None:
            self._load_optimizer_state()

    def _load_optimizer_state(self) -> None:
        assert self.optimizer is not None and self._optimizer_aside is not None
        named, scalars = self._optimizer_aside
        self._optimizer_aside = None
        problem = piece_optimizer_state.load(self.model, self.optimizer, named, scalars)
        if problem is None:
            self.optimizer_transfer = "installed"
            log.info("state transfer: rank %d took the donor rank's optimizer state", self.rank)
        else:
            self.optimizer_transfer = "refused"
            log.warning("state transfer: rank %d's optimizer does not take the donor's state (%s): it starts afresh",
                        self.rank, problem)
