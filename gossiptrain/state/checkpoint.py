"""Checkpoints of a training peer: tensors in safetensors, everything else in JSON, written atomically.

A checkpoint is three files in one directory sharing a name
``ckpt-<seq>-step-<step>``::

    ckpt-000007-step-1234.model.safetensors   the model's state_dict (parameters and buffers)
    ckpt-000007-step-1234.optim.safetensors   the optimizer's per-parameter tensors (SGD momentum)
    ckpt-000007-step-1234.json                the rest, and the size and SHA-256 of both files above

The rest includes the averaging algorithm's own state where it has one
(``averaging``: named finite numbers, e.g. push-sum's weight), so that a
resumed peer rejoins with the mass it had (``Averaging.checkpoint_state``).

``seq`` counts saves in the directory, so "newest" means "written last"
whatever the step. Every file is written all or nothing
(``gossiptrain.state.storage.write_atomic``: locally a temporary name,
fsync, rename, then the directory is fsynced); the JSON goes last, so a
checkpoint exists only once all of its bytes are stored. A crash at any
point leaves the previous checkpoint the newest one.

The directory may be a URL (``s3://bucket/run/ckpt``, ``memory://``, ...;
see ``gossiptrain.state.storage``): there the same order holds (data
objects uploaded first, each under its final name only once complete, the
JSON object last), so a reader never takes a half-written checkpoint;
what differs is that a remote directory has no lock, so one peer per URL
is up to the user.

Reading checks sizes and hashes before parsing, so a truncated file or a
flipped byte is caught even when the file would still parse, and
``latest_good`` falls back to the previous checkpoint, naming what was
wrong. Nothing read is ever executed: no pickle, no ``torch.load``
(checkpoints may come from anyone).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import safetensors.torch
import torch
from torch import Tensor

from gossiptrain.errors import CheckpointError, ConfigError
from gossiptrain.state import storage
from gossiptrain.state.atomic_files import encode_metadata, for_saving, metadata_checksum, serialize_tensors
from gossiptrain.state.local_tensors import like_param, local
from gossiptrain.state.storage import TMP_SUFFIX, Location

log = logging.getLogger(__name__)

FORMAT = "gossiptrain-checkpoint"
VERSION = 1
MAX_METADATA_BYTES = 64 << 20  # a metadata file larger than this is refused unread

_MODEL = ".model.safetensors"
_OPTIM = ".optim.safetensors"
_META = ".json"
_TMP = TMP_SUFFIX
_LOCK = ".lock"
_COMPLETE = re.compile(r"^ckpt-(\d+)-step-(\d+)\.json$")
_OURS = re.compile(r"^\.?(ckpt-(\d+)-step-\d+)\.")  # any file a save writes, temporary ones included


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's metadata says; ``path`` is its JSON file (a ``Path``, or a ``storage.URL``)."""

    path: Location
    seq: int  # saves in this directory before this one, plus one: orders checkpoints by age
    step: int  # the peer's local step count
    samples_seen: int  # training samples consumed by those steps
    fingerprint: str  # the run (RunConfig.fingerprint) the peer was part of
    peer: str  # the peer's member id when it saved
    shard: int  # the data shard it trained (-1: none)
    wall_time: float  # time.time() at the save
    run: dict[str, Any] | None  # RunConfig.to_dict() of that run, to name differences
    files: dict[str, dict[str, Any]]  # "model"/"optimizer" -> {"file", "bytes", "sha256"}
    optimizer: dict[str, Any] | None  # class, param_groups (names, hyperparameters), state mapping
    averaging: dict[str, float] | None = None  # the averaging algorithm's scalars (push-sum weight); None: none saved
    # Leased data (gossiptrain.protocol.leases): the chunk plan and the chunks held, with the samples of each trained
    # by this step, so that --resume neither skips nor repeats them; None: a fixed shard
    data: dict[str, Any] | None = None
    # A rank of a peer whose model is split across its ranks (issue 48): {"rank": r, "layout": the group's
    # PieceLayout wire form}; its tensors are that rank's piece. None: the whole model.
    piece: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(_META)


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint, read into memory: metadata and tensors (tensors own their memory)."""

    info: CheckpointInfo
    model: dict[str, Tensor]
    optimizer: dict[str, Tensor]


class Checkpointer:
    """Writes checkpoints of one peer into ``directory`` (a path or a URL) and keeps the last ``keep``.

    Holds an exclusive lock on a local directory (``.lock``) while open, so
    two peers cannot interleave their checkpoints (remote stores have no
    lock). ``due(step)`` says when the next periodic save is wanted (every
    ``every_seconds`` and/or ``every_steps``; 0 disables either). A save
    that fails counts as the one due: the next try is the next scheduled
    one, not the next step (a full disk is not retried at every step).
    ``last_saved`` is the metadata file of the newest checkpoint this
    checkpointer wrote (None: none yet). Older checkpoints are deleted only
    after a newer one is complete.
    """

    def __init__(
        self,
        directory: str | Path | storage.URL,
        *,
        keep: int = 3,
        every_seconds: float = 0.0,
        every_steps: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if keep < 1:
            raise ConfigError(f"checkpoint keep must be >= 1, got {keep}")
        if not every_seconds >= 0 or math.isinf(every_seconds):
            raise ConfigError(f"checkpoint every_seconds must be a number >= 0, got {every_seconds}")
        if every_steps < 0:
            raise ConfigError(f"checkpoint every_steps must be >= 0, got {every_steps}")
        self.directory = storage.location(directory, "checkpoint directory")
        self.keep = keep
        self.every_seconds = every_seconds
        self.every_steps = every_steps
        self._clock = clock
        self._last_time = clock()
        self._last_step: int | None = None
        self.last_saved: Location | None = None
        self._lock: storage.Closable | None = _lock_directory(self.directory)

    # -- when ------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether a periodic save is wanted at ``step`` (the first call only sets the step baseline)."""
        if self._last_step is None:
            self._last_step = step
        if self.every_steps and step - self._last_step >= self.every_steps:
            return True
        return bool(self.every_seconds) and self._clock() - self._last_time >= self.every_seconds

    # -- saving ----------------------------------------------------------------------------

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: int,
        samples_seen: int = 0,
        fingerprint: str = "",
        peer: str = "",
        shard: int = -1,
        run: Mapping[str, Any] | None = None,
        averaging: Mapping[str, float] | None = None,
        data: Mapping[str, Any] | None = None,
        piece: Mapping[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Write one checkpoint atomically, then delete the ones beyond ``keep``; return its metadata.

        ``piece`` (a rank of a split model: ``{"rank": r, "layout": ...}``) is
        kept with it; the tensors are then that rank's (a DTensor's local shard).

        Call between optimizer steps (nothing may modify the tensors while
        they are serialized). Raises ``CheckpointError`` if it cannot be
        written; the previous checkpoints are then untouched, and the next
        periodic save is due a whole period later, as after a good one.
        """
        if self._lock is None:
            raise CheckpointError(f"the checkpointer of {self.directory} is closed")
        if step < 0 or samples_seen < 0:
            raise CheckpointError(f"step and samples_seen must be >= 0, got {step} and {samples_seen}")
        try:
            info = self._save(model, optimizer, step, samples_seen, fingerprint, peer, shard, run, averaging, data, piece)
        finally:  # done or failed, this was the save due: the next one is a period away
            self._last_time = self._clock()
            self._last_step = step
        self.last_saved = info.path
        self._prune()
        return info

    def _save(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int, samples_seen: int,
        fingerprint: str, peer: str, shard: int, run: Mapping[str, Any] | None, averaging: Mapping[str, float] | None,
        data: Mapping[str, Any] | None = None, piece: Mapping[str, Any] | None = None,
    ) -> CheckpointInfo:
        seq = _next_seq(self.directory)
        name = f"ckpt-{seq:06d}-step-{step}"
        # Everything that can be refused is done before the first byte is written.
        optim_tensors, optim_meta = _optimizer_state(model, optimizer) if optimizer is not None else ({}, None)
        blobs = {
            "model": (_MODEL, serialize_tensors(for_saving(model.state_dict(), "model"), "the model")),
            "optimizer": (_OPTIM, serialize_tensors(optim_tensors, "the optimizer state")),
        }
        run_json = _jsonable(dict(run), "run") if run is not None else None
        piece_json = _jsonable(dict(piece), "piece") if piece is not None else None
        try:
            averaging_json = _averaging_state(averaging, "averaging") if averaging is not None else None
        except TypeError as e:
            raise CheckpointError(f"cannot save the averaging state: {e}") from None
        try:
            data_json = data_position(data) if data is not None else None
        except TypeError as e:
            raise CheckpointError(f"cannot save the data position: {e}") from None
        try:
            files = {}
            for role, (suffix, data) in blobs.items():
                storage.write_atomic(self.directory / (name + suffix), data)
                files[role] = {"file": name + suffix, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            storage.sync_directory(self.directory)  # the data files are durable before the metadata names them
            meta: dict[str, Any] = {
                "format": FORMAT,
                "version": VERSION,
                "seq": seq,
                "step": int(step),
                "samples_seen": int(samples_seen),
                "fingerprint": fingerprint,
                "peer": peer,
                "shard": int(shard),
                "wall_time": time.time(),
                "run": run_json,
                "files": files,
                "optimizer": optim_meta,
                "averaging": averaging_json,
                "data": data_json,
                "piece": piece_json,
            }
            path = self.directory / (name + _META)
            storage.write_atomic(path, encode_metadata(meta))  # last: from now on it is a checkpoint
            storage.sync_directory(self.directory)
        except OSError as e:
            self._remove_files_of(name)
            raise CheckpointError(f"could not write checkpoint {name} in {self.directory}: {e.strerror or e}") from e
        return _info_from(path, meta)

    def _prune(self) -> None:
        """Delete checkpoints beyond the newest ``keep`` complete ones, and leftovers of crashed saves."""
        complete = _complete_names(self.directory)
        for name in complete[self.keep:]:
            self._remove_files_of(name)  # the metadata first: from then on it is not a checkpoint
        kept = set(complete[: self.keep])
        for entry in _listdir(self.directory):
            m = _OURS.match(entry)
            if m and (entry.startswith(".") or m.group(1) not in kept):  # left by a save that never completed
                _remove(self.directory / entry)

    def _remove_files_of(self, name: str) -> None:
        for suffix in (_META, _MODEL, _OPTIM):
            _remove(self.directory / (name + suffix))
            _remove(self.directory / f".{name}{suffix}{_TMP}")

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Release the directory lock. Idempotent."""
        if self._lock is not None:
            self._lock.close()  # closing the lock file releases its flock
            self._lock = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# -- reading -----------------------------------------------------------------------------


