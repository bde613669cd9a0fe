"""Several worker processes as one CLI peer: ``gossiptrain peer --nproc-per-peer N``, or under ``torchrun``.

``gossiptrain peer --nproc-per-peer N`` runs as rank 0 of a gloo group and
starts N-1 copies of its own command line as the other ranks (the
environment says which: ``GOSSIPTRAIN_WORKER_RANK``, ``_SIZE``, ``_INIT``),
torchrun-style; under ``torchrun`` the peer takes torchrun's own variables
instead (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so
``torchrun --nproc-per-node 2 -m gossiptrain peer --join HOST:PORT`` is one
swarm member of two workers. How the workers stay identical is
``gossiptrain.runtime.peer_group``; the training loop is
``gossiptrain.train.peer_loop``. The other ranks ignore Ctrl+C: rank 0
decides for the group, and they follow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence

from gossiptrain.errors import ConfigError, GossipError
from gossiptrain.net.addressing import free_loopback_port

RANK_ENV, SIZE_ENV, INIT_ENV = "GOSSIPTRAIN_WORKER_RANK", "GOSSIPTRAIN_WORKER_SIZE", "GOSSIPTRAIN_WORKER_INIT"
# Longest rank 0 may keep the others waiting in a collective (an evaluation, a checkpoint, the final phase)
# before gloo gives up. A worker that dies is noticed at once (its connection closes), not after this.
GROUP_TIMEOUT = timedelta(minutes=10)


class WorkerFailed(GossipError):
    """A worker of this peer failed, so the peer left the swarm."""


def why_the_group_failed(error: BaseException) -> str:
    """gloo's message of a failed collective, without its boilerplate."""
    return str(error).split(". This is typically", 1)[0].strip()


@dataclass(frozen=True)
class Workers:
    """This process's place in its peer's group: rank ``rank`` of ``size``, meeting at ``init`` (a tcp:// URL)."""

    rank: int
    size: int
    init: str

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "Workers | None":
        """Set by ``--nproc-per-peer``'s rank 0, or by torchrun; None in a plain single-worker peer."""
        try:
            if RANK_ENV in environ:
                return cls(int(environ[RANK_ENV]), int(environ[SIZE_ENV]), environ[INIT_ENV])
            if int(environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in environ:
                host = environ["MASTER_ADDR"]
                host = f"[{host}]" if ":" in host else host
                return cls(int(environ["RANK"]), int(environ["WORLD_SIZE"]), f"tcp://{host}:{environ['MASTER_PORT']}")
        except (KeyError, ValueError) as e:
            raise ConfigError(f"the worker environment is incomplete or malformed: {e}") from None
        return None

    def init_group(self) -> Any:
        """Join the group (gloo); its default process group."""
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=self.init, rank=self.rank, world_size=self.size, timeout=GROUP_TIMEOUT)
        return dist.group.WORLD


def start_other_workers(argv: Sequence[str], size: int) -> tuple[Workers, list[subprocess.Popen[bytes]]]:
    """Rank 0's side of ``--nproc-per-peer``: ranks 1..size-1 run ``argv`` (this command line) in children."""
    me = Workers(0, size, f"tcp://127.0.0.1:{free_loopback_port()}")  # the group's rendezvous, on this machine only
    children = []
    for rank in range(1, size):
        env = {**os.environ, RANK_ENV: str(rank), SIZE_ENV: str(size), INIT_ENV: me.init}
        children.append(subprocess.Popen([sys.executable, "-m", "gossiptrain", *argv], env=env, stdin=subprocess.DEVNULL))
    return me, children


def wait_for_workers(children: Sequence[subprocess.Popen[bytes]], timeout: float = 30.0) -> list[int]:
    """Their exit statuses; any still running after ``timeout`` (rank 0 is done) is terminated, then killed."""
    statuses = []
    for child in children:
        try:
            statuses.append(child.wait(timeout))
        except subprocess.TimeoutExpired:
            child.terminate()
            try:
                statuses.append(child.wait(5))
            except subprocess.TimeoutExpired:
                child.kill()
                statuses.append(child.wait())
    return statuses
