"""Where checkpoints, merged models and metrics live: a local path, or a URL that fsspec serves.

Every file the runtime keeps (``--checkpoint-dir``, ``--resume``,
``--final-model``, ``gossiptrain export --out`` and ``--members-dir``,
``--metrics``) goes through this module, so the rest of the code never asks
which kind of store it writes to. ``location(value, what)`` turns what the
user gave into a ``Location``:

- a plain path (no ``scheme://``) is a ``pathlib.Path`` and is served by the
  local backend: today's code, with today's guarantees;
- ``scheme://...`` (``s3://``, ``gs://``, ``hdfs://``, ``file://``,
  ``memory://``, anything fsspec knows) is a ``URL`` served by fsspec. fsspec
  is an optional extra (``pip install 'gossiptrain[storage]'``) and is
  imported only when a URL is given. A URL whose scheme fsspec does not
  know, or whose backend package is missing (s3fs, gcsfs, pyarrow for HDFS),
  is a ``ConfigError`` from ``location``, which the CLI calls while parsing
  its options: before joining, not at the first save an hour later.
  Credentials come from the backend's usual sources (environment, its
  configuration files); there are no flags for them.

What "written atomically" (``write_atomic``) means for each kind of store:

- local paths: the bytes go to ``.NAME.tmp`` in the same directory, are
  flushed and fsynced, and the file is renamed over ``NAME``
  (``os.replace``); ``sync_directory`` then fsyncs the directory, so a crash
  leaves the old file or the new one, never a mix, and a completed write
  survives a power cut.
- URLs: the complete buffer is uploaded as ``.NAME.tmp`` in one call and then
  moved to ``NAME`` (``fs.mv``). On file systems (``file://``, ``hdfs://``)
  the move is a rename; on object stores (``s3://``, ``gs://``), which have no
  rename, it is a server-side copy then a delete of the temporary object,
  and an object becomes visible only once complete, so ``NAME`` is never
  seen partly written either way. There is no fsync: an upload is durable
  when the store acknowledges it; ``file://`` through fsspec does not fsync
  (give a plain path for that). A crash can leave a ``.NAME.tmp`` object
  behind; checkpoint pruning deletes those.

Files that belong together (a checkpoint's model, optimizer and metadata; a
merged model and its JSON) rely on order, not on one atomic step: the
callers write the data first and the small metadata object that names
their sizes and hashes last, and readers take only what a metadata object
names and verifies. On object stores, which are strongly consistent (S3
since 2020, GCS), a reader that lists a metadata object also reads the data
it names. Remote stores have no lock: ``lock_directory`` guards local
directories only, and one writer per URL is up to the user.

Object stores cannot append, so ``open_append`` on a URL keeps the text
in memory and uploads it (atomically, as above) at most every
``upload_every`` seconds and at ``close``: a crash loses at most that much,
and a reader always sees whole lines. The text goes in parts of about
``APPEND_PART_BYTES``: ``NAME``, then ``NAME.1``, ``NAME.2``, ...; only the
last part is held and uploaded again, so a long run's memory and uploads
stay bounded (a peer's metrics grow by about 3 MB an hour: one object for
all of them would be 73 MB, uploaded every 30 s, after a day).
``read_appended`` reads the parts back as one text. Appending to a target
that exists continues its last part, as a local file would be continued.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, TextIO

from gossiptrain.errors import ConfigError

log = logging.getLogger(__name__)

#: The suffix of a file being written (``.NAME.tmp``), so that leftovers of a crash can be recognised.
TMP_SUFFIX = ".tmp"
#: Seconds between uploads of an appended file on a URL (``open_append``): what a crash may lose.
UPLOAD_EVERY_SECONDS = 30.0
#: Bytes after which an appended file on a URL goes on in a new part (``NAME.1``, ``NAME.2``, ...): what is held
#: in memory and uploaded again at each upload.
APPEND_PART_BYTES = 4 << 20
INSTALL_HINT = "pip install 'gossiptrain[storage]'"

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")  # two letters at least: C:// is a Windows drive
# Backends whose class imports without their package and fail only when first used: checked up front.
_NEEDS = {"hdfs": "pyarrow", "arrow_hdfs": "pyarrow"}


@dataclass(frozen=True)
class URL:
    """A file or "directory" in an fsspec store: ``scheme://rest``, no trailing slash; path-like where callers need it."""

    url: str

    @property
    def _split(self) -> tuple[str, str]:
        scheme, _, rest = self.url.partition("://")
        return scheme, rest

    @property
    def name(self) -> str:
        return self._split[1].rsplit("/", 1)[-1]

    @property
    def parent(self) -> "URL":
        scheme, rest = self._split
        return URL(f"{scheme}://{rest.rsplit('/', 1)[0] if '/' in rest else ''}")

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    def with_name(self, name: str) -> "URL":
        return self.parent / name

    def with_suffix(self, suffix: str) -> "URL":
        return self.with_name(Path(self.name).with_suffix(suffix).name)

    def __truediv__(self, name: str) -> "URL":
        return URL(f"{self.url}/{name}")

    def __str__(self) -> str:
        return self.url


