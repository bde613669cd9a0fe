"""The parameters a swarm averages, by name, dtype and shape: what every peer must agree on.

A joiner checks its model against the swarm's before it takes a state
(``protocol.joining``), a coordinator and a state donor send theirs
(``to_wire``), and every averaging algorithm takes its own (``Averaging.spec``).
It lives apart from the averaging machinery because those are its users too,
and need none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from gossiptrain.errors import ProtocolError


@dataclass(frozen=True)
class ParamSpec:
    """Names, dtypes and shapes of the parameters a swarm averages; all peers must agree."""

    entries: tuple[tuple[str, str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor]) -> "ParamSpec":
        return cls(tuple((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in params.items()))

    def to_wire(self) -> list[list[object]]:
        return [[n, d, list(s)] for n, d, s in self.entries]

    @classmethod
    def from_wire(cls, raw: object) -> "ParamSpec":
        if not isinstance(raw, list):
            raise ProtocolError("parameter spec must be a list")
        out = []
        for e in raw:
            if (
                not isinstance(e, list)
                or len(e) != 3
                or not isinstance(e[0], str)
                or not isinstance(e[1], str)
                or not isinstance(e[2], list)
                or not all(type(d) is int and d >= 0 for d in e[2])
            ):
                raise ProtocolError("malformed parameter spec entry")
            out.append((e[0], e[1], tuple(e[2])))
        return cls(tuple(out))

    def mismatch(self, other: "ParamSpec") -> str | None:
        """A sentence naming the first difference, or None if the specs agree."""
        mine = {n: (d, s) for n, d, s in self.entries}
        theirs = {n: (d, s) for n, d, s in other.entries}
        for name in mine:  # in model order, so the same models always give the same sentence
            if name not in theirs:
                return f"parameter {name!r} exists here but not in the swarm's model"
        for name in theirs:
            if name not in mine:
                return f"parameter {name!r} exists in the swarm's model but not here"
        for name, (d, s) in mine.items():
            td, ts = theirs[name]
            if s != ts:
                return f"parameter {name!r} has shape {list(s)} here but {list(ts)} in the swarm"
            if d != td:
                return f"parameter {name!r} has dtype {d} here but {td} in the swarm"
        return None
