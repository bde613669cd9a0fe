"""The merged model: the live members' states averaged, weighted by the samples each has trained on.

There are two ways to get one. Both download each member's state through
the state-transfer protocol (``gossiptrain.protocol.state_transfer``: a snapshot at
the member's next safe point, chunked, every chunk SHA-256 checked; the
member's training never waits for it):

- ``gossiptrain export --join HOST:PORT --out FILE.safetensors``: a visitor
  (``SwarmClient``) asks the coordinator or any member who is alive
  (``query``/``roster``, see ``gossiptrain.protocol.finish``), downloads each live
  member's state in turn, merges and writes. It never joins: no member
  counts it, exchanges with it or waits for it.
- the final phase of a peer run with ``--final-model PATH``
  (``merge_members``): the same, from inside the swarm, at the end of a run.

Merging (``WeightedMean``, no I/O): floating-point tensors are averaged in
float64 with weights proportional to the samples each member has seen
(equal weights when no member reports any), then cast back to their dtype;
integer and bool tensors (counters such as batch norm's
``num_batches_tracked``) are taken from the member with the most samples.
A member that fails mid-download is skipped and named.

Writing (``write_merged``): FILE, a safetensors file of the merged tensors,
then its metadata FILE.json (``merged.safetensors`` -> ``merged.json``):
members used with their samples and steps, those skipped and why, the run's
fingerprint, and FILE's size and SHA-256. Each is written to a temporary
file, fsynced and renamed (``gossiptrain.state.checkpoint``'s helpers), the JSON
last, so a crash never leaves a metadata file naming a partial model.
Reading (``read_merged``) checks size and hash before parsing; nothing is
ever unpickled.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import safetensors.torch
import torch

from gossiptrain.state.checkpoint import _encode_metadata, _for_saving, _fsync_directory, _serialize, _write_atomic
from gossiptrain.runtime.clock import REAL_CLOCK, Clock
from gossiptrain.config import Limits, RunConfig, SecurityConfig
from gossiptrain.errors import CheckpointError, ConfigError, GossipError, JoinError, ProtocolError
from gossiptrain.protocol.finish import new_stop_id
from gossiptrain.protocol.joining import parse_hostport, route_address, tcp_url
from gossiptrain.net.keys import join_server_key
from gossiptrain.protocol.membership import ALIVE, Member, members_from_wire
from gossiptrain.net import kinds
from gossiptrain.protocol.state_transfer import (
    Entry, Fetcher, StateEndpoint, TransferResult, entries_of, first_difference, table_layout, tensors_from,
)
from gossiptrain.net.transport import TcpTransport
from gossiptrain.net.transport.tcp import curve_address
from gossiptrain.net.wire import DTYPES, Message, decode, encode
from gossiptrain.net.kinds import QUERY, ROSTER, STOP

log = logging.getLogger(__name__)

FORMAT = "gossiptrain-merged-model"
VERSION = 1
MAX_METADATA_BYTES = 64 << 20


class NothingToMerge(GossipError):
    """The swarm was reached, but no member's state could be downloaded."""


# -- merging (no I/O) --------------------------------------------------------------------------


class WeightedMean:
    """Accumulates members' named tensors; ``result()`` is their average weighted by samples seen.

    Tensors are added one member at a time, so only the float64 sums are
    held, not every member's state. Every member must bring the same names,
    shapes and dtypes (``ValueError`` otherwise).
    """

    def __init__(self) -> None:
        self.table: tuple[Entry, ...] | None = None
        self.members = 0
        self.samples = 0
        self._weighted: dict[str, torch.Tensor] = {}  # sum of samples * x, float64
        self._plain: dict[str, torch.Tensor] | None = {}  # sum of x, while no member has reported samples
        self._exact: dict[str, tuple[int, torch.Tensor]] = {}  # integer tensors: (samples, value) of the heaviest member

    def add(self, tensors: Mapping[str, torch.Tensor], samples: int) -> None:
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        table = entries_of(tensors.items())
        if self.table is None:
            self.table = table
        elif table != self.table:
            raise ValueError(f"the tensors differ from the first member's: {first_difference(self.table, table)}")
        if samples > 0:
            self._plain = None  # from now on the weights are the samples
        for name, t in tensors.items():
            if t.is_floating_point() or t.is_complex():
                x = t.detach().to(torch.complex128 if t.is_complex() else torch.float64)
                acc = self._weighted.get(name)
                self._weighted[name] = x * samples if acc is None else acc.add_(x, alpha=samples)
                if self._plain is not None:
                    prev = self._plain.get(name)
                    self._plain[name] = x.clone() if prev is None else prev.add_(x)
            elif name not in self._exact or samples > self._exact[name][0]:
                self._exact[name] = (samples, t.detach().clone())
        self.members += 1
        self.samples += samples

    def result(self) -> dict[str, torch.Tensor]:
        """The merged tensors, in the members' order and dtypes."""
        if self.table is None:
            raise ValueError("no member's state was added")
        out: dict[str, torch.Tensor] = {}
        for name, dtype, _ in self.table:
            if name in self._exact:
                out[name] = self._exact[name][1].clone()
            elif self._plain is not None:  # nobody reported samples: the plain mean
                out[name] = (self._plain[name] / self.members).to(DTYPES[dtype])
            else:
                out[name] = (self._weighted[name] / self.samples).to(DTYPES[dtype])
        return out


