"""Getting the members' states over the network: a peer's final merge, and a visitor outside the swarm.

The arithmetic and the file are ``gossiptrain.state.merged_model``; this is
the driver side that feeds them, in real time on an event loop:

- ``merge_members``: a writer's final phase (``gossiptrain peer
  --final-model PATH``) downloads every live member's state through its own
  ``StateEndpoint`` and writes their weighted mean;
- ``SwarmClient`` and ``export``: ``gossiptrain export`` and ``gossiptrain
  stop`` ask the coordinator or any member who is alive (``query`` ->
  ``roster``, see ``gossiptrain.protocol.finish``), then download or ask the
  swarm to stop. The visitor never joins: no member counts it, exchanges
  with it or waits for it.

The visitor's transport comes from the registry
(``gossiptrain.net.transport.listen``), like a peer's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from gossiptrain.config import Limits, RunConfig, SecurityConfig
from gossiptrain.errors import ConfigError, GossipError, JoinError, ProtocolError
from gossiptrain.net import kinds
from gossiptrain.net.addressing import curve_address, parse_hostport, plain_address, route_address, tcp_url
from gossiptrain.net.keys import join_server_key
from gossiptrain.net.kinds import QUERY, ROSTER, STATUS, STATUS_ASK, STOP
from gossiptrain.net.transport import Transport, listen
from gossiptrain.net.wire import Message
from gossiptrain.protocol.finish import new_stop_id
from gossiptrain.protocol.member import ALIVE, SUSPECT, Member, members_from_wire
from gossiptrain.protocol.state_transfer import TransferResult
from gossiptrain.protocol.state_transfer.fetcher import Fetcher
from gossiptrain.protocol.status import MemberStatus
from gossiptrain.runtime.clock import REAL_CLOCK, Clock
from gossiptrain.runtime.endpoint import Endpoint
from gossiptrain.runtime.join_client import plural_attempts
from gossiptrain.runtime.state_endpoint import StateEndpoint
from gossiptrain.state import storage
from gossiptrain.state.merged_model import MemberInfo, MergedInfo, NothingToMerge, WeightedMean, write_merged
from gossiptrain.state.snapshot import Entry, entries_of, table_layout, tensors_from

log = logging.getLogger(__name__)

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
    members: tuple[Member, ...]  # alive
    stopping: bool
    answered_by: str  # the answerer's id ("coordinator" for the coordinator)
    suspects: tuple[Member, ...] = ()  # suspected by the answerer, not declared dead yet

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
        listed = members_from_wire(b["members"], limits.max_container_len)
        members = tuple(m for m in listed if m.state == ALIVE)
        suspects = tuple(m for m in listed if m.state == SUSPECT)
        return cls(config, b["fingerprint"], members, b["stopping"], msg.sender, suspects)


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
        self._transport: Transport | None = None
        self._net: Endpoint | None = None  # sends, and routes ROSTER and state-transfer answers to us
        self._rosters: asyncio.Queue[Roster] = asyncio.Queue(maxsize=16)
        self._endpoint: StateEndpoint | None = None
        self._addresses: dict[str, str] = {}
        self._asked: set[str] = set()  # members asked for their status now; answers from others are dropped
        self._answers: dict[str, MemberStatus] = {}
        self._all_answered = asyncio.Event()

    async def __aenter__(self) -> "SwarmClient":
        await self._open(Limits())
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def _open(self, limits: Limits) -> None:
        self.limits = limits
        transport = listen(tcp_url(self._advertise, 0), limits, security=self._security)
        await transport.start(timeout=10)
        self._transport = transport
        port = parse_hostport(plain_address(transport.address), "visitor address")[1]  # port 0 bound to a real one
        self.address = transport.reachable_at(tcp_url(self._advertise, port))
        net = Endpoint(transport, limits, sender=self.id, fingerprint=self._fingerprint(), advertise=self.address)
        net.handlers = {ROSTER: self._on_roster, STATUS: self._on_status, **dict.fromkeys(kinds.STATE, self._on_state)}
        net.open_kinds = frozenset({ROSTER})  # the answer to a query: it tells us the run
        self._net = await net.start()

    def _fingerprint(self) -> str:
        return self.roster.fingerprint if self.roster is not None else ""

    async def close(self) -> None:
        if self._net is not None:
            await self._net.close("visitor done")
            self._net = None
        if self._transport is not None:
            await self._transport.close("visitor done")
            self._transport = None

    def _send(self, addr: str, kind: str, body: dict[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> bool:
        assert self._net is not None
        return self._net.send(addr, kind, body, tensors)

    def _on_roster(self, msg: Message, frames: Sequence[object]) -> None:
        if not self._rosters.full():
            self._rosters.put_nowait(Roster.from_message(msg, self.limits))

    def _on_state(self, msg: Message, frames: Sequence[object]) -> None:
        if self.roster is not None and self._endpoint is not None:  # the fingerprint was checked: the run's
            self._endpoint.on_message(msg)

    def _on_status(self, msg: Message, frames: Sequence[object]) -> None:
        if msg.sender not in self._asked:  # not asked now (a late answer to an earlier round, or nobody's)
            return
        self._answers[msg.sender] = MemberStatus.from_body(msg.sender, self._addresses[msg.sender], msg.body)
        if len(self._answers) == len(self._asked):
            self._all_answered.set()

    async def _ask(self, kind: str, body: dict[str, Any], attempts: int, timeout: float) -> Roster:
        while not self._rosters.empty():  # answers to earlier asks
            self._rosters.get_nowait()
        for attempt in range(1, attempts + 1):
            self._send(self._target, kind, body)
            try:
                return await asyncio.wait_for(self._rosters.get(), timeout * self.rng.uniform(1.0, 1.5))
            except TimeoutError:
                log.warning("no answer from %s yet (attempt %d of %d)", plain_address(self._target), attempt, attempts)
        raise JoinError(
            f"no answer from {plain_address(self._target)} after {plural_attempts(attempts)} of {timeout:g}+ s: is a gossiptrain "
            f"coordinator or peer running there, and can it reach us back at {plain_address(self.address)}?"
        )

    async def query(self, attempts: int = 5, timeout: float = 2.0) -> Roster:
        """Ask who is alive; learn the run. ``JoinError`` if nobody answers."""
        roster = await self._ask(QUERY, {}, attempts, timeout)
        if roster.config.limits != self.limits:  # take the run's message limits from now on
            await self.close()
            await self._open(roster.config.limits)
        self.roster = roster
        assert self._net is not None
        self._net.fingerprint = roster.fingerprint  # state-transfer answers must carry it from now on
        self._addresses = {m.id: m.addr for m in roster.members}
        self._endpoint = StateEndpoint(roster.config, send=self._send, address_of=self._addresses.get, clock=self.clock)
        return roster

    async def stop(self, reason: str, attempts: int = 5, timeout: float = 2.0) -> Roster:
        """Ask the swarm to finish (after ``query``); the answer is the contacted member's roster."""
        if self.roster is None:
            raise GossipError("query() first: a stop carries the run's fingerprint")
        return await self._ask(STOP, {"id": new_stop_id(self.rng), "reason": reason[:200]}, attempts, timeout)

    async def statuses(
        self, members: Sequence[Member], *, timeout: float = 2.0, attempts: int = 2
    ) -> dict[str, MemberStatus]:
        """Ask each of ``members`` how it is doing (after ``query``): the answers that came within the attempts.

        All are asked at once; those that have not answered after ``timeout``
        seconds are asked again, up to ``attempts`` times. A member that never
        answers is simply missing from the result.
        """
        if self.roster is None:
            raise GossipError("query() first: a status ask carries the run's fingerprint")
        self._asked = {m.id for m in members}
        self._answers = {}
        self._addresses.update((m.id, m.addr) for m in members)
        try:
            for _ in range(attempts):
                if len(self._answers) == len(self._asked):
                    break
                self._all_answered.clear()
                for m in members:
                    if m.id not in self._answers:
                        self._send(m.addr, STATUS_ASK, {})
                try:
                    await asyncio.wait_for(self._all_answered.wait(), timeout)
                except TimeoutError:
                    pass
            return dict(self._answers)
        finally:
            self._asked = set()

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
                    storage.location(members_dir, "--members-dir") / f"{member.id}.safetensors", tensors, members=[info],
                    fingerprint=roster.fingerprint, written_by=client.id,
                )
        if not used:
            raise NothingToMerge("no member's state could be downloaded: " + "; ".join(f"{m}: {w}" for m, w in skipped))
        merged = mean.result()
        written = write_merged(
            out, merged, members=used, skipped=skipped, fingerprint=roster.fingerprint, run=roster.config.to_dict(),
            written_by=client.id,
        )
    return ExportReport(written, used, skipped, total, time.monotonic() - began)
