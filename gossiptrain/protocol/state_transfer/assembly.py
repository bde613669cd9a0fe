"""What a newcomer downloads: the state it must be, and the chunks of it verified so far.

The first answer of a session carries the snapshot's manifest: size,
layout, the donor's step, the SHA-256 of every chunk and ``digest``, the
SHA-256 over those chunk hashes (a hash list). A manifest that does not
describe our model's state (or does not match its own digest) is refused;
each chunk is checked against its donor's manifest before it is kept, and
at the end the assembled bytes are hashed again, chunk by chunk, against
the manifests. A donor whose data fails a check is not asked again; a state
that fails the final check is discarded and fetched again from another
donor.

Chunk ``i`` covers the same bytes at every donor (the chunk size is part of
the run's configuration and the layout must match), which is what makes a
download resumable. A download resumed with another donor joins parts of two
snapshots, each verified against its own donor's manifest; gossip keeps the
members close to each other, so the joined state is as good a start as
either.

Optimizer state (``state.transfer_optimizer``): a newcomer that has its
optimizer at hand asks for it too, and the donor appends its optimizer's
tensors to the same stream (see ``donor``). The newcomer knows what to
expect from a throwaway copy of its own optimizer stepped once on zero
gradients (``optimizer_template``): a donor whose optimizer state differs in
any name, shape or dtype (another optimizer, or none) is named in an error
and the download starts over for the parameters alone. Nothing is
unpickled: the state is raw tensor bytes checked against that template, and
scalars are checked ints or floats. A newcomer whose optimizer is not known
yet (``Peer`` finds it at its first step,
``gossiptrain.runtime.optimizer_finder``) asks for whatever optimizer state
the first donor holds (``Fetcher(any_optimizer=True)``), up to
``ANY_OPTIMIZER_SHARE`` times the model's bytes: that donor's table becomes
the one later donors must match, and the state waits, decoded, for the
optimizer to be found and checked against its template then.

The manifest lists the stream's tensors (name, dtype, shape) and the
donor's training samples seen, so that a tool that has no model of its own
(``gossiptrain export``, see ``gossiptrain.state.merged_model``) can download a
member's state, weight it and write it under its names: it takes whatever
the first donor describes (``size=None``), up to ``max_bytes``.

All of this is apart from the ``Fetcher``, which chooses donors and paces
requests: it hears only whether to go on, leave a donor, or ban it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gossiptrain.state.snapshot import (
    OPTIMIZER_PREFIX,
    Entry,
    Manifest,
    chunk_count,
    entry_nbytes,
    first_difference,
    hash_list_digest,
    sha256_hex,
    table_layout,
)

log = logging.getLogger(__name__)

#: An optimizer state taken before our optimizer is known may have at most this many times the model's bytes
#: (Adam's is about 2, with amsgrad 3, plus its step counters): a bound on what an unknown donor may make us fetch.
ANY_OPTIMIZER_SHARE = 4


@dataclass(frozen=True)
class Misfit:
    """Why a donor's manifest will not do: the ``Fetcher`` leaves the donor for ``why``."""

    why: str
    ban: bool = False  # not asked again in this download (its state is not ours); else its parameters will do
    corrupt: bool = False  # it failed a SHA-256 check (the Fetcher counts it in state_checksum_failures)


