"""The bytes of files that are all there or not there at all: the helpers checkpoints and merged models share.

Tensors go to safetensors bytes (``serialize_tensors``, after
``for_saving``), never to pickle; metadata to JSON with a checksum of its
own content (``encode_metadata``), which catches an edit that still
parses. Writing those bytes all or nothing (a temporary file, fsync,
rename; or an upload then a move on a remote store) is
``gossiptrain.state.storage``'s job.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import safetensors.torch
from torch import Tensor

from gossiptrain.errors import CheckpointError
from gossiptrain.state.local_tensors import local


def for_saving(state: Mapping[str, Any], what: str) -> dict[str, Tensor]:
    """Contiguous CPU tensors, none sharing memory (safetensors refuses shared or strided ones); a DTensor's
    local shard (a split model's checkpoint is one file per rank: ``Checkpointer.save``'s ``piece``)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, value in state.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(f"cannot checkpoint {what} entry {name!r}: a {type(value).__name__}, not a tensor")
        t = local(value).detach().to("cpu").contiguous()  # a DTensor (FSDP2): this rank's shard, never gathered
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.numel() != t.untyped_storage().nbytes() // max(t.element_size(), 1):
            t = t.clone()  # tied weights, or a view of a larger tensor
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def serialize_tensors(tensors: dict[str, Tensor], what: str) -> bytes:
    """Safetensors bytes of ``tensors`` (from ``for_saving``); CheckpointError names what cannot be stored."""
    try:
        return safetensors.torch.save(tensors, metadata={"format": "pt"})
    except (ValueError, KeyError, TypeError) as e:
        detail = f"safetensors cannot store {e.args[0]} tensors" if isinstance(e, KeyError) else str(e)  # an unknown dtype
        raise CheckpointError(f"cannot checkpoint {what}: {detail}") from None


def encode_metadata(meta: dict[str, Any]) -> bytes:
    """``meta`` as JSON, with its ``checksum`` added (see ``metadata_checksum``)."""
    body = {**meta, "checksum": metadata_checksum(meta)}
    return (json.dumps(body, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def metadata_checksum(meta: Mapping[str, Any]) -> str:
    """SHA-256 of the metadata without its checksum: catches edits that still parse (a flipped digit)."""
    rest = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