# -- the file --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberInfo:
    """One member's contribution to a merged model."""

    id: str
    samples: int
    step: int
    digest: str = ""  # hash list digest of the state downloaded (state_transfer), "" for the writer's own

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "samples": self.samples, "step": self.step, "digest": self.digest}


@dataclass(frozen=True)
class MergedInfo:
    path: Path  # the safetensors file
    metadata: Path  # its JSON
    sha256: str
    bytes: int
    members: tuple[MemberInfo, ...]
    skipped: tuple[tuple[str, str], ...]  # (member, why)


def metadata_path(path: str | Path) -> Path:
    """``model.safetensors`` -> ``model.json``; any other name gets ``.json`` appended."""
    p = Path(path)
    return p.with_suffix(".json") if p.suffix == ".safetensors" else p.with_name(p.name + ".json")


def write_merged(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    members: Sequence[MemberInfo],
    skipped: Sequence[tuple[str, str]] = (),
    fingerprint: str = "",
    run: Mapping[str, Any] | None = None,
    written_by: str = "",
) -> MergedInfo:
    """Write the merged model and its metadata atomically; ``CheckpointError`` if it cannot be written."""
    path = Path(path)
    meta_path = metadata_path(path)
    directory = path.parent
    data = _serialize(_for_saving(dict(tensors), "the merged model"), "the merged model")
    digest = hashlib.sha256(data).hexdigest()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "file": path.name,
        "bytes": len(data),
        "sha256": digest,
        "fingerprint": fingerprint,
        "weights": "samples_seen",
        "samples": sum(m.samples for m in members),
        "members": [m.to_json() for m in members],
        "skipped": [{"id": mid, "reason": why} for mid, why in skipped],
        "written_by": written_by,
        "wall_time": time.time(),
        "run": dict(run) if run is not None else None,
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(directory, path.name, data)
        _fsync_directory(directory)  # the model is durable before the metadata names it
        _write_atomic(directory, meta_path.name, _encode_metadata(meta))
        _fsync_directory(directory)
    except OSError as e:
        raise CheckpointError(f"could not write the merged model {path}: {e.strerror or e}") from e
    return MergedInfo(path, meta_path, digest, len(data), tuple(members), tuple(skipped))


