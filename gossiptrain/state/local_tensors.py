"""This rank's own part of a tensor: what a rank of a split model saves, sends and writes (issue 48).

FSDP2 (``torch.distributed.fsdp.fully_shard``) makes every parameter a
``DTensor`` whose rank-local shard is ``to_local()``. Everything here that
reads or writes a rank's piece (checkpoints, the exchanges' pieces) goes
through its local tensor and never gathers: that is the point of
splitting. Detected by duck type, so that nothing imports
``torch.distributed`` unless the model uses it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (or acts as one: ``to_local`` and ``placements``)."""
    return type(t).__name__ == "DTensor" or hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: Tensor) -> Tensor:
    """``t``'s local shard if it is a DTensor, else ``t``: a view, writing it writes ``t``."""
    return t.to_local() if is_dtensor(t) else t


def like_param(value: Tensor, param: Tensor) -> Tensor:
    """``value`` (a rank's local tensor, as saved) as the optimizer state of ``param``: a DTensor laid out as
    ``param`` where ``param`` is one and ``value`` has its local shape, else ``value`` as it is (a step count)."""
    if not is_dtensor(param) or tuple(value.shape) != tuple(param.to_local().shape) or value.dim() == 0:
        return value
    from torch.distributed.tensor import DTensor

    # the global shape and stride given: with shards of unequal size (17 rows over 2 ranks) they cannot be inferred
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
