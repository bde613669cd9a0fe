"""CURVE keypairs on disk: made by `gossiptrain keys new`, read back as plain text.

A keypair is two files in ZeroMQ's certificate format (``zmq.auth``):
``NAME.key`` holds the public key, to hand to the other members (they put
it in their allow-list directory); ``NAME.key_secret`` holds both keys and
never leaves its machine (written mode 0600). Reading them parses a few
``key = "z85"`` text lines (``zmq.auth.load_certificate``): nothing is
unpickled or executed. Every problem is a ConfigError naming the file and
the setting it came from, so ``--secure`` fails at start, not at the first
connection.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from gossiptrain.config import SecurityConfig
from gossiptrain.errors import ConfigError

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
#: A peer's --join target defaults to this key in its allow-list directory.
COORDINATOR_KEY = "coordinator" + PUBLIC_SUFFIX

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class CurveKeys:
    """What a secure transport needs, loaded and checked: our keypair and the allow-list."""

    public: bytes  # our public key, z85 (40 bytes)
    secret: bytes  # our secret key, z85
    allow_dir: Path  # where the allowed public keys came from (the authenticator reads it too)
    allowed: frozenset[bytes]  # z85 public keys allowed to connect to us
    domain: str  # ZAP domain


def default_name() -> str:
    """The host name, made safe for a file name: keys from several machines then never collide."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()).strip("-.") or "member"
    return name[:100]


def new_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret (mode 0600) into ``directory``; never overwrite a key."""
    if not _NAME.fullmatch(name) or name.endswith(PUBLIC_SUFFIX):
        raise ConfigError(
            f"key name {name!r} must be 1-100 letters, digits, '_', '.' or '-', start with a letter or digit, "
            f"and not end in {PUBLIC_SUFFIX}"
        )
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create key directory {directory}: {e.strerror}") from None
    public, secret = directory / (name + PUBLIC_SUFFIX), directory / (name + SECRET_SUFFIX)
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"{path} already exists; pick another --name or remove it first (keys are never overwritten)")
    # An empty secret file with the right mode first, so the secret is never readable by others, even briefly.
    try:
        os.close(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        zmq.auth.create_certificates(directory, name)
        os.chmod(secret, 0o600)
    except OSError as e:
        raise ConfigError(f"cannot write keys into {directory}: {e.strerror}") from None
    return public, secret


def read_public_key(path: str | Path, what: str) -> bytes:
    """The public key (z85) in a NAME.key or NAME.key_secret file; ``what`` names the setting."""
    public, _ = _read(Path(path), what)
    return public


def read_keypair(path: str | Path, what: str) -> tuple[bytes, bytes]:
    """(public, secret), z85, from a NAME.key_secret file, checked to belong together."""
    path = Path(path)
    public, secret = _read(path, what)
    if secret is None:
        raise ConfigError(
            f"{what} {path} holds no secret key: give the NAME{SECRET_SUFFIX} file, not NAME{PUBLIC_SUFFIX}"
        )
    _check_key(secret, path, what, "secret")
    if zmq.curve_public(secret) != public:
        raise ConfigError(f"{what} {path}: its public and secret keys do not belong together")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s can be read by other users; run: chmod 600 %s", what, path, path)
    return public, secret


def read_allow_list(directory: str | Path, what: str) -> frozenset[bytes]:
    """The public keys of every *.key file in ``directory``; at least one, each well formed."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{what} {directory} is not a directory")
    keys = [read_public_key(p, f"{what} entry") for p in sorted(directory.glob("*" + PUBLIC_SUFFIX))]
    if not keys:
        raise ConfigError(
            f"{what} {directory} holds no public keys (*{PUBLIC_SUFFIX}): copy there the NAME{PUBLIC_SUFFIX} "
            "file of every member allowed to connect"
        )
    return frozenset(keys)


def load_curve(security: SecurityConfig) -> CurveKeys:
    """Our keypair and allow-list, checked; raises ConfigError naming the bad file."""
    public, secret = read_keypair(security.secret_key_file, "security.secret_key_file (--key)")
    allowed = read_allow_list(security.allow_dir, "security.allow_dir (--allow)")
    return CurveKeys(public, secret, security.allow_dir, allowed, security.zap_domain)


def join_server_key(security: SecurityConfig) -> bytes:
    """The public key of the member we join through: --server-key, else allow_dir/coordinator.key."""
    path = security.server_key_file
    if path is None:
        path = security.allow_dir / COORDINATOR_KEY
        if not path.is_file():
            raise ConfigError(
                f"security.server_key_file (--server-key) is not set and {path} does not exist: "
                "give the public key (NAME.key) of the coordinator or peer named by --join"
            )
    return read_public_key(path, "security.server_key_file (--server-key)")


def _read(path: Path, what: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path} is not a ZeroMQ key file ({e})") from None
    _check_key(public, path, what, "public")
    return public, secret


def _check_key(key: bytes, path: Path, what: str, kind: str) -> None:
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except Exception:  # z85 signals bad text with KeyError, ValueError or struct.error
        ok = False
    if not ok:
        raise ConfigError(f"{what} {path}: its {kind} key is not a 40-character Z85 CURVE key")
