"""Topologies by name, with parameters, and the one-string specs that CLI flags and config files use.

    get("erdos-renyi", p=0.3, seed=1) == parse("erdos-renyi:p=0.3,seed=1")

A spec is ``name`` or ``name:param=value,param=value``; values are typed by
the parameter (int, float, true/false, text; ``none`` resets an optional one
to its default). Values cannot contain commas, so an edge-list path with a
comma must be passed to `get` instead. Every mistake is a ValueError
naming the topology and the parameter, so config validation can pass the
message straight to the user. `Topology.spec` writes the same form back.
"""

from __future__ import annotations

from typing import Any

from topologies.base import Topology, param_types, parse_value, required_params
from topologies.edgelist import EdgeListFile
from topologies.graphs import BaseK, Complete, Exponential, Hypercube, OnePeerExponential, Ring, Star, Torus
from topologies.random_graphs import ErdosRenyi, RandomRegular, SmallWorld

_REGISTRY: dict[str, type[Topology]] = {
    cls.name: cls
    for cls in (
        Ring,
        Torus,
        Hypercube,
        Exponential,
        Complete,
        OnePeerExponential,
        ErdosRenyi,
        RandomRegular,
        Star,
        SmallWorld,
        BaseK,
        EdgeListFile,
    )
}


def names() -> tuple[str, ...]:
    """Names accepted by `get` and `parse`, for config validation and experiment sweeps."""
    return tuple(_REGISTRY)


def parameters(name: str) -> dict[str, type]:
    """The parameters topology `name` takes, with their types (for help texts)."""
    return {param: kind for param, (kind, _) in param_types(_lookup(name)).items()}


def get(name: str, **params: Any) -> Topology:
    """Topology `name` with `params`; ValueError names an unknown topology or parameter, or a bad value."""
    cls = _lookup(name)
    known = param_types(cls)
    unknown = sorted(set(params) - set(known))
    if unknown:
        takes = f"its parameters are {', '.join(known)}" if known else "it takes no parameters"
        raise ValueError(f"topology {name!r} has no parameter {', '.join(unknown)}; {takes}")
    missing = [p for p in required_params(cls) if p not in params]
    if missing:
        raise ValueError(f"topology {name!r} needs parameter {', '.join(missing)}, e.g. {name}:{missing[0]}=...")
    return cls(**params)


def parse(spec: str) -> Topology:
    """The topology a one-string spec such as "random-regular:degree=4,seed=2" describes."""
    name, sep, rest = spec.strip().partition(":")
    name = name.strip()
    cls = _lookup(name)
    kinds = param_types(cls)
    params: dict[str, Any] = {}
    for item in rest.split(",") if sep and rest.strip() else ():
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"topology spec {spec!r}: {item.strip()!r} must look like param=value")
        if key in params:
            raise ValueError(f"topology spec {spec!r}: parameter {key} given twice")
        # Unknown keys are left for get() to report, with the list of known ones.
        params[key] = parse_value(name, key, kinds[key], text) if key in kinds else text
    return get(name, **params)


def _lookup(name: str) -> type[Topology]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; known topologies: {', '.join(names())}") from None