def list_checkpoints(directory: str | Path | storage.URL) -> list[Location]:
    """The metadata files of the complete checkpoints in ``directory``, newest first (not verified)."""
    directory = storage.location(directory, "checkpoint directory")
    return [directory / (name + _META) for name in _complete_names(directory)]


def latest_good(directory: str | Path | storage.URL) -> Checkpoint:
    """The newest checkpoint in ``directory`` (a path or a URL) that is intact: files present, hashes matching, parsing.

    Broken ones are skipped with a warning naming the file and the reason;
    if none is good, ``CheckpointError`` lists what was wrong with each.
    Only checkpoints whose JSON exists are considered, and the JSON is
    written last, so a save still in progress (or crashed) is never taken.
    """
    directory = storage.location(directory, "checkpoint directory")
    if not _is_dir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist or is not a directory")
    paths = list_checkpoints(directory)
    if not paths:
        raise CheckpointError(f"no checkpoint in {directory} (a checkpoint is complete once its .json file is written)")
    problems = []
    for path in paths:
        try:
            return read_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping a bad checkpoint: %s", e)
            problems.append(str(e))
    raise CheckpointError(f"no good checkpoint in {directory}: " + "; ".join(problems))


def read_checkpoint(path: str | Path | storage.URL) -> Checkpoint:
    """Read and verify one checkpoint from its metadata file; ``CheckpointError`` names what is wrong."""
    path = storage.location(path, "checkpoint")
    info = _read_metadata(path)
    tensors = {}
    for role in ("model", "optimizer"):
        entry = info.files[role]
        data = _read_verified(path.parent / entry["file"], entry["bytes"], entry["sha256"])
        try:
            loaded = safetensors.torch.load(data)
        except Exception as e:  # safetensors raises its own SafetensorError for any malformed input
            raise CheckpointError(f"{path.parent / entry['file']}: not a valid safetensors file: {e}") from None
        # Clone: the loaded tensors view the read-only bytes, and the optimizer will update its state in place.
        tensors[role] = {k: loaded[k].clone() for k in sorted(loaded)}
    missing = sorted(_optimizer_tensor_names(info) - tensors["optimizer"].keys())
    if missing:
        raise CheckpointError(f"{path.parent / info.files['optimizer']['file']}: lacks tensor {missing[0]!r} its metadata names")
    return Checkpoint(info, tensors["model"], tensors["optimizer"])


