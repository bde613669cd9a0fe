"""Adapters that make other training frameworks' loops swarm members.

``GossipCallback`` (``gossiptrain.integrations.hf``) is a Hugging Face
``transformers`` ``TrainerCallback``. It is imported on first use, so that
``import gossiptrain.integrations`` works, and stays cheap, without
transformers installed; using it then raises an ImportError that names
``pip install 'gossiptrain[hf]'``.

This layer sits at the top, beside ``cli`` and ``testing``: it uses
``gossiptrain.runtime``'s ``Peer`` and nothing below imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gossiptrain.integrations.hf import GossipCallback

_LAZY = {"GossipCallback": "gossiptrain.integrations.hf"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gossiptrain.integrations' has no attribute {name!r}")


__all__ = ["GossipCallback"]
