"""The parameters a swarm averages, by name, dtype and shape: what every peer must agree on.

A joiner checks its model against the swarm's before it takes a state
(``protocol.joining``), a coordinator and a state donor send theirs
(``to_wire``), and every averaging algorithm takes its own (``Averaging.spec``).
It lives apart from the averaging machinery because those are its users too,
and need none of it.

A peer whose model is split across its ranks (issue 48) averages piece by
piece, so the swarm must also agree on how the model is split: its spec
carries the layout as one line (``layout``: ``PieceLayout.describe`` and a
digest of the whole layout, see ``gossiptrain.protocol.pieces.split_spec``),
compared before any parameter. On the wire the line is one more entry, named
``""`` (no parameter has an empty name), so the spec's wire form is unchanged
and a member that predates split peers refuses a split joiner all the same.
A coordinator that knows the swarm's model from its workload does not know
how its peers split it: its spec's layout is open (``LAYOUT_OPEN``), checked
against no one, and taken from the first member to join (``with_layout_of``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import torch

from gossiptrain.errors import ProtocolError

#: The wire name of the layout line (see the module docstring).
LAYOUT_ENTRY = ""
#: The layout of a spec that knows the model but not how its peers split it (a coordinator's, from its workload).
LAYOUT_OPEN = "*"


@dataclass(frozen=True)
class ParamSpec:
    """Names, dtypes and shapes of the parameters a swarm averages; all peers must agree."""

    entries: tuple[tuple[str, str, tuple[int, ...]], ...]
    layout: str | None = None  # how the model is split across each peer's ranks; None: whole on one rank

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor]) -> "ParamSpec":
        return cls(tuple((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in params.items()))

    def to_wire(self) -> list[list[object]]:
        out: list[list[object]] = [[n, d, list(s)] for n, d, s in self.entries]
        if self.layout is not None:
            out.append([LAYOUT_ENTRY, self.layout, []])
        return out

    @classmethod
    def from_wire(cls, raw: object) -> "ParamSpec":
        if not isinstance(raw, list):
            raise ProtocolError("parameter spec must be a list")
        out = []
        layout = None
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
            if e[0] == LAYOUT_ENTRY:
                layout = e[1]
            else:
                out.append((e[0], e[1], tuple(e[2])))
        return cls(tuple(out), layout)

    def open_layout(self) -> "ParamSpec":
        """This model, however its peers split it (see the module docstring)."""
        return replace(self, layout=LAYOUT_OPEN)

    def with_layout_of(self, other: "ParamSpec") -> "ParamSpec":
        """This spec, an open layout taken from ``other`` (a member admitted with it); a known one kept."""
        return replace(self, layout=other.layout) if self.layout == LAYOUT_OPEN else self

    def mismatch(self, other: "ParamSpec") -> str | None:
        """A sentence naming the first difference, or None if the specs agree: the layouts first, naming both."""
        if self.layout != other.layout and LAYOUT_OPEN not in (self.layout, other.layout):
            return f"this peer's model is {_layout_words(self.layout)}; the swarm's is {_layout_words(other.layout)}"
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


def _layout_words(layout: str | None) -> str:
    return "whole on one rank (a single worker, or DDP)" if layout is None else f"split as {layout}"