# -- restoring ---------------------------------------------------------------------------


def restore(
    checkpoint: Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    fingerprint: str | None = None,
    run: Mapping[str, Any] | None = None,
    allow_other_run: bool = False,
    piece: Mapping[str, Any] | None = None,
) -> None:
    """Load a checkpoint into ``model`` (in place: parameter objects stay the same) and ``optimizer``.

    ``piece``: this rank of a split model (``{"rank": r, "layout": ...}``); a
    checkpoint of another rank or layout, or of the whole model, is refused,
    naming both. Its tensors go into the rank's local ones (DTensor shards).

    Refuses, naming the first difference, a checkpoint whose tensor names,
    shapes or dtypes differ from the model's, and one of another run than
    ``fingerprint`` unless ``allow_other_run`` (then the tensors are loaded
    but the optimizer keeps its current hyperparameters: the new run's).
    ``run`` (this run's ``RunConfig.to_dict()``) lets the error name the
    differing fields. Nothing is modified when it refuses.
    """
    info = checkpoint.info
    other_run = fingerprint is not None and info.fingerprint != fingerprint
    if other_run:
        diffs = _run_diff(info.run, run)
        detail = f" ({'; '.join(diffs[:5])}{'; ...' if len(diffs) > 5 else ''})" if diffs else ""
        if not allow_other_run:
            raise CheckpointError(
                f"checkpoint {info.path} is of run {info.fingerprint or '?'}, not of this run {fingerprint}{detail}; "
                "allow another run (--resume-any-run) to load it anyway"
            )
        log.warning("loading checkpoint %s of another run %s%s", info.path, info.fingerprint, detail)
    if (info.piece or None) != (dict(piece) if piece is not None else None):
        raise CheckpointError(f"checkpoint {info.path} holds {_piece_words(info.piece)}; this is {_piece_words(piece)}")
    state = {name: local(t) for name, t in model.state_dict().items()}
    problem = _state_mismatch(checkpoint.model, state)
    if problem:
        raise CheckpointError(f"checkpoint {info.path} does not fit this model: {problem}")
    optim_state = None
    if optimizer is not None:
        if info.optimizer is None:
            raise CheckpointError(f"checkpoint {info.path} has no optimizer state")
        optim_state = _optimizer_state_dict(checkpoint, model, optimizer, keep_hyperparameters=other_run)
    if piece is None:
        model.load_state_dict(checkpoint.model, strict=True)
    else:  # into this rank's own tensors (FSDP2's load_state_dict would take whole tensors, not shards)
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(checkpoint.model[name])
    if optimizer is not None:
        optimizer.load_state_dict(optim_state)


