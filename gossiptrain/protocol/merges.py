"""Merges waiting for the next safe point: ``sum_i a_i * delta_i``, in as few passes over the model as can be.

Why: on CPU the averaging arithmetic of an exchange is memory-bound, one
pass over the model per operation (a read of 17 MB costs about half a
millisecond for the 4.3M-parameter charlm-large), and the passes were most
of an exchange (``experiments/exchange.py --model``). Most safe points see
at most one merge, so the sum is kept as a list of tensors and one scale:

- the first merge since the safe point is held as it is, with its weight:
  a difference computed for it is the sum (no zeroing, no scaling pass, no
  add into a zeroed buffer);
- a second merge makes the sum a tensor of our own (one scaling pass),
  then adds to it;
- the safe point adds ``scale * terms`` to the live parameters in one pass
  and forgets the sum (no pass to zero it).

A held difference is only read: whoever computed it may keep it (pairwise
keeps its last served merge's difference to undo it). The sum's own
tensors come from the buffer pool (``gossiptrain.state.host_buffers``),
fresh after each ``clear``: ``moved()`` hands the safe point's drift
correction what was added (so it need not copy the model and subtract,
``gossiptrain.protocol.drift``), and it reads them after the driver's lock
is released, while the network side may already merge again. The pool
hands a buffer out again only once nobody holds it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from gossiptrain.state.host_buffers import BufferPool


class PendingMerges:
    """``sum_i a_i * delta_i`` over the merges made since the last safe point, shaped as the parameters."""

    def __init__(self, params: Sequence[Tensor], pool: BufferPool) -> None:
        self._params = list(params)
        self._pool = pool
        self._terms: list[Tensor] | None = None  # None: no merge since the last clear
        self._scale = 0.0
        self._owned = False  # terms are our pooled accumulator (writable), not a held difference

    @property
    def empty(self) -> bool:
        return self._terms is None

    def moved(self) -> tuple[list[Tensor], float]:
        """``(terms, scale)``: the sum is ``scale * terms`` (no terms: nothing). Read only; valid until the next call."""
        return ([], 0.0) if self._terms is None else (self._terms, self._scale)

    def add(self, delta: Sequence[Tensor], a: float) -> None:
        """``sum += a * delta``. The first merge holds ``delta`` itself until ``clear``: never write to it after."""
        if self._terms is None:
            self._terms, self._scale = list(delta), a
            return
        with torch.no_grad():
            torch._foreach_add_(self._materialised(), list(delta), alpha=a)

    def difference(self, remote: Sequence[Tensor], own: Sequence[Tensor]) -> list[Tensor]:
        """``remote - own`` in a pooled buffer, one pass (a merge's difference, to ``add`` and keep for an undo)."""
        delta = self._pool.like(self._params)
        with torch.no_grad():
            for d, r, o in zip(delta, remote, own, strict=True):
                torch.sub(r, o, out=d)
        return delta

    def add_difference(self, remote: Sequence[Tensor], own: Sequence[Tensor], a: float) -> None:
        """``sum += a * (remote - own)``: one pass when the sum is empty (the difference becomes it), two else."""
        delta = self.difference(remote, own)
        if self._terms is None:
            self._terms, self._scale, self._owned = delta, a, True  # nobody else holds it: ours to write
            return
        with torch.no_grad():
            torch._foreach_add_(self._materialised(), delta, alpha=a)

    def add_to(self, out: Sequence[Tensor]) -> None:
        """``out += sum``, in one pass (nothing when empty)."""
        if self._terms is not None:
            with torch.no_grad():
                torch._foreach_add_(list(out), self._terms, alpha=self._scale)

    def plus(self, base: Sequence[Tensor], out: Sequence[Tensor]) -> None:
        """``out = base + sum``, in one pass."""
        with torch.no_grad():
            if self._terms is None:
                torch._foreach_copy_(list(out), list(base))
                return
            for v, b, t in zip(out, base, self._terms, strict=True):
                torch.add(b, t, alpha=self._scale, out=v)

    def clear(self) -> None:
        """Forget the sum (the safe point added it): no pass, and a held difference is let go."""
        self._terms, self._scale, self._owned = None, 0.0, False

    def values(self) -> list[Tensor]:
        """The sum as new tensors (zeros when empty): for inspection and tests, not the exchange's path; changes nothing."""
        if self._terms is None:
            return [torch.zeros_like(p) for p in self._params]
        with torch.no_grad():
            return [t * self._scale for t in self._terms]

    def _materialised(self) -> list[Tensor]:
        """The sum in our own accumulator with scale 1 (one pass when it was a held difference or scaled)."""
        terms = self._terms
        assert terms is not None
        if not self._owned:
            acc = self._pool.like(self._params)
            for d, t in zip(acc, terms, strict=True):
                torch.mul(t, self._scale, out=d)
            terms, self._owned = acc, True
        elif self._scale != 1.0:
            torch._foreach_mul_(terms, self._scale)
        self._terms, self._scale = terms, 1.0
        return terms
