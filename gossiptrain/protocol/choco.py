"""Per-edge references for top-k compressed neighbour averaging (CHOCO-gossip, Koloskova et al. 2019).

Top-k of a model is useless (it drops most weights); top-k of the change
since the last message is not. Each directed edge i -> j keeps a reference
``r_ij`` of i's model, identical at both ends: i sends ``C(x_i - r_ij)`` and
both ends add what it decodes to ``r_ij`` (``compression.EdgeReference``).
Mixing then uses the references instead of the models,
``x_i += gamma * sum_j w_ij (r_ji - r_ij)``; on an undirected graph with the
ends in sync the terms cancel in pairs, so the swarm's mean is kept.

Messages on an edge are numbered (``seq``): 0 is a dense reset that sets
both references to the sender's model; then 1, 2, ... A receiver that sees a
gap (a lost message) drops its reference and ignores the edge until the next
reset, which the sender sends every ``RESYNC_EVERY`` messages, to every
new neighbour, and after a refusal of one of its messages. Nothing waits,
and a lost message costs at most one resync period of that edge.
"""

from __future__ import annotations

from typing import Mapping

import torch

from gossiptrain.protocol.compression import Codec, EdgeReference, NoneCodec

#: A dense reset every this many messages on an edge bounds how long a lost message desynchronizes it.
RESYNC_EVERY = 32
#: Edges remembered in each direction (a reference is one model-sized copy).
MAX_EDGES = 64


class ChocoEdges:
    """References of one peer's edges: out (to neighbours) and in (from neighbours)."""

    def __init__(self, codec: Codec, like: Mapping[str, torch.Tensor]) -> None:
        self.codec = codec
        self.dense = NoneCodec()
        self.like = dict(like)
        self.out: dict[str, tuple[EdgeReference, int]] = {}  # neighbour -> (reference, messages since reset)
        self.inn: dict[str, EdgeReference] = {}
        self.gaps = 0  # messages dropped because an earlier one on the edge was lost

    def encode_for(self, peer: str, x: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """Wire tensors for edge (us -> peer) and their sequence number (0: a dense reset)."""
        ref, sent = self.out.get(peer, (None, 0))
        if ref is None or sent >= RESYNC_EVERY:
            snapshot = {n: t.detach().clone() for n, t in x.items()}
            self.out[peer] = (EdgeReference(snapshot), 1)
            self._trim(self.out)
            return self.dense.encode(snapshot), 0
        wire = ref.sender_encode(x, self.codec)
        self.out[peer] = (ref, sent + 1)
        return wire, ref.updates

    def receive(self, sender: str, wire: Mapping[str, torch.Tensor], seq: int) -> bool:
        """Apply a message on edge (sender -> us); False if it was dropped (a gap). ProtocolError if malformed."""
        if seq == 0:
            self.inn[sender] = EdgeReference(self.dense.decode(wire, like=self.like))
            self._trim(self.inn)
            return True
        ref = self.inn.get(sender)
        if ref is None or ref.updates != seq - 1:
            self.inn.pop(sender, None)  # out of sync until the sender's next reset
            self.gaps += 1
            return False
        ref.receiver_apply(wire, self.codec)
        return True

    def pull(self, sender: str, own: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """r_ji - r_ij for neighbour ``sender`` (our model stands in for r_ij on a one-way edge); None if unknown."""
        ref_in = self.inn.get(sender)
        if ref_in is None:
            return None
        out = self.out.get(sender)
        mine = out[0].reference if out is not None else own
        return [ref_in.reference[n] - mine[n] for n in self.like]

    def forget(self, peer: str) -> None:
        self.out.pop(peer, None)
        self.inn.pop(peer, None)

    def reset_out(self, peer: str) -> None:
        """Our next message to ``peer`` is a dense reset: one of ours did not arrive (it was refused)."""
        self.out.pop(peer, None)

    @staticmethod
    def _trim(edges: dict) -> None:  # type: ignore[type-arg]
        while len(edges) > MAX_EDGES:
            edges.pop(next(iter(edges)))
