"""Joining a swarm: the request a newcomer sends, the answer any member gives, and the client loop.

The coordinator and every live peer answer joins with the same function,
``answer_join``, so ``--join`` may name either. The answer hands out a fresh
id, a shard, the run configuration, its fingerprint, the parameter spec (when
known) and a sample of live members to seed the newcomer's membership view.
A newcomer that brings its own configuration or model is refused with a
message naming the first difference, before it can mix into the run.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gossiptrain.protocol.averaging import ParamSpec
from gossiptrain.runtime.clock import Clock
from gossiptrain.config import Limits, RunConfig
from gossiptrain.errors import ConfigError, JoinError, MismatchError, ProtocolError
from gossiptrain.protocol.membership import Member, members_from_wire
from gossiptrain.net.transport import TcpTransport, Transport
from gossiptrain.net.transport.tcp import CURVE_QUERY
from gossiptrain.net.wire import Message, decode, encode
from gossiptrain.net.kinds import JOIN, REFUSE, WELCOME

log = logging.getLogger(__name__)



def new_member_id(rng: random.Random) -> str:
    """Random ids need no coordination: any member can hand one out.

    Drawn from the answerer's generator: seeded from the OS in a real run,
    from the simulation's seed in a simulated one (so runs repeat exactly).
    """
    return f"p{rng.getrandbits(40):010x}"


# -- the request -------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinRequest:
    """What a newcomer asks with: optionally the run it expects and the model it brings."""

    config: RunConfig | None = None
    spec: ParamSpec | None = None
    shard: int = -1  # a wanted shard, or -1 to be assigned one

    def to_body(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict() if self.config else None,
            "spec": self.spec.to_wire() if self.spec else None,
            "shard": self.shard,
        }

    @classmethod
    def from_body(cls, body: Any) -> "JoinRequest":
        if not isinstance(body, dict) or set(body) != {"config", "spec", "shard"}:
            raise ProtocolError("join body must have exactly config, spec and shard")
        config = None
        if body["config"] is not None:
            try:
                config = RunConfig.from_dict(body["config"])
            except ConfigError as e:
                raise ProtocolError(f"join carries an invalid configuration: {e}") from None
        spec = ParamSpec.from_wire(body["spec"]) if body["spec"] is not None else None
        shard = body["shard"]
        if type(shard) is not int or shard < -1:
            raise ProtocolError("join shard must be an int >= -1")
        return cls(config, spec, shard)


# -- the answer --------------------------------------------------------------------------


@dataclass(frozen=True)
class Welcome:
    """A member's answer admitting us."""

    member_id: str
    shard: int
    config: RunConfig
    fingerprint: str
    spec: ParamSpec | None
    members: list[Member]
    coordinator: str  # address peers report to, "" if none is known
    answered_by: str  # address that answered

    @classmethod
    def from_message(cls, msg: Message, limits: Limits) -> "Welcome":
        b = msg.body
        keys = {"id", "shard", "config", "fingerprint", "spec", "members", "coordinator"}
        if not isinstance(b, dict) or set(b) != keys:
            raise ProtocolError("welcome body has the wrong fields")
        try:
            config = RunConfig.from_dict(b["config"])
        except ConfigError as e:
            raise ProtocolError(f"the swarm sent an invalid configuration: {e}") from None
        if not isinstance(b["id"], str) or not isinstance(b["coordinator"], str):
            raise ProtocolError("welcome id and coordinator must be strings")
        if type(b["shard"]) is not int or not 0 <= b["shard"] < config.train.shards:
            raise ProtocolError("welcome shard out of range")
        if b["fingerprint"] != config.fingerprint():
            raise ProtocolError("welcome fingerprint does not match its configuration")
        spec = ParamSpec.from_wire(b["spec"]) if b["spec"] is not None else None
        members = members_from_wire(b["members"], limits.max_container_len)
        return cls(b["id"], b["shard"], config, b["fingerprint"], spec, members, b["coordinator"], msg.addr)


