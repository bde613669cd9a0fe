"""One rank of a two-process Hugging Face Trainer in one swarm member (tests/test_hf_callback.py forks two)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from gossiptrain.integrations import GossipCallback

from .test_hf_callback import Tokens, trainer


def main(rank: int, port: int, join: str, out: str, steps: int) -> None:
    # What torchrun sets: the Trainer (accelerate) initialises the gloo group from it. torchrun also sets
    # OMP_NUM_THREADS=1 for each of several ranks; without it accelerate sets torch's threads to the cores per rank
    # (2 here, past the set_num_threads(1) below), and the ranks beside the test's own trainer oversubscribed the
    # machine: about one step a second (20 steps in 20 s; the peer warned of it).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    with GossipCallback(join, bind="127.0.0.1:0", wait_for_peers=2, wait_timeout=60) as gossip:
        t = trainer(Path(out).parent / f"rank{rank}", stride=1, max_steps=steps, callbacks=[gossip], ddp_backend="gloo")
        t.train()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in t.model.parameters())).hexdigest()
        peer = gossip.peer
        assert peer is not None
        Path(out).write_text(json.dumps({
            "kind": type(peer).__name__, "id": peer.id, "steps": t.state.global_step, "digest": digest,
            "exchanges": peer.stats().get("completed", 0) + peer.stats().get("served", 0),
        }))


if __name__ == "__main__":  # python -m tests.hf_ranks RANK PORT JOIN OUT STEPS
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