def read_merged(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A merged model's tensors and metadata, its size and SHA-256 checked first; ``CheckpointError`` if bad."""
    path = Path(path)
    meta_path = metadata_path(path)
    try:
        if meta_path.stat().st_size > MAX_METADATA_BYTES:
            raise CheckpointError(f"{meta_path}: larger than a metadata file may be")
        meta = json.loads(meta_path.read_bytes())
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read the merged model {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_path}: not a {FORMAT} version {VERSION} metadata file")
    if len(data) != meta.get("bytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{path}: its size or SHA-256 does not match {meta_path.name} (truncated or corrupt)")
    try:
        loaded = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error type for malformed input
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None
    return {k: v.clone() for k, v in loaded.items()}, meta


# -- downloading members' states ---------------------------------------------------------------


async def download_member(
    endpoint: StateEndpoint,
    member: str,
    *,
    me: str,
    rng: random.Random,
    clock: Clock,
    expect: tuple[int, str, tuple[Entry, ...]] | None = None,
    max_bytes: int = 0,
    seconds: float | None = None,
    alive: Callable[[], Sequence[str]] | None = None,
) -> TransferResult:
    """One member's state through ``endpoint``: of the ``(size, layout, table)`` expected, or any up to ``max_bytes``.

    ``alive()`` (the live member ids) ends the download early when the
    member leaves; ``seconds`` bounds it (default ``state.max_seconds``).
    """
    config = endpoint.config if seconds is None else replace(endpoint.config, max_seconds=seconds)
    size, layout, table = expect if expect is not None else (None, None, None)
    fetcher = Fetcher(config, me=me, size=size, layout=layout, rng=rng, now=clock.now(), tensors=table, max_bytes=max_bytes)

    def candidates() -> Sequence[str]:
        return [member] if alive is None or member in alive() else []

    return await endpoint.download(fetcher, candidates)


def decode_member(result: TransferResult) -> dict[str, torch.Tensor] | str:
    """A downloaded state as named tensors, or why it cannot be used."""
    if not result.ok or result.data is None:
        return result.reason or "no state"
    if result.tensors is None:
        return "its state lists no tensors (a dtype the wire cannot name)"
    return tensors_from(result.tensors, result.data)


async def merge_members(
    endpoint: StateEndpoint,
    own: tuple[MemberInfo, Mapping[str, torch.Tensor]] | None,
    members: Sequence[str],
    *,
    path: str | Path,
    me: str,
    config: RunConfig,
    rng: random.Random,
    clock: Clock,
    alive: Callable[[], Sequence[str]] | None = None,
    written_by: str = "",
) -> tuple[list[str], list[str]]:
    """Download ``members``' states, merge them with ``own`` (the writer's, if it is a member) and write ``path``.

    Runs on the loop that drives ``endpoint``. Returns the ids merged and
    the ids skipped; raises ``GossipError`` if none could be merged.
    """
    mean = WeightedMean()
    used: list[MemberInfo] = []
    skipped: list[tuple[str, str]] = []
    expect = None
    if own is not None:
        info, tensors = own
        mean.add(tensors, info.samples)
        used.append(info)
        table = entries_of(tensors.items())
        expect = (sum(t.numel() * t.element_size() for t in tensors.values()), table_layout(table), table)
    for member in members:
        result = await download_member(
            endpoint, member, me=me, rng=rng, clock=clock, expect=expect, max_bytes=64 << 30, alive=alive
        )
        tensors_or_why = decode_member(result)
        if isinstance(tensors_or_why, str):
            skipped.append((member, tensors_or_why))
            log.warning("merged model: skipping %s: %s", member, tensors_or_why)
            continue
        mean.add(tensors_or_why, result.samples)
        used.append(MemberInfo(member, result.samples, result.step, result.digest))
    if not used:
        raise NothingToMerge("no member's state could be downloaded: " + "; ".join(f"{m}: {w}" for m, w in skipped))
    merged = mean.result()
    written = await asyncio.to_thread(
        write_merged, path, merged, members=used, skipped=skipped, fingerprint=config.fingerprint(), run=config.to_dict(),
        written_by=written_by,
    )
    log.info("merged model of %d members (%d samples) written to %s", len(used), mean.samples, written.path)
    return [m.id for m in used], [m for m, _ in skipped]


# -- a visitor: gossiptrain export / stop ------------------------------------------------------


@dataclass(frozen=True)
class Roster:
    """A member's (or the coordinator's) answer to a query: the run, and who is alive as it sees it."""

    config: RunConfig
    fingerprint: str
    members: tuple[Member, ...]
    stopping: bool
    answered_by: str  # the answerer's id ("coordinator" for the coordinator)

    @classmethod
    def from_message(cls, msg: Message, limits: Limits) -> "Roster":
        b = msg.body
        if not isinstance(b, dict) or {"fingerprint", "config", "members", "stopping"} - set(b):
            raise ProtocolError("a roster needs fingerprint, config, members and stopping")
        try:
            config = RunConfig.from_dict(b["config"])
        except ConfigError as e:
            raise ProtocolError(f"the roster's configuration is invalid: {e}") from None
        if b["fingerprint"] != config.fingerprint() or type(b["stopping"]) is not bool:
            raise ProtocolError("the roster's fingerprint does not match its configuration")
        members = tuple(m for m in members_from_wire(b["members"], limits.max_container_len) if m.state == ALIVE)
        return cls(config, b["fingerprint"], members, b["stopping"], msg.sender)


class SwarmClient:
    """Talks to a swarm from outside (``gossiptrain export``, ``gossiptrain stop``): asks, downloads, never joins.

    ``async with SwarmClient("host:port") as client``; ``query()`` first (it
    learns the run), then ``stop()`` or ``download()``. It listens on the
    address that routes to the join host (``advertise``), port 0, so that
    members can answer.
    """

    def __init__(
        self,
        join: str,
        *,
        advertise: str | None = None,
        security: SecurityConfig | None = None,
        clock: Clock = REAL_CLOCK,
        rng: random.Random | None = None,
    ) -> None:
        host, port = parse_hostport(join, "join address")
        self.rng = rng or random.Random()
        self.id = f"visitor-{self.rng.getrandbits(32):08x}"
        self.clock = clock
        self._advertise = advertise or route_address(host)
        self._security = security
        self._target = tcp_url(host, port)
        if security is not None:
            self._target = curve_address(self._target, join_server_key(security))
        self.limits = Limits()
        self.roster: Roster | None = None
        self.address = ""
        self._transport: TcpTransport | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._rosters: asyncio.Queue[Roster] = asyncio.Queue(maxsize=16)
        self._endpoint: StateEndpoint | None = None
        self._addresses: dict[str, str] = {}

    async def __aenter__(self) -> "SwarmClient":
        await self._open(Limits())
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def _open(self, limits: Limits) -> None:
        self.limits = limits
        transport = TcpTransport(tcp_url(self._advertise, 0), limits, security=self._security)
        await transport.start(timeout=10)
        self._transport = transport
        self.address = transport.reachable_at(tcp_url(self._advertise, transport.port))
        self._receiver = asyncio.create_task(self._receive(transport))

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
            self._receiver = None
        if self._transport is not None:
            await self._transport.close("visitor done")
            self._transport = None

    def _send(self, addr: str, kind: str, body: dict[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> bool:
        assert self._transport is not None
        fingerprint = self.roster.fingerprint if self.roster is not None else ""
        msg = Message(kind, self.id, self.address, fingerprint, 0, body, dict(tensors or {}))
        try:
            return self._transport.send(addr, encode(msg, self.limits))
        except ProtocolError as e:
            log.error("cannot send %s to %s: %s", kind, addr, e)
            return False

    async def _receive(self, transport: TcpTransport) -> None:
        while True:
            frames = await transport.recv()
            try:
                msg = decode(frames, self.limits)
                if msg.kind == ROSTER:
                    if not self._rosters.full():
                        self._rosters.put_nowait(Roster.from_message(msg, self.limits))
                elif msg.kind in kinds.STATE and self.roster is not None and self._endpoint is not None:
                    if msg.fingerprint == self.roster.fingerprint:
                        self._endpoint.on_message(msg)
            except ProtocolError as e:
                log.debug("dropped a bad message: %s", e)

    async def _ask(self, kind: str, body: dict[str, Any], attempts: int, timeout: float) -> Roster:
        while not self._rosters.empty():  # answers to earlier asks
            self._rosters.get_nowait()
        for attempt in range(1, attempts + 1):
            self._send(self._target, kind, body)
            try:
                return await asyncio.wait_for(self._rosters.get(), timeout * self.rng.uniform(1.0, 1.5))
            except TimeoutError:
                log.warning("no answer from %s yet (attempt %d of %d)", self._target.partition("?")[0], attempt, attempts)
        raise JoinError(
            f"no answer from {self._target.partition('?')[0]} after {attempts} attempts of {timeout:g}+ s: is a gossiptrain "
            f"coordinator or peer running there, and can it reach us back at {self.address.partition('?')[0]}?"
        )

    async def query(self, attempts: int = 5, timeout: float = 2.0) -> Roster:
        """Ask who is alive; learn the run. ``JoinError`` if nobody answers."""
        roster = await self._ask(QUERY, {}, attempts, timeout)
        if roster.config.limits != self.limits:  # take the run's message limits from now on
            await self.close()
            await self._open(roster.config.limits)
        self.roster = roster
        self._addresses = {m.id: m.addr for m in roster.members}
        self._endpoint = StateEndpoint(roster.config, send=self._send, address_of=self._addresses.get, clock=self.clock)
        return roster

    async def stop(self, reason: str, attempts: int = 5, timeout: float = 2.0) -> Roster:
        """Ask the swarm to finish (after ``query``); the answer is the contacted member's roster."""
        if self.roster is None:
            raise GossipError("query() first: a stop carries the run's fingerprint")
        return await self._ask(STOP, {"id": new_stop_id(self.rng), "reason": reason[:200]}, attempts, timeout)

    async def download(
        self, member: Member, *, expect: tuple[int, str, tuple[Entry, ...]] | None = None, max_bytes: int, seconds: float
    ) -> TransferResult:
        """``member``'s state (parameters and buffers), of the layout ``expect``ed or any up to ``max_bytes``."""
        if self._endpoint is None:
            raise GossipError("query() first: downloads need the run's configuration")
        self._addresses[member.id] = member.addr
        return await download_member(
            self._endpoint, member.id, me=self.id, rng=self.rng, clock=self.clock, expect=expect, max_bytes=max_bytes,
            seconds=seconds,
        )


@dataclass
class ExportReport:
    """What ``export`` did."""

    info: MergedInfo
    members: list[MemberInfo] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    bytes: int = 0  # downloaded
    seconds: float = 0.0


async def export(
    join: str,
    out: str | Path,
    *,
    security: SecurityConfig | None = None,
    advertise: str | None = None,
    members_dir: str | Path | None = None,
    seconds_per_member: float = 60.0,
    max_bytes: int = 64 << 30,
    progress: Callable[[str], None] = lambda line: None,
) -> ExportReport:
    """Download every live member's state, merge weighted by samples seen, write ``out`` (see the module docstring).

    ``members_dir`` also keeps each member's state there (``<id>.safetensors``
    with its ``.json``), e.g. to compare them with the merged model.
    """
    began = time.monotonic()
    async with SwarmClient(join, advertise=advertise, security=security) as client:
        roster = await client.query()
        members = sorted(roster.members, key=lambda m: m.id)
        progress(f"run {roster.fingerprint}: {len(members)} live members (as {roster.answered_by} sees it)")
        if not members:
            raise NothingToMerge(f"{roster.answered_by} knows no live member: nothing to export")
        mean = WeightedMean()
        used: list[MemberInfo] = []
        skipped: list[tuple[str, str]] = []
        expect: tuple[int, str, tuple[Entry, ...]] | None = None
        total = 0
        for i, member in enumerate(members, start=1):
            t = time.monotonic()
            result = await client.download(member, expect=expect, max_bytes=max_bytes, seconds=seconds_per_member)
            tensors = decode_member(result)
            if isinstance(tensors, str):
                skipped.append((member.id, tensors))
                progress(f"member {i}/{len(members)} {member.id}: skipped ({tensors})")
                continue
            try:
                mean.add(tensors, result.samples)
            except ValueError as e:
                skipped.append((member.id, str(e)))
                progress(f"member {i}/{len(members)} {member.id}: skipped ({e})")
                continue
            assert result.data is not None and result.tensors is not None
            expect = expect or (result.data.numel(), table_layout(result.tensors), result.tensors)
            info = MemberInfo(member.id, result.samples, result.step, result.digest)
            used.append(info)
            total += result.data.numel()
            progress(
                f"member {i}/{len(members)} {member.id}: {result.data.numel() / 1e6:.1f} MB in {time.monotonic() - t:.2f} s "
                f"(step {result.step}, {result.samples} samples); {total / 1e6:.1f} MB in all"
            )
            if members_dir is not None:
                write_merged(
                    Path(members_dir) / f"{member.id}.safetensors", tensors, members=[info], fingerprint=roster.fingerprint,
                    written_by=client.id,
                )
        if not used:
            raise NothingToMerge("no member's state could be downloaded: " + "; ".join(f"{m}: {w}" for m, w in skipped))
        merged = mean.result()
        written = write_merged(
            out, merged, members=used, skipped=skipped, fingerprint=roster.fingerprint, run=roster.config.to_dict(),
            written_by=client.id,
        )
    return ExportReport(written, used, skipped, total, time.monotonic() - began)