Location = Path | URL


def location(value: str | os.PathLike[str] | URL, what: str = "path") -> Location:
    """``value`` as a ``Path`` (plain paths) or a checked ``URL``; ConfigError, naming ``what``, for a URL fsspec cannot serve.

    Checks the scheme and that its backend package is installed; it does not
    contact the store (no credentials are needed to parse options).
    """
    if isinstance(value, URL):
        return value
    if not isinstance(value, str):
        return Path(value)  # a Path has already collapsed "//": it was meant as a local path
    m = _SCHEME.match(value)
    if m is None:
        return Path(value)
    scheme = m.group(1).lower()
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"{what} {value!r} is a URL: remote storage needs fsspec: {INSTALL_HINT}") from None
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise ConfigError(
            f"{what} {value!r}: fsspec knows no storage scheme {scheme}:// (e.g. s3://, gs://, hdfs://, file://, memory://)"
        ) from None
    except ImportError as e:
        raise ConfigError(f"{what} {value!r}: the {scheme}:// backend is not installed: {e}") from None
    needed = _NEEDS.get(scheme)
    if needed is not None and importlib.util.find_spec(needed) is None:
        raise ConfigError(f"{what} {value!r}: the {scheme}:// backend needs {needed}: pip install {needed}")
    rest = value[m.end():].rstrip("/")
    return URL(f"{scheme}://{rest}")


def check_location(value: str | os.PathLike[str] | URL | None, what: str) -> None:
    """``location``'s checks alone, for option parsing (None: not given)."""
    if value is not None:
        location(value, what)


# -- the operations, for either kind of location ------------------------------------------------------


def write_atomic(target: Location, data: bytes) -> None:
    """Write ``data`` to ``target`` all or nothing (see the module docstring); OSError if it cannot be written."""
    _backend(target).write_atomic(target, data)


def sync_directory(directory: Location) -> None:
    """Make renames in a local ``directory`` durable; nothing to do on a URL (an upload is durable once acknowledged)."""
    _backend(directory).sync_directory(directory)


def read_bytes(target: Location) -> bytes:
    """The whole file; FileNotFoundError if there is none, OSError if it cannot be read."""
    return _backend(target).read_bytes(target)


def size(target: Location) -> int:
    """The file's size in bytes; FileNotFoundError if there is none."""
    return _backend(target).size(target)


def exists(target: Location) -> bool:
    return _backend(target).exists(target)


def is_dir(target: Location) -> bool:
    """A local directory, or a URL prefix holding something (object stores have no empty directories)."""
    return _backend(target).is_dir(target)


def list_names(directory: Location) -> list[str]:
    """The names directly in ``directory``; OSError for a local one that cannot be listed, [] for an empty URL prefix."""
    return _backend(directory).list_names(directory)


def delete(target: Location) -> None:
    """Delete a file; one that is already gone is fine; OSError if it cannot be deleted."""
    _backend(target).delete(target)


def make_dirs(directory: Location) -> None:
    """Create ``directory`` and its parents where the store has directories (as ``fsspec.open`` does before writing)."""
    _backend(directory).make_dirs(directory)


class Closable(Protocol):
    def close(self) -> None: ...


class DirectoryInUse(OSError):
    """``lock_directory``: another process holds the lock; ``holder`` is what it wrote there (its pid)."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"in use (pid {holder})")
        self.holder = holder


def lock_directory(directory: Location, name: str) -> Closable:
    """Create ``directory`` and hold an exclusive lock on it until ``close()`` (local: flock on ``name``; URLs: none).

    DirectoryInUse if another process holds it, OSError if it cannot be created.
    """
    return _backend(directory).lock_directory(directory, name)


class TextAppender(Protocol):
    """Lines appended to a file: ``write`` adds text, ``close`` makes sure all of it is stored."""

    def write(self, text: str) -> None: ...

    def close(self) -> None: ...


def open_append(
    target: Location, *, upload_every: float = UPLOAD_EVERY_SECONDS, clock: Callable[[], float] = time.monotonic,
    part_bytes: int = APPEND_PART_BYTES,
) -> TextAppender:
    """Append text to ``target``, creating missing directories: a local file sees each write at once (flushed);
    a URL is uploaded at most every ``upload_every`` seconds and at close, in parts of about ``part_bytes`` (see
    the module docstring; ``read_appended`` reads them back)."""
    return _backend(target).open_append(target, upload_every, clock, part_bytes)


def read_appended(target: Location) -> bytes:
    """What ``open_append`` wrote to ``target``: a local file, or a URL's parts in order; FileNotFoundError if none."""
    return b"".join(read_bytes(part) for part in appended_parts(target))