# -- helpers: writing ----------------------------------------------------------------------


def _lock_directory(directory: Location) -> storage.Closable:
    try:
        return storage.lock_directory(directory, _LOCK)
    except storage.DirectoryInUse as e:
        raise CheckpointError(f"checkpoint directory {directory} is in use by another checkpointer (pid {e.holder})") from None
    except OSError as e:
        raise CheckpointError(f"cannot use checkpoint directory {directory}: {e.strerror or e}") from None


def _remove(path: Location) -> None:
    try:
        storage.delete(path)
    except OSError as e:
        log.warning("could not delete old checkpoint file %s: %s", path, e.strerror or e)


def _listdir(directory: Location) -> list[str]:
    try:
        return storage.list_names(directory)
    except OSError as e:
        raise CheckpointError(f"cannot list checkpoint directory {directory}: {e.strerror or e}") from None


def _is_dir(directory: Location) -> bool:
    try:
        return storage.is_dir(directory)
    except OSError as e:
        raise CheckpointError(f"cannot use checkpoint directory {directory}: {e.strerror or e}") from None


def _next_seq(directory: Location) -> int:
    seqs = [int(m.group(2)) for entry in _listdir(directory) if (m := _OURS.match(entry))]
    return max(seqs, default=0) + 1


def _complete_names(directory: Location) -> list[str]:
    found = [(int(m.group(1)), entry) for entry in _listdir(directory) if (m := _COMPLETE.match(entry))]
    return [entry.removesuffix(_META) for _, entry in sorted(found, reverse=True)]


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The optimizer's tensors (named ``<param>/<key>``) and its JSON description, by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    order: list[str] = []  # flat index (torch's optimizer state_dict numbering) -> parameter name
    groups = []
    packed = optimizer.state_dict()
    for group, packed_group in zip(optimizer.param_groups, packed["param_groups"]):
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"cannot checkpoint the optimizer: it holds a parameter of shape {list(p.shape)} "
                                      "that is not one of the model's")
            params.append(names[id(p)])
        order += params
        hyper = {k: _jsonable(v, f"optimizer hyperparameter {k!r}") for k, v in packed_group.items() if k != "params"}
        groups.append({**hyper, "params": params})
    tensors: dict[str, Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for index, values in packed["state"].items():
        pname = order[index]
        entry = state.setdefault(pname, {})
        for key, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"{pname}/{key}"] = value
                entry[key] = {"tensor": f"{pname}/{key}"}
            else:
                entry[key] = {"value": _jsonable(value, f"optimizer state {key!r} of {pname!r}")}
    meta = {"class": type(optimizer).__name__, "param_groups": groups, "state": state}
    return for_saving(tensors, "optimizer state"), meta


