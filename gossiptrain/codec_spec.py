"""Codec specs ("int8:stochastic=1", "topk:ratio=0.1") parsed and checked without torch.

The config validates ``gossip.compression`` with this at construction, and
``gossiptrain.protocol.compression.get_codec`` builds the codec from the same
parse, so a spec the config accepts always builds and the two can never
disagree on what a parameter means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from gossiptrain.errors import ConfigError

#: Every codec by name, in the order users read them.
CODECS: tuple[str, ...] = ("auto", "none", "fp16", "bf16", "int8", "topk")


@dataclass(frozen=True)
class CodecSpec:
    """A parsed spec: the codec's name and its typed parameters (defaults filled in)."""

    name: str
    params: dict[str, bool | int | float] = field(default_factory=dict)


def _parse_bool(text: str, what: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what} must be a boolean (1/0, true/false), got {text!r}")


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what} must be an integer, got {text!r}") from None


def _parse_ratio(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{what} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{what} must be finite, got {text!r}")
    if not 0 < value <= 1:
        raise ConfigError(f"{what} must be in (0, 1], got {value}")
    return value


#: Each codec's parameters: name -> (parser, default text).
_PARAMS: dict[str, dict[str, tuple[Callable[[str, str], bool | int | float], str]]] = {
    "auto": {},  # none, fp16 or int8, as the link calls for (gossiptrain.protocol.auto_compression)
    "none": {},
    "fp16": {},
    "bf16": {},
    "int8": {"stochastic": (_parse_bool, "0"), "seed": (_parse_int, "0")},
    "topk": {"ratio": (_parse_ratio, "0.01")},
}


def parse_codec_spec(spec: object, field: str = "compression") -> CodecSpec:
    """Parse ``name[:key=value,...]``; ConfigError names ``field`` and what is wrong."""
    if not isinstance(spec, str):
        raise ConfigError(f"{field} must be a codec spec string, got {type(spec).__name__}")
    name, colon, rest = spec.strip().partition(":")
    if name not in CODECS:
        raise ConfigError(f"{field} names unknown codec {name!r}; choose from {', '.join(CODECS)}")
    given: dict[str, str] = {}
    if colon:
        for item in rest.split(","):
            key, eq, value = (s.strip() for s in item.partition("="))
            if not key or not eq or not value:
                raise ConfigError(f"{field}: codec parameter {item.strip()!r} is not key=value")
            if key in given:
                raise ConfigError(f"{field}: codec parameter {key!r} given twice")
            given[key] = value
    allowed = _PARAMS[name]
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        takes = f"takes {', '.join(allowed)}" if allowed else "takes no parameters"
        raise ConfigError(f"{field}: codec {name!r} {takes}, not {', '.join(unknown)}")
    params = {
        key: parse(given.get(key, default), f"{field} {name} {key}") for key, (parse, default) in allowed.items()
    }
    return CodecSpec(name, params)