def appended_parts(target: Location) -> list[Location]:
    """``target`` and, on a URL, its further parts (``NAME.1``, ``NAME.2``, ...) that exist; FileNotFoundError if
    ``target`` does not."""
    if not exists(target):
        raise FileNotFoundError(str(target))
    parts: list[Location] = [target]
    while isinstance(target, URL) and exists(nxt := _part(target, len(parts))):
        parts.append(nxt)
    return parts


def _part(target: URL, index: int) -> URL:
    """Part ``index`` of an appended file on a URL: the target itself, then ``NAME.1``, ``NAME.2``, ..."""
    return target if index == 0 else URL(f"{target.url}.{index}")


# -- the backends ----------------------------------------------------------------------------------


class _Local:
    """Plain paths: the os module, temporary file + fsync + rename, flock."""

    def write_atomic(self, target: Path, data: bytes) -> None:
        tmp = target.with_name(f".{target.name}{TMP_SUFFIX}")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)

    def sync_directory(self, directory: Path) -> None:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return  # a platform where directories cannot be opened
        try:
            os.fsync(fd)
        except OSError:
            pass  # some file systems refuse fsync on a directory; the renames are still atomic
        finally:
            os.close(fd)

    def read_bytes(self, target: Path) -> bytes:
        return target.read_bytes()

    def size(self, target: Path) -> int:
        return target.stat().st_size

    def exists(self, target: Path) -> bool:
        return target.exists()

    def is_dir(self, target: Path) -> bool:
        return target.is_dir()

    def list_names(self, directory: Path) -> list[str]:
        return os.listdir(directory)

    def delete(self, target: Path) -> None:
        target.unlink(missing_ok=True)

    def make_dirs(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)

    def lock_directory(self, directory: Path, name: str) -> Closable:
        directory.mkdir(parents=True, exist_ok=True)
        fh = open(directory / name, "a+")
        try:
            import fcntl
        except ImportError:  # no flock (Windows): one writer per directory is then up to the user
            return fh
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            fh.close()
            raise DirectoryInUse(holder) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        return fh  # closing the file releases its flock

    def open_append(self, target: Path, upload_every: float, clock: Callable[[], float], part_bytes: int) -> TextAppender:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _FlushedFile(open(target, "a", encoding="utf-8"))


class _FlushedFile:
    """A local file flushed after every write, so ``tail -f`` and other processes see each line at once."""

    def __init__(self, fh: TextIO) -> None:
        self._fh = fh

    def write(self, text: str) -> None:
        self._fh.write(text)
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class _Fsspec:
    """URLs: fsspec's file system for the scheme. Backend exceptions that are not OSError become OSError."""

    def write_atomic(self, target: URL, data: bytes) -> None:
        fs, path = _fs(target)
        head, sep, last = path.rpartition("/")
        tmp = f"{head}{sep}.{last}{TMP_SUFFIX}"  # beside the target, named as a local temporary file is
        _call(target, fs.pipe_file, tmp, data)  # the complete buffer, in one call
        _call(target, fs.mv, tmp, path)

    def sync_directory(self, directory: URL) -> None:
        pass

    def read_bytes(self, target: URL) -> bytes:
        fs, path = _fs(target)
        return bytes(_call(target, fs.cat_file, path))

    def size(self, target: URL) -> int:
        fs, path = _fs(target)
        n = _call(target, fs.size, path)
        if n is None:  # a backend that does not say: read it
            return len(self.read_bytes(target))
        return int(n)

    def exists(self, target: URL) -> bool:
        fs, path = _fs(target)
        return bool(_call(target, fs.exists, path))

    def is_dir(self, target: URL) -> bool:
        fs, path = _fs(target)
        return bool(_call(target, fs.isdir, path))

    def list_names(self, directory: URL) -> list[str]:
        fs, path = _fs(directory)
        fs.invalidate_cache(path)  # s3fs and gcsfs cache listings: another writer's objects must show
        try:
            entries = _call(directory, fs.ls, path, detail=False)
        except FileNotFoundError:
            return []
        mine = path.rstrip("/")
        names = []
        for entry in entries:
            entry = str(entry).rstrip("/")
            if entry != mine:  # some stores list a "directory" marker object as itself
                names.append(entry.rsplit("/", 1)[-1])
        return names

    def delete(self, target: URL) -> None:
        fs, path = _fs(target)
        try:
            _call(target, fs.rm_file, path)
        except FileNotFoundError:
            pass

    def make_dirs(self, directory: URL) -> None:
        fs, path = _fs(directory)
        _call(directory, fs.makedirs, path, exist_ok=True)

    def lock_directory(self, directory: URL, name: str) -> Closable:
        self.make_dirs(directory)
        return _NoLock()

    def open_append(self, target: URL, upload_every: float, clock: Callable[[], float], part_bytes: int) -> TextAppender:
        self.make_dirs(target.parent)
        try:
            parts = appended_parts(target)
        except FileNotFoundError:
            return _UploadedText(target, 0, "", upload_every, clock, part_bytes)
        last = parts[-1]
        assert isinstance(last, URL)
        return _UploadedText(target, len(parts) - 1, self.read_bytes(last).decode("utf-8"), upload_every, clock, part_bytes)


