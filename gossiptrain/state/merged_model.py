"""The merged model: the live members' states averaged, weighted by the samples each has trained on.

This module is the arithmetic and the file, nothing else (no networking).
Getting the members' states is ``gossiptrain.runtime.swarm_client``'s job;
there are two ways. Both download each member's state through the
state-transfer protocol (``gossiptrain.protocol.state_transfer``: a snapshot at
the member's next safe point, chunked, every chunk SHA-256 checked; the
member's training never waits for it):

- ``gossiptrain export --join HOST:PORT --out FILE.safetensors``: a visitor
  (``SwarmClient``) asks the coordinator or any member who is alive
  (``query``/``roster``, see ``gossiptrain.protocol.finish``), downloads each live
  member's state in turn, merges and writes. It never joins: no member
  counts it, exchanges with it or waits for it.
- the final phase of a peer run with ``--final-model PATH``
  (``merge_members``): the same, from inside the swarm, at the end of a run.

Merging (``WeightedMean``, no I/O): floating-point tensors are averaged in
float64 with weights proportional to the samples each member has seen
(equal weights when no member reports any), then cast back to their dtype;
integer and bool tensors (counters such as batch norm's
``num_batches_tracked``) are taken from the member with the most samples.
A member that fails mid-download is skipped and named.

Writing (``write_merged``): FILE, a safetensors file of the merged tensors,
then its metadata FILE.json (``merged.safetensors`` -> ``merged.json``):
members used with their samples and steps, those skipped and why, the run's
fingerprint, and FILE's size and SHA-256. Each is written to a temporary
file, fsynced and renamed (``gossiptrain.state.storage``, as checkpoints
are), the JSON last, so a crash never leaves a metadata file naming a
partial model. FILE may be a URL (``s3://bucket/merged.safetensors``; see
``gossiptrain.state.storage``): the model object is uploaded first, each
object appears under its name only once complete, the JSON last. Reading
(``read_merged``) checks size and hash before parsing; nothing is ever
unpickled.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import safetensors.torch
import torch

from gossiptrain.errors import CheckpointError, GossipError
from gossiptrain.net.dtypes import DTYPES
from gossiptrain.state import storage
from gossiptrain.state.atomic_files import encode_metadata, for_saving, serialize_tensors
from gossiptrain.state.snapshot import Entry, entries_of, first_difference

FORMAT = "gossiptrain-merged-model"
VERSION = 1
MAX_METADATA_BYTES = 64 << 20


class NothingToMerge(GossipError):
    """The swarm was reached, but no member's state could be downloaded."""


# -- merging (no I/O) --------------------------------------------------------------------------


class WeightedMean:
    """Accumulates members' named tensors; ``result()`` is their average weighted by samples seen.

    Tensors are added one member at a time, so only the float64 sums are
    held, not every member's state. Every member must bring the same names,
    shapes and dtypes (``ValueError`` otherwise).
    """

    def __init__(self) -> None:
        self.table: tuple[Entry, ...] | None = None
        self.members = 0
        self.samples = 0
        self._weighted: dict[str, torch.Tensor] = {}  # sum of samples * x, float64
        self._plain: dict[str, torch.Tensor] | None = {}  # sum of x, while no member has reported samples
        self._exact: dict[str, tuple[int, torch.Tensor]] = {}  # integer tensors: (samples, value) of the heaviest member

    def add(self, tensors: Mapping[str, torch.Tensor], samples: int) -> None:
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        table = entries_of(tensors.items())
        if self.table is None:
            self.table = table
        elif table != self.table:
            raise ValueError(f"the tensors differ from the first member's: {first_difference(self.table, table)}")
        if samples > 0:
            self._plain = None  # from now on the weights are the samples
        for name, t in tensors.items():
            if t.is_floating_point() or t.is_complex():
                x = t.detach().to(torch.complex128 if t.is_complex() else torch.float64)
                acc = self._weighted.get(name)
                self._weighted[name] = x * samples if acc is None else acc.add_(x, alpha=samples)
                if self._plain is not None:
                    prev = self._plain.get(name)
                    self._plain[name] = x.clone() if prev is None else prev.add_(x)
            elif name not in self._exact or samples > self._exact[name][0]:
                self._exact[name] = (samples, t.detach().clone())
        self.members += 1
        self.samples += samples

    def result(self) -> dict[str, torch.Tensor]:
        """The merged tensors, in the members' order and dtypes."""
        if self.table is None:
            raise ValueError("no member's state was added")
        out: dict[str, torch.Tensor] = {}
        for name, dtype, _ in self.table:
            if name in self._exact:
                out[name] = self._exact[name][1].clone()
            elif self._plain is not None:  # nobody reported samples: the plain mean
                out[name] = (self._plain[name] / self.members).to(DTYPES[dtype])
            else:
                out[name] = (self._weighted[name] / self.samples).to(DTYPES[dtype])
        return out


