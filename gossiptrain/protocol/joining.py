"""Joining a swarm: the request a newcomer sends and the answer any member gives (sans-IO).

The coordinator and every live peer answer joins with the same function,
``answer_join``, so ``--join`` may name either. The answer hands out a fresh
id, a shard, the run configuration, its fingerprint, the parameter spec (when
known) and a sample of live members to seed the newcomer's membership view.
A newcomer that brings its own configuration or model is refused with a
message naming the first difference, before it can mix into the run. The
newcomer's side, which sends and waits, is ``gossiptrain.runtime.join_client``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gossiptrain.config import Limits, RunConfig
from gossiptrain.errors import ConfigError, ProtocolError
from gossiptrain.net.kinds import REFUSE, WELCOME
from gossiptrain.protocol.member import Member, members_from_wire
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.reachability import checked_nonce

log = logging.getLogger(__name__)



def new_member_id(rng: random.Random) -> str:
    """Random ids need no coordination: any member can hand one out.

    Drawn from the answerer's generator: seeded from the OS in a real run,
    from the simulation's seed in a simulated one (so runs repeat exactly).
    """
    return f"p{rng.getrandbits(40):010x}"


# -- the request -------------------------------------------------------------------------


_REQUEST_FIELDS = frozenset({"config", "spec", "shard"})
_OPTIONAL_FIELDS = frozenset({"reach", "token", "given"})


@dataclass(frozen=True)
class JoinRequest:
    """What a newcomer asks with: optionally the run it expects, the model it brings, a nonce to be dialled back with.

    The run it expects travels with the fields it was given (``RunConfig.fields_given``: what its user wrote, by
    flag, ``--set`` or file, whatever the value): those are what it is compared on.
    """

    config: RunConfig | None = None
    spec: ParamSpec | None = None
    shard: int = -1  # a wanted shard, or -1 to be assigned one
    # Dial us back at our advertised address with this nonce (gossiptrain.protocol.reachability); None: do not.
    reach: int | None = None
    # The same in every attempt of one join: an answerer whose welcome was lost answers a retry with the same id and
    # shard, instead of leaving a member that never trains holding a shard nobody else is then given.
    token: int | None = None

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "config": self.config.to_dict() if self.config else None,
            "spec": self.spec.to_wire() if self.spec else None,
            "shard": self.shard,
        }
        if self.config is not None:
            body["given"] = sorted(self.config.fields_given)
        if self.reach is not None:  # absent otherwise: a request without it is what answerers before it read
            body["reach"] = self.reach
        if self.token is not None:
            body["token"] = self.token
        return body

    @classmethod
    def from_body(cls, body: Any) -> "JoinRequest":
        if not isinstance(body, dict) or set(body) - _OPTIONAL_FIELDS != _REQUEST_FIELDS:
            raise ProtocolError("join body must have exactly config, spec and shard (and optionally reach, token and given)")
        config = None
        if body["config"] is not None:
            try:  # without the fields given (an older newcomer's request): those not at their defaults
                config = RunConfig.from_dict(body["config"], given=body.get("given"))
            except ConfigError as e:
                raise ProtocolError(f"join carries an invalid configuration: {e}") from None
        spec = ParamSpec.from_wire(body["spec"]) if body["spec"] is not None else None
        shard = body["shard"]
        if type(shard) is not int or shard < -1:
            raise ProtocolError("join shard must be an int >= -1")
        reach = checked_nonce(body["reach"]) if "reach" in body else None
        token = checked_nonce(body["token"], "a join's token") if "token" in body else None
        return cls(config, spec, shard, reach, token)


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
    def from_body(cls, b: Any, answered_by: str, limits: Limits) -> "Welcome":
        """The welcome in a message body from ``answered_by``; ProtocolError if malformed."""
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
        return cls(b["id"], b["shard"], config, b["fingerprint"], spec, members, b["coordinator"], answered_by)


def answer_join(
    request: JoinRequest,
    *,
    config: RunConfig,
    spec: ParamSpec | None,
    sample: Sequence[Member],
    pick_shard: Callable[[int], int],
    coordinator: str,
    rng: random.Random,
    member_id: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """Decide on a join: ("welcome", body) or ("refuse", {"reason": ...}). Pure: no I/O.

    A newcomer that brings a configuration is compared only on the fields it
    was given (``RunConfig.fields_given``: what its user wrote, whatever the
    value, a default's too): everything else it takes from the swarm, so
    passing one run flag never means repeating the swarm's whole
    configuration. ``member_id``: the newcomer's id where it is not ours to
    choose (a secure swarm derives it from the newcomer's key); otherwise a
    fresh random one.
    """
    if request.config is not None and request.config.fingerprint() != config.fingerprint():
        diffs = set_fields_that_differ(request.config, config)
        if diffs:
            shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
            return REFUSE, {"reason": f"run configuration differs from the swarm's (yours vs swarm's): {shown}"}
    if request.spec is not None and spec is not None:
        problem = request.spec.mismatch(spec)
        if problem:
            return REFUSE, {"reason": model_differs(problem, config)}
    shards = config.train.shards
    if request.shard >= shards:
        return REFUSE, {"reason": f"shard {request.shard} does not exist: the swarm has {shards} shards (0-{shards - 1})"}
    shard = request.shard if request.shard >= 0 else pick_shard(shards)
    return WELCOME, {
        "id": member_id or new_member_id(rng),
        "shard": shard,
        "config": config.to_dict(),
        "fingerprint": config.fingerprint(),
        "spec": spec.to_wire() if spec else None,
        "members": [m.to_wire() for m in sample],
        "coordinator": coordinator,
    }


#: ``train.workload`` of a swarm whose peers bring their own model (gossiptrain.train.workload.EXTERNAL).
_EXTERNAL = "external"


def model_differs(problem: str, swarm: RunConfig) -> str:
    """The one line refusing a newcomer whose model is not the swarm's (``problem``: ``ParamSpec.mismatch``'s).

    A swarm of ``train.workload`` external has no model of its own: the first
    member's is the swarm's while any member is live (the coordinator forgets
    it once none is), so the line says so, and what to do.
    """
    line = f"model differs from the swarm's: {problem}"
    if swarm.train.workload == _EXTERNAL:
        line += ("; with train.workload 'external' the swarm's model was fixed by its first member and stays while "
                 "any member is live: build the same model, or start a new coordinator for this one")
    return line


def set_fields_that_differ(given: RunConfig, swarm: RunConfig) -> list[str]:
    """'section.field: given's vs swarm's' for each field ``given`` was given (``fields_given``) that the swarm does not share."""
    return [f"{field}: {mine!r} vs {theirs!r}" for field, mine, theirs, was_given in _differences(given, swarm) if was_given]


def taken_from_swarm(given: RunConfig, swarm: RunConfig) -> list[str]:
    """'section.field=value' for each field ``given`` was not given (``fields_given``) that the swarm runs otherwise."""
    return [f"{field}={theirs!r}" for field, _, theirs, was_given in _differences(given, swarm) if not was_given]


def _differences(given: RunConfig, swarm: RunConfig) -> list[tuple[str, Any, Any, bool]]:
    """(dotted field, given's value, swarm's value, whether ``given`` was given the field) where the two differ."""
    mine, theirs, written = given.to_dict(), swarm.to_dict(), given.fields_given
    return [
        (f"{section}.{name}", value, theirs[section][name], f"{section}.{name}" in written)
        for section, values in mine.items()
        for name, value in values.items()
        if theirs[section][name] != value
    ]
