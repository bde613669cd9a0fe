"""The user-space delay proxy (``gossiptrain.testing.delay_proxy``) that experiments/real_delay.py puts in front of members.

Bytes pass both ways in order and whole, a connection made before the
target is known waits for it, and a round trip through it takes at least
twice its delay (a lower bound: the relay sleeps that long, however fast
the machine).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from gossiptrain.testing.delay_proxy import DelayProxy

from .swarm import next_host


def echo_server(host: str) -> tuple[socket.socket, str]:
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"{host}:{srv.getsockname()[1]}"


def receive(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(1 << 20)
        assert chunk, "closed early"
        got += chunk
    return got


def test_bytes_pass_both_ways_in_order_and_a_round_trip_takes_at_least_twice_the_delay() -> None:
    srv, target = echo_server(next_host())
    with srv, DelayProxy(next_host(), 0.05) as proxy:
        with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
            proxy.set_target(target)  # after the connection came: it waited for the target
            started = time.monotonic()
            sock.sendall(b"ping")
            assert receive(sock, 4) == b"ping"
            assert time.monotonic() - started >= 0.1
            payload = bytes(range(256)) * 20_000  # 5 MB, many reads: their order must hold
            sock.sendall(payload)
            assert receive(sock, len(payload)) == payload
        assert proxy.relayed >= 2 * (4 + len(payload))


def test_with_jitter_chunks_wait_a_varying_time_and_never_overtake_and_bytes_keep_their_order() -> None:
    proxy = DelayProxy("127.0.0.1", 0.01, jitter=0.03, seed=1)  # not started: its schedule alone
    times = [proxy.release_time(0.0, 10.0) for _ in range(20)]
    assert all(10.01 <= t <= 10.04 for t in times) and len(set(times)) == 20
    assert proxy.release_time(20.0, 10.0) == 20.0  # the chunk ahead goes at 20: this one not before
    proxy.close()
    srv, target = echo_server(next_host())
    with srv, DelayProxy(next_host(), 0.01, target, jitter=0.03, seed=1) as started:
        with socket.create_connection((started.host, started.port), timeout=10) as sock:
            payload = bytes(range(256)) * 20_000  # 5 MB, many reads, each with its own wait
            sock.sendall(payload)
            assert receive(sock, len(payload)) == payload  # never reordered


def test_a_negative_delay_or_jitter_is_refused() -> None:
    with pytest.raises(ValueError, match="delay"):
        DelayProxy("127.0.0.1", -0.1)
    with pytest.raises(ValueError, match="jitter"):
        DelayProxy("127.0.0.1", 0.1, jitter=-1)
