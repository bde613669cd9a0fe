"""Exchange buffers: a steady stream of exchanges allocates nothing, and a buffer on the wire is never reused.

The machines are driven directly (no network) and their messages go
through the wire codec as the transport carries them: encoded to frames,
copied into the receiver's buffers, decoded. New tensor storages are
counted at the ATen dispatcher, so any tensor an exchange makes counts.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any, Callable

import pytest
import torch
import zmq
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gossiptrain.config import GossipConfig, Limits
from gossiptrain.net import wire
from gossiptrain.net.kinds import XPUSH, XREP, XREQ
from gossiptrain.protocol.averaging_events import AtSafePoint, Received
from gossiptrain.protocol.compression import Bf16Codec, Fp16Codec, Int8Codec, NoneCodec
from gossiptrain.protocol.pairwise import PairwiseAveraging
from gossiptrain.protocol.push_sum import PushSum
from gossiptrain.state.host_buffers import BufferPool, common_device, to_device, wants_pinned

LIMITS = Limits()
MIN_BYTES = 64  # smaller results are the finiteness checks' 0-d scalars; every tensor of the test models is larger


class CountStorages(TorchDispatchMode):
    """Counts tensors that ATen ops return in storage none of their inputs had, of at least ``MIN_BYTES``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _real(t)}
        for t in tree_flatten(out)[0]:
            if _real(t) and t.untyped_storage().data_ptr() not in inputs and t.untyped_storage().nbytes() >= MIN_BYTES:
                self.ops[str(func)] += 1
        return out