# -- the file --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberInfo:
    """One member's contribution to a merged model."""

    id: str
    samples: int
    step: int
    digest: str = ""  # hash list digest of the state downloaded (state_transfer), "" for the writer's own

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "samples": self.samples, "step": self.step, "digest": self.digest}


@dataclass(frozen=True)
class MergedInfo:
    path: storage.Location  # the safetensors file (a Path, or a storage.URL)
    metadata: storage.Location  # its JSON
    sha256: str
    bytes: int
    members: tuple[MemberInfo, ...]
    skipped: tuple[tuple[str, str], ...]  # (member, why)


def metadata_path(path: str | Path | storage.URL) -> storage.Location:
    """``model.safetensors`` -> ``model.json``; any other name gets ``.json`` appended."""
    p = storage.location(path, "merged model")
    return p.with_suffix(".json") if p.suffix == ".safetensors" else p.with_name(p.name + ".json")


def write_merged(
    path: str | Path | storage.URL,
    tensors: Mapping[str, torch.Tensor],
    *,
    members: Sequence[MemberInfo],
    skipped: Sequence[tuple[str, str]] = (),
    fingerprint: str = "",
    run: Mapping[str, Any] | None = None,
    written_by: str = "",
) -> MergedInfo:
    """Write the merged model and its metadata atomically; ``CheckpointError`` if it cannot be written."""
    path = storage.location(path, "merged model")
    meta_path = metadata_path(path)
    directory = path.parent
    data = serialize_tensors(for_saving(dict(tensors), "the merged model"), "the merged model")
    digest = hashlib.sha256(data).hexdigest()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "file": path.name,
        "bytes": len(data),
        "sha256": digest,
        "fingerprint": fingerprint,
        "weights": "samples_seen",
        "samples": sum(m.samples for m in members),
        "members": [m.to_json() for m in members],
        "skipped": [{"id": mid, "reason": why} for mid, why in skipped],
        "written_by": written_by,
        "wall_time": time.time(),
        "run": dict(run) if run is not None else None,
    }
    try:
        storage.make_dirs(directory)
        storage.write_atomic(path, data)
        storage.sync_directory(directory)  # the model is durable before the metadata names it
        storage.write_atomic(meta_path, encode_metadata(meta))
        storage.sync_directory(directory)
    except OSError as e:
        raise CheckpointError(f"could not write the merged model {path}: {e.strerror or e}") from e
    return MergedInfo(path, meta_path, digest, len(data), tuple(members), tuple(skipped))


def read_merged(path: str | Path | storage.URL) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A merged model's tensors and metadata, its size and SHA-256 checked first; ``CheckpointError`` if bad."""
    path = storage.location(path, "merged model")
    meta_path = metadata_path(path)
    try:
        if storage.size(meta_path) > MAX_METADATA_BYTES:
            raise CheckpointError(f"{meta_path}: larger than a metadata file may be")
        meta = json.loads(storage.read_bytes(meta_path))
        data = storage.read_bytes(path)
    except OSError as e:
        raise CheckpointError(f"cannot read the merged model {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_path}: not a {FORMAT} version {VERSION} metadata file")
    if len(data) != meta.get("bytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{path}: its size or SHA-256 does not match {meta_path.name} (truncated or corrupt)")
    try:
        loaded = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error type for malformed input
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None
    return {k: v.clone() for k, v in loaded.items()}, meta