class Assembly:
    """A download's target (``size`` bytes of ``layout``, tables ``tensors``) and the chunks of it kept so far.

    ``optimizer`` and ``any_optimizer`` are the ``Fetcher``'s (see there):
    they make the target the model's state and then the optimizer's, until
    a donor's optimizer state does not fit (``optimizer_problem`` says why)
    and the target goes back to the parameters alone. ``size=None`` (and no
    ``layout``) takes the first donor's description, up to ``max_bytes``.
    """

    def __init__(
        self,
        chunk_bytes: int,
        *,
        size: int | None,
        layout: str | None,
        tensors: tuple[Entry, ...] | None,
        optimizer: tuple[Entry, ...] | None,
        max_bytes: int,
        any_optimizer: bool,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.max_bytes = max_bytes
        self._plain = (size, layout, tensors)  # the parameters-only download (our model's state)
        self.with_optimizer = (optimizer is not None or any_optimizer) and size is not None
        self._any_optimizer = any_optimizer  # until the first manifest: its optimizer table becomes ours
        self.optimizer_problem = ""
        if self.with_optimizer and optimizer is not None:  # any_optimizer: the first donor's table, once it comes
            assert tensors is not None and size is not None
            full = tensors + optimizer
            size, layout, tensors = size + sum(entry_nbytes(e) for e in optimizer), table_layout(full), full
        self.size: int | None = size
        self.layout: str | None = layout
        self.tensors: tuple[Entry, ...] | None = tensors
        self.count = chunk_count(size or 0, chunk_bytes)
        self.data = torch.empty(size or 0, dtype=torch.uint8)  # (size,) the assembled state
        self._kept: list[int | None] = [None] * self.count  # chunk -> sid of the session it was verified against
        self._missing = self.count
        self._manifests: dict[int, tuple[str, Manifest]] = {}  # sid -> (donor, manifest) of chunks kept

    @property
    def missing(self) -> int:
        """Chunks not yet verified and kept."""
        return self._missing

    def first_missing(self) -> int:
        """The first chunk not kept yet: where a new session starts (its answer brings the manifest)."""
        return next(i for i, sid in enumerate(self._kept) if sid is None)

    def to_ask(self, inflight: set[int]) -> list[int]:
        """The chunks still to ask for, in order, but for those asked already (``inflight``)."""
        return [i for i in range(self.count) if self._kept[i] is None and i not in inflight]

    def take_manifest(self, donor: str, m: Manifest | None) -> Misfit | None:
        """The first manifest of a session with ``donor``: None if its chunks will do (the target may change:
        the optimizer table it brings, or the state it describes, is taken), else why not."""
        if self._any_optimizer and m is not None and (why := self._take_optimizer_table(m)):
            self._drop_optimizer(donor, why)
            return Misfit("its optimizer state is not one we take")  # not banned: its parameters will do
        if self.with_optimizer and m is not None and (why := self._optimizer_misfit(m)):
            self._drop_optimizer(donor, why)
            return Misfit("its optimizer state does not fit ours")  # not banned: its parameters will do
        problem = self._manifest_problem(m)
        if problem:
            return Misfit(problem, ban=True)
        assert m is not None  # _manifest_problem said so otherwise
        if hash_list_digest(m.hashes) != m.digest:
            return Misfit("its manifest does not match its digest", ban=True, corrupt=True)
        if self.size is None:
            self._adopt(m)
        return None

    def keep(self, index: int, data: torch.Tensor, sid: int, donor: str, manifest: Manifest) -> bool:
        """Keep chunk ``index`` from session ``sid`` with ``donor``, if it is the chunk ``manifest`` lists;
        False (nothing kept) if its size or SHA-256 is not."""
        assert self.size is not None  # known, or adopted from the manifest (take_manifest)
        lo = index * self.chunk_bytes
        expected = min(self.size, lo + self.chunk_bytes) - lo
        if data.numel() != expected or sha256_hex(data) != manifest.hashes[index]:
            return False
        self.data[lo : lo + expected] = data
        self._kept[index] = sid
        self._manifests[sid] = (donor, manifest)
        self._missing -= 1
        return True

    def verify(self) -> tuple[str, set[str]]:
        """Hash the assembled bytes again against the manifests they were kept under (a bug or bad memory may have
        changed them since): the hash list digest of the state, and the donors whose chunks no longer match."""
        hashes: list[str] = []
        bad: set[str] = set()
        for i, sid in enumerate(self._kept):
            assert sid is not None
            donor, manifest = self._manifests[sid]
            h = sha256_hex(self.data[i * self.chunk_bytes : (i + 1) * self.chunk_bytes])
            if h != manifest.hashes[i]:
                bad.add(donor)
            hashes.append(h)
        sids = set(self._kept)
        digest = hash_list_digest(hashes)
        if len(sids) == 1 and digest != self._manifests[next(iter(sids))][1].digest:
            bad.add(self._manifests[next(iter(sids))][0])
        return digest, bad

    def donors(self) -> tuple[str, ...]:
        """Who supplied the chunks kept, in chunk order."""
        return tuple(dict.fromkeys(self._manifests[sid][0] for sid in self._kept))

    def restart(self) -> None:
        """Drop every chunk kept: the state is fetched again from the start."""
        self._kept = [None] * self.count
        self._missing = self.count
        self._manifests.clear()

    def _manifest_problem(self, m: Manifest | None) -> str | None:
        """Why ``m`` does not describe the state we download (or is missing); None if it does."""
        if m is None:
            return "answered without the manifest it was asked for"
        if self.size is None:
            if m.tensors is None:
                return "its manifest does not list its tensors"
            if m.size > self.max_bytes:
                return f"its state has {m.size} bytes, more than the {self.max_bytes} we take"
        elif m.size != self.size or m.layout != self.layout:
            return f"its state ({m.size} bytes, layout {m.layout}) is not our model's ({self.size} bytes, layout {self.layout})"
        if m.chunk_bytes != self.chunk_bytes:
            return f"it chunks by {m.chunk_bytes} bytes, we by state.chunk_bytes={self.chunk_bytes}"
        return None

    def _optimizer_misfit(self, m: Manifest) -> str | None:
        """Why ``m`` (of a donor whose parameters fit ours) has no optimizer state we can use; None if it has."""
        if m.layout == self.layout and m.size == self.size:
            return None
        size, layout, tensors = self._plain
        if m.tensors is None:
            return "no optimizer state" if (m.size, m.layout) == (size, layout) else None
        model = tuple(e for e in m.tensors if not e[0].startswith(OPTIMIZER_PREFIX))
        if table_layout(model) != layout:
            return None  # another model altogether: _manifest_problem names it
        assert self.tensors is not None and tensors is not None
        theirs = m.tensors[len(model):]
        if not theirs:
            return "no optimizer state"
        return first_difference(self.tensors[len(tensors):], theirs)

    def _take_optimizer_table(self, m: Manifest) -> str | None:
        """``any_optimizer``'s first manifest of our model: its optimizer table becomes ours (none: the parameters
        alone); why not, when it is too large or unlisted. Another model's leaves it to ``_manifest_problem``."""
        size, layout, tensors = self._plain
        assert size is not None and tensors is not None  # any_optimizer needs them
        if (m.size, m.layout) == (size, layout):  # it has no optimizer state: the parameters alone, from here on
            self._any_optimizer = self.with_optimizer = False
            return None
        if m.tensors is None:
            self._any_optimizer = False
            return "its manifest does not list its tensors"
        model = m.tensors[: len(tensors)]
        theirs = m.tensors[len(tensors):]
        if table_layout(model) != layout or not theirs or not all(e[0].startswith(OPTIMIZER_PREFIX) for e in theirs):
            return None  # another model altogether: _manifest_problem names it (and we wait for one of ours)
        self._any_optimizer = False
        if m.size - size > ANY_OPTIMIZER_SHARE * size:
            return f"its {m.size - size} bytes are more than ANY_OPTIMIZER_SHARE={ANY_OPTIMIZER_SHARE} times the model's"
        assert self.count == chunk_count(size, self.chunk_bytes) and self._missing == self.count  # nothing kept yet
        self.size, self.layout, self.tensors = m.size, m.layout, tensors + theirs
        self.count = chunk_count(m.size, self.chunk_bytes)
        self.data = torch.empty(m.size, dtype=torch.uint8)
        self.restart()
        return None

    def _drop_optimizer(self, donor: str, why: str) -> None:
        """Download the parameters alone from now on: the optimizer state offered does not fit ours."""
        self.optimizer_problem = f"{donor}: {why}"
        log.error(
            "state transfer: the optimizer state of %s does not fit our optimizer (%s): downloading the parameters only",
            donor, why,
        )
        self.with_optimizer = False
        self.size, self.layout, self.tensors = self._plain
        self.count = chunk_count(self.size or 0, self.chunk_bytes)
        self.data = torch.empty(self.size or 0, dtype=torch.uint8)
        self.restart()

    def _adopt(self, m: Manifest) -> None:
        """Take the first donor's description of the state (a tool without a model of its own)."""
        self.size, self.layout, self.tensors = m.size, m.layout, m.tensors
        self.count = chunk_count(m.size, self.chunk_bytes)
        self.data = torch.empty(m.size, dtype=torch.uint8)
        self.restart()
