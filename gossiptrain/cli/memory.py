"""Memory estimates checked up front: a command that would outgrow the machine says so and stops.

``gossiptrain topology`` (dense matrices for graphs without a closed form)
and ``gossiptrain simulate`` (every peer's model copies, and views that grow
with the swarm) estimate their peak memory before building anything and
refuse above ``--max-memory``, which defaults to the memory available now
(``MemAvailable`` in /proc/meminfo). ``--max-memory none`` goes ahead anyway.
"""

from __future__ import annotations

import argparse
import math
import os

from gossiptrain.errors import ConfigError

MAX_MEMORY_HELP = (
    "refuse up front when the estimated peak memory is above SIZE (bytes, or with K, M, G, T, powers of 1000: 500M, 64G); "
    "default: the memory available now (MemAvailable in /proc/meminfo); 'none': no check"
)
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # as the sizes this module prints


def max_memory(text: str) -> float:
    """``--max-memory``: bytes from a size such as 500M or 64G (or 64GB); infinite for 'none'. argparse type."""
    t = text.strip().upper()
    if t == "NONE":
        return math.inf
    t = t.removesuffix("B")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in _UNITS else (t, "")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 500M or 64G, nor 'none'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a size above 0 (or 'none' for no check)")
    return value


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); None where it cannot tell."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def size(n: float) -> str:
    """Bytes for people: 730 MB, 22.5 GB, 9.3 TB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def duration(seconds: float) -> str:
    """Seconds for people: 4 s, 12 min, 3.5 h, 40 days."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def check(what: str, estimate: float, limit: float | None, default: bool, fix: str) -> None:
    """ConfigError (exit 2, one line) when ``estimate`` bytes is above ``limit``.

    ``default``: the limit is the available memory (not one given with --max-memory), said so in the message.
    ``fix``: what to change first (fewer peers, another topology), before the override.
    """
    if limit is None or estimate <= limit:
        return
    against = f"the {size(limit)} available now" if default else f"--max-memory {size(limit)}"
    raise ConfigError(
        f"{what} needs about {size(estimate)} (estimated before building anything), above {against}: "
        f"{fix}; to go ahead anyway: --max-memory SIZE (or none)"
    )


def limit(args: argparse.Namespace) -> tuple[float | None, bool]:
    """The limit ``--max-memory`` sets (not given: the memory available now, None where unknown) and whether it is that default."""
    if args.max_memory is None:
        return available_memory(), True
    return args.max_memory, False
