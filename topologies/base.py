"""The Topology interface: whom member i sends to among n members in a round.

A topology is a pure function of (n, i, round) over member *indices* 0..n-1.
Mapping indices to live peer ids as members come and go is the runtime's job;
keeping it out of here lets researchers use this package without gossiptrain.

Topologies are frozen dataclasses whose fields are their parameters (edge
probability, degree, seed, ...). The base class checks and normalises those
fields once, so `get(name, **params)`, `parse("name:k=v")` and direct
construction all reject the same bad values with the same messages.
"""

from __future__ import annotations

import functools
import operator
import os
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from topologies.cayley import Cayley

# The parameter types a spec string can carry; anything richer belongs in a file.
_SCALARS: tuple[type, ...] = (bool, int, float, str)


@dataclass(frozen=True)
class Topology(ABC):
    """A family of graphs, one per member count n (and per round when time-varying).

    Subclasses implement `_out`; the base class validates arguments and
    normalises the result, so every topology keeps the same contract: sorted,
    unique, in range, never the member itself.
    """

    name: ClassVar[str]
    # True when neighbours depend on `round` (one-peer schemes, resampled graphs).
    time_varying: ClassVar[bool] = False
    # True when j in neighbours(i) does not imply i in neighbours(j); averaging
    # schemes that need symmetric exchanges (pairwise) must symmetrize.
    directed: ClassVar[bool] = False
    # True when one member's neighbours come from a sample of the whole n x n graph (dense random graphs): asking
    # for them costs O(n^2) memory once per n.
    dense_sample: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.init:
                value = _coerce(self.name, f.name, param_types(type(self))[f.name], getattr(self, f.name))
                object.__setattr__(self, f.name, value)

    def neighbours(self, n: int, i: int, round: int = 0) -> list[int]:
        """Out-neighbours of member i among n members, ascending, without i."""
        n, round = self._check(n, round)
        i = operator.index(i)
        if not 0 <= i < n:
            raise ValueError(f"member index i={i} is outside [0, {n})")
        return self._clean(n, i, round)

    def adjacency(self, n: int, round: int = 0) -> np.ndarray:
        """Boolean (n, n) matrix with A[i, j] == (j in neighbours(n, i, round))."""
        n, round = self._check(n, round)
        a = np.zeros((n, n), dtype=bool)  # (n, n)
        for i in range(n):
            a[i, self._clean(n, i, round)] = True
        return a

    def cayley(self, n: int, round: int = 0) -> Cayley | None:
        """Round `round`'s graph on n members as a Cayley graph (`topologies.cayley`), or None when it is not one.

        Such graphs have closed-form spectra and one diameter from every
        member, so `describe` needs no n x n matrix for them.
        """
        n, round = self._check(n, round)
        return self._cayley(n, round)

    def mean_degree(self, n: int, round: int = 0) -> float:
        """Out-degree of a member on n members, on average (expected, for random graphs), without building the graph.

        For estimates (`describe_cost`); sampled from a few members unless a subclass knows it.
        """
        n, round = self._check(n, round)
        return self._mean_degree(n, round)

    def period(self, n: int) -> int:
        """Rounds after which the graphs repeat; 1 for static topologies.

        Resampled topologies never repeat; they report 1 because each round is
        an independent sample and one round is the unit that describes them.
        """
        n, _ = self._check(n, 0)
        return self._period(n)

    @property
    def fixed_n(self) -> int | None:
        """The only member count this topology is defined for, if it has one (edge-list files)."""
        return None

    @property
    def params(self) -> dict[str, Any]:
        """The parameters as passed to `get(name, **params)`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @property
    def spec(self) -> str:
        """The one-string form `parse` reads back: the name, then parameters that differ from defaults."""
        changed = [
            f"{f.name}={_render(getattr(self, f.name))}"
            for f in fields(self)
            if f.init and not (f.default is not MISSING and getattr(self, f.name) == f.default)
        ]
        return f"{self.name}:{','.join(changed)}" if changed else self.name

    def _check_peers(self, n: int) -> None:
        """Raise ValueError when the parameters cannot make a graph on n members."""

    def _period(self, n: int) -> int:
        return 1

    def _cayley(self, n: int, round: int) -> Cayley | None:
        return None

    def _mean_degree(self, n: int, round: int) -> float:
        # Subclasses that must build the whole graph to answer one member (dense random samples) override this.
        sample = range(0, n, max(1, n // 8))
        return sum(len(self._clean(n, i, round)) for i in sample) / len(sample)

    @abstractmethod
    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        """Raw out-neighbours of a valid i; may repeat or include i itself."""

    def _check(self, n: int, round: int) -> tuple[int, int]:
        n, round = _check_size(n, round)
        self._check_peers(n)
        return n, round

    def _clean(self, n: int, i: int, round: int) -> list[int]:
        # Small n makes generators collide (e.g. i-1 == i+1 on a ring of 2).
        return sorted({int(j) for j in self._out(n, i, round) if j != i})


@functools.cache
def param_types(cls: type[Topology]) -> dict[str, tuple[type, bool]]:
    """Each parameter's scalar type and whether it may be None, from the annotations."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, bool]] = {}
    for f in fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        scalar = [a for a in args if a is not type(None)]
        if len(scalar) != 1 or scalar[0] not in _SCALARS:
            raise TypeError(f"{cls.__name__}.{f.name}: parameters must be bool, int, float or str")
        out[f.name] = (scalar[0], type(None) in args)
    return out


def required_params(cls: type[Topology]) -> tuple[str, ...]:
    """Parameters without a default, which `get` must be given."""
    return tuple(f.name for f in fields(cls) if f.init and f.default is MISSING)


def parse_value(topology: str, param: str, kind: tuple[type, bool], text: str) -> Any:
    """A parameter value from its spec-string text, typed by the parameter's annotation."""
    scalar, optional = kind
    text = text.strip()
    if optional and text.lower() == "none":
        return None
    if scalar is bool:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ValueError(f"topology {topology!r}: {param} must be true or false, got {text!r}")
    if scalar is str:
        return text
    try:
        return scalar(text)
    except ValueError:
        what = "an integer" if scalar is int else "a number"
        raise ValueError(f"topology {topology!r}: {param} must be {what}, got {text!r}") from None


def _coerce(topology: str, param: str, kind: tuple[type, bool], value: Any) -> Any:
    scalar, optional = kind
    if value is None and optional:
        return value
    # bool is an int subclass; a degree of True is a bug, not a 1.
    if scalar is bool and isinstance(value, bool):
        return value
    if scalar is int and not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    if scalar is float and not isinstance(value, bool) and isinstance(value, (int, float, np.number)):
        return float(value)
    if scalar is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    what = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[scalar]
    raise ValueError(f"topology {topology!r}: {param} must be {what}, got {value!r}")


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _check_size(n: int, round: int) -> tuple[int, int]:
    n = operator.index(n)
    round = operator.index(round)
    if n < 1:
        raise ValueError(f"member count n={n} must be at least 1")
    if round < 0:
        raise ValueError(f"round={round} must be non-negative")
    return n, round