def _jsonable(value: Any, what: str) -> Any:
    """``value`` if JSON represents it exactly (finite numbers, strings, lists, tables), else CheckpointError."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointError(f"cannot checkpoint {what}: {value} is not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, what) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v, what) for k, v in value.items()}
    raise CheckpointError(f"cannot checkpoint {what}: a {type(value).__name__} is neither a tensor nor a JSON value")


# -- helpers: reading ----------------------------------------------------------------------


def _read_metadata(path: Location) -> CheckpointInfo:
    try:
        size = storage.size(path)
        if size > MAX_METADATA_BYTES:
            raise CheckpointError(f"{path}: {size} bytes, more than a metadata file may have ({MAX_METADATA_BYTES})")
        raw = storage.read_bytes(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON (truncated or corrupt): {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} metadata file")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {meta.get('version')!r}; this gossiptrain reads version {VERSION}")
    if meta.get("checksum") != metadata_checksum(meta):
        raise CheckpointError(f"{path}: its checksum does not match its content (corrupt)")
    try:
        info = _info_from(path, meta)
        for role in ("model", "optimizer"):
            entry = info.files[role]
            file, nbytes, digest = entry["file"], entry["bytes"], entry["sha256"]
            if not (isinstance(file, str) and Path(file).name == file and file.startswith(info.name)):
                raise ValueError(f"files.{role}.file {file!r} is not a file of this checkpoint")
            if not (isinstance(nbytes, int) and nbytes >= 0 and isinstance(digest, str) and len(digest) == 64):
                raise ValueError(f"files.{role} needs a byte count and a SHA-256")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed metadata: {e}") from None
    return info


def _info_from(path: Location, meta: Mapping[str, Any]) -> CheckpointInfo:
    def field(key: str, kind: type | tuple[type, ...]) -> Any:
        value = meta[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"{key} is {value!r}")
        return value

    optimizer = meta["optimizer"]
    if optimizer is not None and not (
        isinstance(optimizer, dict) and isinstance(optimizer.get("param_groups"), list) and isinstance(optimizer.get("state"), dict)
    ):
        raise TypeError("optimizer must have param_groups and state")
    return CheckpointInfo(
        path=path,
        seq=field("seq", int),
        step=field("step", int),
        samples_seen=field("samples_seen", int),
        fingerprint=field("fingerprint", str),
        peer=field("peer", str),
        shard=field("shard", int),
        wall_time=float(field("wall_time", (int, float))),
        run=meta["run"] if isinstance(meta["run"], dict) else None,
        files={role: dict(field("files", dict)[role]) for role in ("model", "optimizer")},
        optimizer=optimizer,
        averaging=_averaging_state(meta["averaging"], "averaging") if meta.get("averaging") is not None else None,
        data=data_position(meta["data"]) if meta.get("data") is not None else None,
        piece=meta["piece"] if isinstance(meta.get("piece"), dict) else None,
    )


def data_position(data: Any) -> dict[str, Any]:
    """A leased peer's data position: ``{"plan": [samples, chunks, seed], "held": [[chunk, trained], ...], "me":
    its member id}`` (``LeaseClient.position``), checked; TypeError naming what is wrong."""
    if not isinstance(data, Mapping):
        raise TypeError("the data position must be a mapping")
    plan, held = data.get("plan"), data.get("held")
    if not (isinstance(plan, list) and len(plan) == 3 and all(type(x) is int and x >= 0 for x in plan)):
        raise TypeError(f"the data position's plan is [samples, chunks, seed], not {plan!r:.80}")
    if not (isinstance(held, list) and len(held) <= 65_536 and all(
            isinstance(h, list) and len(h) == 2 and all(type(x) is int and x >= 0 for x in h) for h in held)):
        raise TypeError("the data position's held chunks are [[chunk, samples trained], ...]")
    me = data.get("me", "")
    if not isinstance(me, str) or len(me) > 64:
        raise TypeError("the data position's member id is a string of at most 64 characters")
    return {"plan": list(plan), "held": [list(h) for h in held], "me": me}


def _averaging_state(state: Mapping[str, Any], what: str) -> dict[str, float]:
    """Named finite numbers (the averaging algorithm's state); TypeError naming what is not."""
    if not isinstance(state, Mapping) or len(state) > 64:
        raise TypeError(f"{what} must be a mapping of at most 64 names to numbers")
    out = {}
    for key, value in state.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"{what}.{key} is {value!r}, not a finite number")
        out[key] = float(value)
    return out