class _NoLock:
    def close(self) -> None:
        pass


class _UploadedText:
    """Appended text held in memory and uploaded whole, part by part: object stores cannot append.

    Only the last part is held (``_pieces``), with any full part whose
    upload failed (``_unsent``, tried again at each upload): memory and each
    upload stay within about ``part_bytes``.
    """

    def __init__(self, target: URL, index: int, text: str, upload_every: float, clock: Callable[[], float],
                 part_bytes: int) -> None:
        self.target = target
        self._index = index  # the part being written (0: the target itself)
        self._pieces = [text] if text else []
        self._size = len(text)
        self._unsent: dict[int, str] = {}  # full parts whose upload failed, by index
        self._every = upload_every
        self._part_bytes = part_bytes
        self._clock = clock
        self._last = clock()
        self._dirty = False
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            self._pieces.append(text)
            self._size += len(text)
            self._dirty = True
            if self._size >= self._part_bytes:  # this part is full: it goes once more, the next one starts
                self._unsent[self._index] = "".join(self._pieces)
                self._index, self._pieces, self._size, self._dirty = self._index + 1, [], 0, False
                self._upload(final=False)
            elif self._clock() - self._last >= self._every:
                self._upload(final=False)

    def close(self) -> None:
        with self._lock:
            if self._dirty or self._unsent:
                self._upload(final=True)

    def _upload(self, *, final: bool) -> None:
        self._last = self._clock()
        for index, text in sorted(self._unsent.items()):  # full parts first, in order
            if not self._send(index, text, final):
                return
            del self._unsent[index]
        if self._dirty:
            text = "".join(self._pieces)
            self._pieces = [text]
            if self._send(self._index, text, final):
                self._dirty = False

    def _send(self, index: int, text: str, final: bool) -> bool:
        target = _part(self.target, index)
        try:
            write_atomic(target, text.encode("utf-8"))
        except OSError as e:  # a store that hiccups must not end the run: the text is kept and sent next time
            log.log(logging.ERROR if final else logging.WARNING, "could not upload %s: %s", target, e)
            return False
        return True


_LOCAL = _Local()
_FSSPEC = _Fsspec()


def _backend(where: Location) -> Any:  # _Local for a Path, _Fsspec for a URL: the only place that tells them apart
    if isinstance(where, URL):
        return _FSSPEC
    if isinstance(where, Path):
        return _LOCAL
    raise TypeError(f"not a storage location: {where!r} (use storage.location() first)")


def _fs(url: URL) -> tuple[Any, str]:
    import fsspec.core

    try:
        fs, path = fsspec.core.url_to_fs(url.url)
    except ImportError as e:
        raise OSError(f"{url}: the {url.url.partition('://')[0]}:// backend is not installed: {e} ({INSTALL_HINT})") from None
    return fs, str(path)


def _call(url: URL, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, any backend error (botocore's, gcsfs's HttpError) as an OSError naming ``url``."""
    try:
        return fn(*args, **kwargs)
    except OSError:
        raise
    except Exception as e:
        raise OSError(f"{url}: {type(e).__name__}: {e}") from e