def _real(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "meta"


def carried(tensors: Any) -> dict[str, torch.Tensor]:
    """``tensors`` as a receiver gets them: encoded to frames, copied into its own buffers, decoded."""
    frames = wire.encode(wire.Message(XREQ, "s", "tcp://127.0.0.1:1", "", 0, {"xid": 1}, dict(tensors)), LIMITS, check=False)
    return dict(wire.decode([bytearray(f) for f in frames], LIMITS).tensors)


def model(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w1": (64, 32), "b1": (256,), "w2": (64, 64), "w3": (64, 64)}  # two of one shape
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


Exchange = Callable[[int], None]


def pairwise(codec: str, dtype: torch.dtype = torch.float32) -> tuple[Exchange, list[BufferPool]]:
    config = GossipConfig(compression=codec, exchange_timeout_min=0.5, exchange_timeout_max=4.0)
    pa, pb = model(0, dtype), model(1, dtype)
    a = PairwiseAveraging(pa, config, random.Random(0), me="A")
    b = PairwiseAveraging(pb, config, random.Random(1), me="B")
    b.handle(AtSafePoint(0, []), 0.0)

    def exchange(t: int) -> None:
        (req,) = a.handle(AtSafePoint(t, ["B"]), float(t))
        (rep,) = b.handle(Received("A", XREQ, req.xid, carried(req.tensors), t, dict(req.meta)), float(t))
        a.handle(Received("B", XREP, rep.xid, carried(rep.tensors), t, dict(rep.meta)), float(t))
        with torch.no_grad():
            for p in pa.values():
                p.add_(0.001)  # a local step
        b.handle(AtSafePoint(t, []), float(t))

    return exchange, [a.buffers, b.buffers]


def push_sum(codec: str, dtype: torch.dtype = torch.float32) -> tuple[Exchange, list[BufferPool]]:
    config = GossipConfig(algorithm="push-sum", compression=codec)
    a = PushSum(model(0, dtype), config, random.Random(0), me="A")
    b = PushSum(model(1, dtype), config, random.Random(1), me="B")

    def exchange(t: int) -> None:
        for src, dst, me, other in ((a, b, "A", "B"), (b, a, "B", "A")):
            (push,) = src.handle(AtSafePoint(t, [other]), float(t))
            dst.handle(Received(me, XPUSH, push.xid, carried(push.tensors), t, dict(push.meta)), float(t))
            src.receipts.settled(other, push.xid, float(t), receipt=True)

    return exchange, [a.buffers, b.buffers]


@pytest.mark.parametrize("codec", ["none", "int8", "fp16"])
@pytest.mark.parametrize("algorithm", [pairwise, push_sum], ids=["pairwise", "push-sum"])
def test_a_hundred_steady_state_exchanges_allocate_no_tensor_and_no_buffer(algorithm: Any, codec: str) -> None:
    exchange, pools = algorithm(codec)
    for t in range(1, 4):  # warm-up: the pools fill
        exchange(t)
    made = [p.made for p in pools]
    assert all(made)
    count = CountStorages()
    with count, torch.no_grad():
        for t in range(4, 104):
            exchange(t)
    assert dict(count.ops) == {}
    assert [p.made for p in pools] == made  # the pools' sizes stayed what warm-up made them


def test_the_counter_sees_what_an_exchange_allocated_before_the_pool() -> None:
    """The counter is not blind: the snapshot and the merge difference, as they were made before, count."""
    x, y = list(model(0).values()), list(model(1).values())
    count = CountStorages()
    with count, torch.no_grad():
        [t.clone() for t in x]  # the snapshot for the wire
        torch._foreach_sub(x, y)  # the merge's difference
        NoneCodec().encode(dict(model(2)))  # none: views, never copies
    assert count.ops["aten.clone.default"] == len(x) and count.ops["aten._foreach_sub.List"] == len(x)


def test_a_bfloat16_model_exchanges_on_its_own_dtype_without_allocating() -> None:
    exchange, pools = pairwise("none", torch.bfloat16)
    for t in range(1, 4):
        exchange(t)
    made = [p.made for p in pools]
    count = CountStorages()
    with count, torch.no_grad():
        for t in range(4, 24):
            exchange(t)
    assert dict(count.ops) == {} and [p.made for p in pools] == made
    assert all(key[1] == torch.bfloat16 for p in pools for key in p._buffers)


@pytest.mark.parametrize(
    "codec", [NoneCodec(), Fp16Codec(), Bf16Codec(), Int8Codec(), Int8Codec(stochastic=True, seed=3)], ids=lambda c: repr(c)[:24]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pooled_codecs_give_the_same_bits_as_fresh_tensors(codec: Any, dtype: torch.dtype) -> None:
    x = {n: t * 10 for n, t in model(2, dtype).items()}
    x["zero"] = torch.zeros(8, dtype=dtype)
    pool = BufferPool()
    if isinstance(codec, Int8Codec) and codec.stochastic:  # the same draws: two codecs, one seed
        fresh_codec, pooled_codec = Int8Codec(stochastic=True, seed=3), Int8Codec(stochastic=True, seed=3)
    else:
        fresh_codec = pooled_codec = codec
    for _ in range(3):  # the second and third rounds reuse the pool's buffers
        fresh, pooled = fresh_codec.encode(x), pooled_codec.encode(x, pool=pool)
        assert fresh.keys() == pooled.keys()
        for n in fresh:
            assert fresh[n].dtype == pooled[n].dtype and torch.equal(fresh[n], pooled[n]), n
        back_fresh, back_pooled = codec.decode(fresh, like=x), codec.decode(pooled, like=x, pool=pool)
        for n in back_fresh:
            assert torch.equal(back_fresh[n], back_pooled[n]), n
        del fresh, pooled, back_fresh, back_pooled


def test_a_buffer_is_handed_out_again_only_once_nobody_holds_it() -> None:
    pool = BufferPool()
    first = pool.empty((256,), torch.float32, torch.device("cpu"))
    ptr = first.data_ptr()
    frames = wire.encode(wire.Message(XREQ, "s", "tcp://127.0.0.1:1", "", 0, {}, {"w": first}), LIMITS, check=False)
    del first  # only the encoded frames hold it now, as the transport does until ZeroMQ has sent them
    second = pool.empty((256,), torch.float32, torch.device("cpu"))
    assert second.data_ptr() != ptr and pool.made == 2
    del frames, second
    third = pool.empty((256,), torch.float32, torch.device("cpu"))
    assert third.data_ptr() == ptr and pool.made == 2  # reused, nothing new
    held = third[:10]  # noqa: F841 (held: a view keeps the buffer)
    del third
    assert pool.empty((256,), torch.float32, torch.device("cpu")).data_ptr() != ptr  # a view holds it too


def test_handing_out_buffers_for_many_same_shaped_tensors_asks_about_each_buffer_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of many same-shaped tensors (a transformer's layers) costs the pool O(tensors) per copy, not O(tensors^2).

    Searching from the first buffer each time asked about every buffer still
    in use for every tensor: with 150 tensors and two older copies held (a
    snapshot in flight, the view), 45,000 questions per copy, half of an
    exchange's time for a model of 150 small tensors.
    """
    from gossiptrain.state import host_buffers

    asked = Counter[str]()
    users = host_buffers._users

    def counting(t: torch.Tensor) -> int | None:
        asked["users"] += 1
        return users(t)

    monkeypatch.setattr(host_buffers, "_users", counting)
    pool, tensors = BufferPool(), [torch.zeros(32, 32) for _ in range(150)]
    held = [pool.copies(tensors) for _ in range(3)]
    for _ in range(10):  # steady state: the oldest copy is let go, a new one taken; two stay held
        held.pop(0)
        asked.clear()
        held.append(pool.copies(tensors))
        assert pool.made == 3 * 150  # nothing new: the copy let go is reused
        assert asked["users"] <= 2 * 150, asked


def test_where_torch_cannot_count_users_the_pool_never_reuses(monkeypatch: pytest.MonkeyPatch) -> None:
    from gossiptrain.state import host_buffers

    monkeypatch.setattr(host_buffers, "_use_count", None)
    pool = BufferPool()
    first = pool.empty((256,), torch.float32, torch.device("cpu")).data_ptr()
    assert pool.empty((256,), torch.float32, torch.device("cpu")).data_ptr() != first and pool.made == 2


def test_a_zero_copy_zeromq_send_keeps_its_buffer_until_zeromq_lets_go() -> None:
    """The race the pool exists to avoid: pyzmq shares the buffer (copy=False) until libzmq has sent it."""
    pool = BufferPool()
    ctx = zmq.Context()
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        sender.bind("inproc://host-buffers")
        receiver.connect("inproc://host-buffers")
        size = 4 * zmq.COPY_THRESHOLD  # above the threshold, where pyzmq really shares the buffer
        buf = pool.empty((size,), torch.uint8, torch.device("cpu")).fill_(7)
        ptr = buf.data_ptr()
        frames = wire.encode(wire.Message(XREQ, "s", "tcp://127.0.0.1:1", "", 0, {}, {"w": buf}), LIMITS, check=False)
        sender.send_multipart(frames, copy=False)
        del frames, buf
        queued = pool.empty((size,), torch.uint8, torch.device("cpu"))
        assert queued.data_ptr() != ptr  # still in ZeroMQ's queue: not reused
        queued.fill_(9)
        got = receiver.recv_multipart(copy=False)
        assert bytes(got[1].buffer[:4]) == b"\x07" * 4  # what was sent, untouched
        del got, queued
        deadline = time.monotonic() + 5
        while pool.in_use() and time.monotonic() < deadline:  # pyzmq lets go on its own thread, soon after
            time.sleep(0.001)
        assert pool.in_use() == 0 and pool.made == 2
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        ctx.term()


def test_on_cpu_the_device_path_moves_nothing() -> None:
    cpu = torch.device("cpu")
    x = model(0)
    pool = BufferPool()
    host = pool.to_host(x)
    assert all(host[n] is x[n] for n in x) and pool.made == 0  # already host memory: no copy
    assert to_device(x, cpu) is x and to_device(x, None) is x  # received frames are merged where they are
    assert not wants_pinned(cpu)
    assert common_device(x.values()) == cpu and common_device([]) is None


def test_received_odd_tensors_are_left_for_the_codec_to_refuse() -> None:
    odd = {"w": torch.empty(3, device="meta"), "s": torch.zeros(3).to_sparse()}
    moved = to_device(odd, torch.device("cpu"))
    assert moved["w"] is odd["w"] and moved["s"] is odd["s"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_wire_gets_pinned_host_copies_and_merges_happen_on_the_device() -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    x = {n: t.to(cuda) for n, t in model(0).items()}
    pool = BufferPool()
    host = pool.to_host(x)
    assert all(t.device.type == "cpu" and t.is_pinned() and torch.equal(t, x[n].cpu()) for n, t in host.items())
    assert to_device(host, cuda)["w1"].device == cuda
    config = GossipConfig()
    a = PairwiseAveraging(x, config, random.Random(0), me="A")
    b = PairwiseAveraging({n: t.clone() + 1 for n, t in x.items()}, config, random.Random(1), me="B")
    b.handle(AtSafePoint(0, []), 0.0)
    (req,) = a.handle(AtSafePoint(1, ["B"]), 0.0)
    assert all(t.device.type == "cpu" for t in req.tensors.values())
    (rep,) = b.handle(Received("A", XREQ, req.xid, carried(req.tensors), 1, dict(req.meta)), 0.0)
    a.handle(Received("B", XREP, rep.xid, carried(rep.tensors), 1, dict(rep.meta)), 0.0)
    a.handle(AtSafePoint(2, []), 0.0)
    assert all(t.device == cuda for t in x.values())
    torch.testing.assert_close(x["w1"], (model(0)["w1"].to(cuda) * 2 + 1) / 2)