def _read_verified(path: Location, nbytes: int, sha256: str) -> bytes:
    """The file's bytes, once they have the size and hash the metadata promises."""
    try:
        size = storage.size(path)
        if size != nbytes:
            raise CheckpointError(f"{path}: {size} bytes, but its metadata says {nbytes} (truncated or overwritten)")
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) != nbytes:
        raise CheckpointError(f"{path}: {len(data)} bytes read, but its metadata says {nbytes} (changing under us?)")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path}: its SHA-256 does not match its metadata (corrupt)")
    return data


def _optimizer_tensor_names(info: CheckpointInfo) -> set[str]:
    if info.optimizer is None:
        return set()
    names = set()
    for pname, values in info.optimizer["state"].items():
        if not isinstance(values, dict):
            raise CheckpointError(f"{info.path}: malformed optimizer state of {pname!r}")
        for key, ref in values.items():
            if not isinstance(ref, dict) or not ({"tensor"} == ref.keys() or {"value"} == ref.keys()):
                raise CheckpointError(f"{info.path}: malformed optimizer state {key!r} of {pname!r}")
            if "tensor" in ref:
                if not isinstance(ref["tensor"], str):
                    raise CheckpointError(f"{info.path}: malformed optimizer state {key!r} of {pname!r}")
                names.add(ref["tensor"])
    return names


# -- helpers: restoring --------------------------------------------------------------------


