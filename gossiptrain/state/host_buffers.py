"""Reusable exchange buffers, and the one place that knows where tensors live.

Why a pool: every exchange used to allocate its tensors afresh: a copy of
the model to send, the merge's difference, and with int8 the temporaries of
quantising (a pairwise exchange, both ends: 4 tensors per parameter, the
bytes of 4 models, without compression; 20 per parameter, the bytes of 17
models, with int8; counted as tests/test_host_buffers.py counts). On CPU
that costs little time (glibc hands freed memory back: a fresh copy of the
17 MB charlm-large and a copy into a kept buffer both took about 0.95 ms);
on CUDA the host copy for the wire would be fresh pageable memory each time,
and device-to-host copies into pageable memory are synchronous, while pinned
memory is slow to allocate. ``BufferPool`` hands out the same buffers again
once nobody uses them, so a steady stream of exchanges allocates nothing.

When a buffer is free. The transport sends tensor frames zero-copy
(``tcp.py``'s ``_push``: ``copy=False``; pyzmq keeps a reference to the
buffer until libzmq has written it to the socket), a message queued for a
destination still connecting holds its frames, an exchange in flight keeps
its snapshot, and pairwise keeps its last merge to undo. Rather than track
each of those (a ZeroMQ ``MessageTracker`` per message costs an event and a
Python object per send) or copy every frame at the wire layer (one more pass
over the model per message), the pool asks torch: a buffer is reused only
when its storage has no user besides the pool (its use count is back to what
it was when the pool made it). A buffer still on the wire, or still held by
anyone, is never overwritten: the pool makes another. The pool's size is
therefore the most buffers ever in use at once, fixed after a few exchanges.

Devices. Parameters may live anywhere; merges happen on their device. What
goes on the wire must be host memory: ``to_host`` copies device tensors
into pinned pool buffers (``non_blocking``) and synchronises once per
message, and ``to_device`` moves received tensors onto the model's device
(``non_blocking``; from ZeroMQ's pageable frames that copy is staged by
CUDA, and torch's caching allocator recycles the device memory). On CPU
both are no-ops. Nothing else in gossiptrain needs to know about devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Callable

import torch
from torch import Tensor

#: (shape, dtype, device, pinned): buffers of one key are interchangeable.
Key = tuple[tuple[int, ...], torch.dtype, torch.device, bool]

# Users of a storage, as torch counts them (every tensor viewing it counts one). Private API: without it
# no buffer is ever known free, and the pool makes a new one each time (the behaviour before the pool).
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _users(t: Tensor) -> int | None:
    """Users of ``t``'s storage; None where torch cannot say."""
    return None if _use_count is None else _use_count(t.untyped_storage()._cdata)


def wants_pinned(device: torch.device) -> bool:
    """Host copies of tensors on ``device`` go to pinned memory: only for CUDA, where it makes copies asynchronous."""
    return device.type == "cuda" and torch.cuda.is_available()


class BufferPool:
    """Tensors handed out again once nobody holds them; grows only while more are in use at once.

    Not thread-safe: one owner (an averaging machine, whose calls its driver
    serialises). Other threads may drop references to handed-out buffers at
    any time (the transport does), which only makes buffers free.
    """

    def __init__(self) -> None:
        self._buffers: dict[Key, list[tuple[Tensor, int | None]]] = {}  # key -> [(buffer, its users when idle)]
        # key -> where the next search starts: just after the buffer last handed out. Buffers come back in about
        # the order they went out, so the search usually stops at once; from the start each time, a model of
        # many same-shaped tensors (a transformer's layers) asked about every in-use buffer for every tensor.
        self._cursor: dict[Key, int] = {}
        self.made = 0  # buffers allocated so far: constant once exchanges reach a steady state
        self.nbytes = 0  # ...and their bytes

    def __len__(self) -> int:
        return sum(len(held) for held in self._buffers.values())

    def in_use(self) -> int:
        """Buffers someone holds now (a snapshot in flight, a frame ZeroMQ has not sent yet, ...)."""
        return sum(idle is None or _users(buffer) != idle for held in self._buffers.values() for buffer, idle in held)

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, *, pin: bool = False) -> Tensor:
        """An uninitialised tensor nobody else holds (a view of a pooled buffer; dropping it frees the buffer)."""
        return self._take((tuple(shape), dtype, torch.device(device), pin))

    def empty_like(self, t: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
        return self._take((tuple(t.shape), dtype or t.dtype, t.device, False))

    def like(self, tensors: Iterable[Tensor]) -> list[Tensor]:
        """Uninitialised buffers shaped as ``tensors``, on their devices."""
        return [self._take((tuple(t.shape), t.dtype, t.device, False)) for t in tensors]

    def _take(self, key: Key) -> Tensor:
        held = self._buffers.get(key)
        if held is None:
            held = self._buffers[key] = []
        count, at = len(held), self._cursor.get(key, 0)
        for _ in range(count):  # each buffer once, from the cursor round
            if at >= count:
                at = 0
            buffer, idle = held[at]
            at += 1
            if idle is not None and _users(buffer) == idle:
                self._cursor[key] = at
                return buffer.detach()  # a new view: it counts as a user until dropped
        shape, dtype, device, pin = key
        buffer = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
        held.append((buffer, _users(buffer)))
        self._cursor[key] = len(held)
        self.made += 1
        self.nbytes += buffer.numel() * buffer.element_size()
        return buffer.detach()

    def copies(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Frozen copies of ``tensors`` on their devices (a snapshot to send: the originals move on)."""
        out = self.like(tensors)
        with torch.no_grad():
            torch._foreach_copy_(out, [t.detach() for t in tensors])
        return out

    def to_host(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` in host memory for the wire: CPU tensors as they are, others copied to pinned buffers.

        The copies are asynchronous; each source device's stream is
        synchronised once at the end, so the bytes are there when the
        transport reads them (on another thread).
        """
        out: dict[str, Tensor] = {}
        devices: set[torch.device] = set()
        for name, t in tensors.items():
            if t.device.type == "cpu":
                out[name] = t
                continue
            host = self.empty(t.shape, t.dtype, torch.device("cpu"), pin=wants_pinned(t.device))
            host.copy_(t.detach(), non_blocking=True)
            out[name] = host
            devices.add(t.device)
        for device in devices:
            synchronize(device)
        return out


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device``'s current stream is done (CPU: nothing to wait for).

    Copies for the wire are queued there (``to_host``), and so are a merge's
    and a step's kernels: a timing that stops before this measured their
    launch, not their work.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the stream the work was queued on, not the whole device
    elif device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(device)


def to_device(tensors: Mapping[str, Tensor], device: torch.device | None) -> Mapping[str, Tensor]:
    """Received tensors on ``device`` (None: where they are), copied ``non_blocking``; merges then run there.

    Only dense tensors with data move: anything else (untrusted input) stays
    as it is for the codec to refuse.
    """
    if device is None or not any(_movable(t, device) for t in tensors.values()):
        return tensors  # the CPU case: received frames are used where ZeroMQ put them
    return {n: t.to(device, non_blocking=True) if _movable(t, device) else t for n, t in tensors.items()}


def _movable(t: object, device: torch.device) -> bool:
    return isinstance(t, Tensor) and t.layout is torch.strided and t.device.type != "meta" and t.device != device


def common_device(tensors: Iterable[Tensor]) -> torch.device | None:
    """The device all ``tensors`` are on, or None if they are spread over several (codecs then move each)."""
    devices = {t.device for t in tensors}
    return devices.pop() if len(devices) == 1 else None
