"""`gossiptrain peer`, but a rogue member: valid parameters, scaled by GOSSIPTRAIN_TEST_POISON (tests only).

Run as ``python -m tests.rogue_peer peer --join ...``. It uses the fault
injection the simulator's rogue peers use (``Averaging.poison``), so the
runtime itself has no switch for it.
"""

from __future__ import annotations

import os
import sys

import gossiptrain.runtime.assembly as assembly  # where a peer builds its averaging machine
from gossiptrain.cli.main import main

_make = assembly.make_averaging


def _rogue(*args, **kwargs):  # type: ignore[no-untyped-def]
    averaging = _make(*args, **kwargs)
    averaging.poison = float(os.environ.get("GOSSIPTRAIN_TEST_POISON", "100"))
    return averaging


assembly.make_averaging = _rogue

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