def _state_mismatch(saved: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> str | None:
    """The first difference in names, shapes or dtypes between a checkpoint's tensors and a model's."""
    for name, want in expected.items():
        if name not in saved:
            return f"tensor {name!r} is in the model but not in the checkpoint"
        got = saved[name]
        if list(got.shape) != list(want.shape):
            return f"tensor {name!r} has shape {list(got.shape)} in the checkpoint but {list(want.shape)} in the model"
        if got.dtype != want.dtype:
            return f"tensor {name!r} is {got.dtype} in the checkpoint but {want.dtype} in the model"
    for name in sorted(saved):
        if name not in expected:
            return f"tensor {name!r} is in the checkpoint but not in the model"
    return None


def _optimizer_state_dict(
    checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, keep_hyperparameters: bool
) -> dict[str, Any]:
    """The checkpoint's optimizer state in torch's ``state_dict`` form, checked against ``optimizer``."""
    info, saved = checkpoint.info, checkpoint.info.optimizer
    assert saved is not None
    where = f"checkpoint {info.path}"
    if saved.get("class") != type(optimizer).__name__:
        raise CheckpointError(f"{where} holds {saved.get('class')} state, but the optimizer is {type(optimizer).__name__}")
    names = {id(p): n for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{where} has {len(groups)} optimizer parameter groups, the optimizer {len(optimizer.param_groups)}")
    index: dict[str, int] = {}
    packed_groups = []
    for g, (saved_group, group) in enumerate(zip(groups, optimizer.param_groups)):
        mine = [names.get(id(p), "?") for p in group["params"]]
        theirs = saved_group.get("params") if isinstance(saved_group, dict) else None
        if not isinstance(theirs, list) or theirs != mine:
            detail = _first_list_difference(theirs if isinstance(theirs, list) else [], mine)
            raise CheckpointError(f"{where}: optimizer parameter group {g} differs: {detail}")
        ids = []
        for pname in mine:
            index[pname] = len(index)
            ids.append(index[pname])
        hyper = {k: v for k, v in group.items() if k != "params"} if keep_hyperparameters else {
            k: v for k, v in saved_group.items() if k != "params"
        }
        packed_groups.append({**hyper, "params": ids})
    state: dict[int, dict[str, Any]] = {}
    for pname, values in saved["state"].items():
        if pname not in index:
            raise CheckpointError(f"{where} has optimizer state for {pname!r}, which the optimizer does not hold")
        entry = {}
        for key, ref in values.items():
            # A copy: torch's load_state_dict keeps the tensors it is given as the live state.
            # (a rank's shard of a DTensor parameter's state becomes a DTensor laid out as the parameter)
            entry[key] = like_param(checkpoint.optimizer[ref["tensor"]].clone(), params[pname]) if "tensor" in ref else ref["value"]
        state[index[pname]] = entry
    return {"state": state, "param_groups": packed_groups}


def _piece_words(piece: Mapping[str, Any] | None) -> str:
    """What a checkpoint's ``piece`` says, in words: which rank of which layout (as ``PieceLayout.describe``
    words it), or the whole model."""
    if not piece:
        return "the whole model"
    try:
        layout = piece["layout"]
        held = ", ".join(
            f"rank {r}: {len(p)} tensors, {sum(math.prod(e[2]) for e in p):,} values" for r, p in enumerate(layout["pieces"])
        )
        return f"rank {piece['rank']}'s piece of a {layout['kind']} layout over {len(layout['pieces'])} ranks ({held})"
    except (TypeError, KeyError, IndexError):
        return f"a piece of a split model ({str(piece)[:120]})"


def _first_list_difference(theirs: list[Any], mine: list[Any]) -> str:
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            return f"parameter {i} is {a!r} in the checkpoint but {b!r} here"
    return f"{len(theirs)} parameters in the checkpoint but {len(mine)} here"


def _run_diff(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> list[str]:
    """Dotted fields that differ between two RunConfig dicts, as 'field: checkpoint's vs this run's'."""
    if not isinstance(saved, Mapping) or not isinstance(current, Mapping):
        return []
    out = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section), current.get(section)
        if not isinstance(a, Mapping) or not isinstance(b, Mapping):
            if a != b:
                out.append(f"{section}: {a!r} vs {b!r}")
            continue
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out.append(f"{section}.{key}: {a.get(key)!r} vs {b.get(key)!r}")
    return out
