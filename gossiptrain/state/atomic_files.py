"""Files that are all there or not there at all: the helpers checkpoints and merged models share.

A file is written under a temporary name, flushed, fsynced and renamed
over its final name, and the directory is fsynced after the renames, so a
crash leaves either the old file or the new one, never a mix. Tensors go
to safetensors bytes (``serialize_tensors``, after ``for_saving``), never
to pickle; metadata to JSON with a checksum of its own content
(``encode_metadata``), which catches an edit that still parses.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import safetensors.torch
from torch import Tensor

from gossiptrain.errors import CheckpointError

#: The suffix of a file being written (``.NAME.tmp``), so that leftovers of a crash can be recognised.
TMP_SUFFIX = ".tmp"


def write_atomic(directory: Path, name: str, data: bytes) -> None:
    """Write ``data`` to ``directory/name`` via a temporary file: all of it or, after a crash, none of it."""
    tmp = directory / f".{name}{TMP_SUFFIX}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / name)


def fsync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the renames are still atomic
    finally:
        os.close(fd)


def for_saving(state: Mapping[str, Any], what: str) -> dict[str, Tensor]:
    """Contiguous CPU tensors, none sharing memory (safetensors refuses shared or strided ones)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, value in state.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(f"cannot checkpoint {what} entry {name!r}: a {type(value).__name__}, not a tensor")
        t = value.detach().to("cpu").contiguous()
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