def answer_join(
    request: JoinRequest,
    *,
    config: RunConfig,
    spec: ParamSpec | None,
    sample: Sequence[Member],
    pick_shard: Callable[[int], int],
    coordinator: str,
    rng: random.Random,
) -> tuple[str, dict[str, Any]]:
    """Decide on a join: ("welcome", body) or ("refuse", {"reason": ...}). Pure: no I/O."""
    if request.config is not None and request.config.fingerprint() != config.fingerprint():
        diffs = request.config.diff(config)
        shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
        return REFUSE, {"reason": f"run configuration differs from the swarm's (yours vs swarm's): {shown}"}
    if request.spec is not None and spec is not None:
        problem = request.spec.mismatch(spec)
        if problem:
            return REFUSE, {"reason": f"model differs from the swarm's: {problem}"}
    shards = config.train.shards
    shard = request.shard if 0 <= request.shard < shards else pick_shard(shards)
    return WELCOME, {
        "id": new_member_id(rng),
        "shard": shard,
        "config": config.to_dict(),
        "fingerprint": config.fingerprint(),
        "spec": spec.to_wire() if spec else None,
        "members": [m.to_wire() for m in sample],
        "coordinator": coordinator,
    }


# -- the client --------------------------------------------------------------------------


def parse_hostport(text: str, what: str = "address") -> tuple[str, int]:
    """'host:port', '[::1]:port' or 'tcp://host:port' -> (host, port), with a clear error."""
    raw = text.removeprefix("tcp://")
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} {text!r} must look like HOST:PORT (e.g. 127.0.0.1:7070)")
    return host.strip("[]"), int(port)


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def route_address(remote_host: str) -> str:
    """The local address of the interface that routes to ``remote_host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(remote_host, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve join host {remote_host!r}: {e.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"


async def join_swarm(
    transport: Transport,
    target: str,
    request: JoinRequest,
    *,
    advertise: str,
    limits: Limits,
    clock: Clock,
    attempts: int,
    attempt_timeout: float,
    rng: random.Random,
) -> Welcome:
    """Ask the member at ``target`` to admit us; retry a bounded number of times.

    A send that cannot be queued yet (the connection is still being set up)
    is retried every 50 ms within the attempt, so a reachable member answers
    in milliseconds rather than after a whole attempt timeout. Each attempt
    waits a little longer at random, so that newcomers refused together (a
    full queue at the answerer) do not all come back at the same instant.
    A failed handshake with ``target`` (a CURVE key refused, a wrong server
    key, one side secure and the other not) ends the join within a quarter
    second, with the cause named: retrying cannot fix a key.
    """
    frames = encode(Message(JOIN, sender="", addr=advertise, fingerprint="", body=request.to_body()), limits)
    refused_before = transport.stats.handshake_failures
    for attempt in range(1, attempts + 1):
        deadline = clock.now() + attempt_timeout * rng.uniform(1.0, 1.5)
        sent = transport.send(target, frames)
        while clock.now() < deadline:
            wait = 0.05 if not sent else min(0.25, deadline - clock.now())
            try:
                got = await asyncio.wait_for(transport.recv(), timeout=max(0.0, wait))
            except TimeoutError:
                failure = transport.connect_failure(target) if isinstance(transport, TcpTransport) else None
                if failure:
                    raise JoinError(f"cannot join: {failure}") from None
                if not sent:
                    sent = transport.send(target, frames)
                continue
            try:
                msg = decode(got, limits)
            except ProtocolError:
                continue
            if msg.kind == REFUSE:
                reason = msg.body.get("reason") if isinstance(msg.body, dict) else None
                raise MismatchError(f"{_plain(target)} refused us: {str(reason)[:2000]}")
            if msg.kind == WELCOME:
                try:
                    return Welcome.from_message(msg, limits)
                except ProtocolError as e:
                    raise JoinError(f"{_plain(target)} answered with an invalid welcome: {e}") from None
        log.warning("no answer from %s yet (attempt %d of %d)", _plain(target), attempt, attempts)
    hint = ""
    if transport.stats.handshake_failures > refused_before:
        hint = (
            " Meanwhile we refused a connection: if it was the answer, the answerer's public key is not in our "
            "allow-list directory (--allow)."
        )
    raise JoinError(
        f"no answer from {_plain(target)} after {attempts} attempts of {attempt_timeout:g}+ s each. "
        f"Is a gossiptrain coordinator or peer running there, and can it reach this peer back at "
        f"{_plain(advertise)}? (set --advertise to an address it can reach)" + hint
    )


def _plain(address: str) -> str:
    """An address without its CURVE key, for messages people read."""
    return address.partition(CURVE_QUERY)[0]
