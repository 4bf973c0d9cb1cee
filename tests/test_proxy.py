"""The delay and fault proxy (specdec/local/proxy.py) on its own: a raw TCP echo
server behind it, no models. Fast."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from specdec.local.proxy import FaultProxy, ProxyGroup


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP echo server on loopback (a thread per connection); yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # (a stopping proxy resets its connections)
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        server.close()


def _connect(proxy: FaultProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "the connection closed early"
        out += chunk
    return bytes(out)


def test_delay_proxy_forwards_and_delays(echo: int) -> None:
    proxies = ProxyGroup()
    try:
        host, pport = proxies.add(f"127.0.0.1:{echo}").rsplit(":", 1)
        payload = bytes(range(256)) * 1000
        for rtt_ms in (0.0, 40.0):
            proxies.set_rtt_ms(rtt_ms)
            with socket.create_connection((host, int(pport))) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t0 = time.perf_counter()
                c.sendall(b"x")
                assert c.recv(1) == b"x"
                elapsed = time.perf_counter() - t0
                if rtt_ms:
                    assert elapsed >= rtt_ms / 1000 * 0.95
                c.sendall(payload)
                got = b""
                while len(got) < len(payload):
                    got += c.recv(65536)
                assert got == payload
    finally:
        proxies.close()


def test_delay_holds_every_chunk_in_order_and_counts_its_lateness(echo: int) -> None:
    group = ProxyGroup()
    try:
        group.add(f"127.0.0.1:{echo}")
        (proxy,) = group.proxies
        group.set_rtt_ms(20)  # 10 ms each way
        with _connect(proxy) as s:
            rtts = []
            for i in range(5):
                message = f"{i:04d}".encode() * 25
                t0 = time.perf_counter()
                s.sendall(message)
                assert _recv_exactly(s, len(message)) == message
                rtts.append(time.perf_counter() - t0)
            # A burst of small writes comes back whole and in order.
            burst = b"".join(f"<{i}>".encode() for i in range(300))
            for i in range(300):
                s.sendall(f"<{i}>".encode())
            assert _recv_exactly(s, len(burst)) == burst
        assert min(rtts) >= 0.020  # held at least the delay, both ways
        late = group.lateness_ms()
        assert late["chunks"] >= 10 and 0.0 <= late["median"] <= late["p90"]
        assert group.lateness_ms()["chunks"] == 0  # (counted since the last call)
    finally:
        group.close()


def test_pass_through_carries_a_large_transfer_whole(echo: int) -> None:
    payload = os.urandom(6 << 20)  # past the pipe's high-water mark: it waits to drain
    with FaultProxy("127.0.0.1", echo) as proxy, _connect(proxy) as s:
        got = bytearray()

        def read() -> None:
            got.extend(_recv_exactly(s, len(payload)))

        reader = threading.Thread(target=read)
        reader.start()
        s.sendall(payload)
        reader.join(30)
        assert bytes(got) == payload
        assert proxy.forwarded == {"up": len(payload), "down": len(payload)}


def test_stall_holds_the_bytes_until_the_mode_changes(echo: int) -> None:
    with FaultProxy("127.0.0.1", echo) as proxy, _connect(proxy) as s:
        proxy.stall()
        s.sendall(b"held")
        deadline = time.monotonic() + 5
        while proxy.held_bytes() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.held_bytes() == 4
        s.settimeout(0.2)
        with pytest.raises(TimeoutError):
            s.recv(10)
        s.settimeout(10)
        proxy.pass_through()
        assert _recv_exactly(s, 4) == b"held"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_the_proxy_thread_leaves_its_creators_pin() -> None:
    """A benchmark pins its client (and so every thread it starts) to the draft's core
    at niceness 10; the proxy, standing for the network, runs on every core."""
    every = set(range(os.cpu_count() or 1))
    seen: dict[str, object] = {}

    def create() -> None:
        os.sched_setaffinity(0, {min(every)})
        os.setpriority(os.PRIO_PROCESS, 0, 10)  # (this thread only)
        proxy = FaultProxy("127.0.0.1", 9).start()
        tid = proxy._thread.native_id
        time.sleep(0.05)
        seen["cpus"] = os.sched_getaffinity(tid)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        proxy.stop()

    t = threading.Thread(target=create)
    t.start()
    t.join(10)
    assert seen["cpus"] == every
    # Back to niceness 0 where the process may raise a priority (CAP_SYS_NICE).
    assert seen["nice"] == 0 or os.geteuid() != 0
