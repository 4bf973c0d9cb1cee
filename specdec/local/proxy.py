"""The one user-space TCP proxy for network delay and faults, used by the tests
and the benchmarks (the kernel here has no netem).

The proxy listens on a free loopback port, forwards every connection to one
upstream address, and its mode can be switched at run time from any thread:

- ``pass_through()``: bytes are forwarded as they arrive;
- ``delay(seconds, direction)``: every chunk is held for a fixed time before
  it is forwarded (added latency, order preserved; "up" = client to server,
  "down" = server to client, "both");
- ``stall()``: connections are accepted and read, but nothing is forwarded
  (held, like a network partition that TCP rides out); the held bytes go on
  when the mode changes back;
- ``drop()``: every open connection is reset and new ones are reset as soon
  as they are accepted (the peer sees a refused / reset connection).

The proxy runs an asyncio loop on its own daemon thread. An added
round-trip time of R ms is ``delay(R / 2000)`` (half each way); chunks keep
their order and are not rate-limited: it models latency, not bandwidth.
``ProxyGroup`` sets one RTT on several routes at once (the benchmarks' sweep).

    with FaultProxy("127.0.0.1", 50051) as proxy:
        address = proxy.address        # give this to the client
        proxy.delay(0.5)
        ...
        proxy.pass_through()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import struct
import threading

PASS, DELAY, STALL, DROP = "pass", "delay", "stall", "drop"
_HIGH_WATER = 1 << 20  # bytes waiting to be written before a pipe stops reading
DIRECTIONS = ("up", "down")


class _Pipe:
    """One direction of one connection: read -> hold as the mode says -> write.

    The reading task hands each chunk to ``flush``, which forwards it at once when
    nothing is held and the mode passes it; a held chunk waits in ``buffer`` and one
    timer per pipe (``call_at``) forwards it when its hold ends. No task, event or
    ``wait_for`` per chunk: the proxy stands for a network, which takes no CPU from
    the two ends, so its own work per chunk is kept small (on a 2-core machine it
    shares the cores with the services it delays)."""

    def __init__(self, proxy: FaultProxy, direction: str, reader, writer) -> None:
        self.proxy = proxy
        self.direction = direction
        self.reader = reader
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        self.buffer: collections.deque[tuple[float, bytes]] = collections.deque()
        self.eof = False
        self.timer: asyncio.TimerHandle | None = None
        self.done = self.loop.create_future()  # set once this direction is finished

    async def read_loop(self) -> None:
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.buffer.append((self.loop.time(), data))
                if self.timer is None:  # (an armed timer forwards it after those before)
                    self.flush()
                if self.writer.transport.get_write_buffer_size() > _HIGH_WATER:
                    await self.writer.drain()  # (a slow reader holds this side back)
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            self.flush()

    def flush(self) -> None:
        """Forward every held chunk whose hold has ended, in order, and arm the timer
        for the next one; forward the end of the stream once nothing is held."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.done.done():
            return
        mode = self.proxy.mode
        if mode == DROP or self.writer.is_closing():
            self.finish()
            return
        if mode == STALL:
            return
        hold = self.proxy.delays[self.direction] if mode == DELAY else 0.0
        now = self.loop.time()
        try:
            while self.buffer:
                arrived, data = self.buffer[0]
                if arrived + hold > now:
                    self.timer = self.loop.call_at(arrived + hold, self.flush)
                    return
                self.buffer.popleft()
                self.proxy.forwarded[self.direction] += len(data)
                if hold:
                    self.proxy.late.append(now - arrived - hold)
                self.writer.write(data)
            if self.eof:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                self.finish()
        except (ConnectionError, OSError, RuntimeError):
            self.finish()

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.done.done():
            self.done.set_result(None)


class _Connection:
    def __init__(self, proxy: FaultProxy, client, upstream) -> None:
        (c_reader, c_writer), (u_reader, u_writer) = client, upstream
        self.writers = (c_writer, u_writer)
        self.pipes = (
            _Pipe(proxy, "up", c_reader, u_writer),
            _Pipe(proxy, "down", u_reader, c_writer),
        )

    def wake(self) -> None:
        for pipe in self.pipes:
            pipe.flush()

    def reset(self) -> None:
        for w in self.writers:
            _reset(w)

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(p.read_loop()) for p in self.pipes]
        try:
            # Both directions finished writing (or one side went away).
            await asyncio.gather(*(p.done for p in self.pipes))
        finally:
            for t in tasks:
                t.cancel()
            for p in self.pipes:
                p.finish()
            for w in self.writers:
                with contextlib.suppress(Exception):
                    w.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), not a graceful FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """TCP proxy 127.0.0.1:<free port> -> ``host:port`` with switchable faults."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.mode = PASS
        self.delays = {"up": 0.0, "down": 0.0}
        self.accepted = 0
        self.forwarded = {"up": 0, "down": 0}
        # Seconds each held chunk was forwarded after its hold ended (the emulation's
        # own error: the loop's timer and the thread's wait for a core), newest last.
        self.late: collections.deque[float] = collections.deque(maxlen=100_000)
        self.port = 0
        self._connections: set[_Connection] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.AbstractServer | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def _run(self) -> None:
        # The proxy stands for the network, not for either end: its thread runs on
        # every core at niceness 0 whatever its creator's pin (a thread inherits its
        # creator's, and a benchmark pins its client to the draft's core at a lower
        # priority, where every forwarded chunk waited for the draft's work).
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))  # this thread only
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)  # raising it back may need CAP_SYS_NICE
        self._loop.run_forever()

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = self._call(self._start())
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _start(self) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._handle, "127.0.0.1", 0)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            self._server.close()
            for conn in list(self._connections):
                conn.reset()
            # End the connections' tasks before the loop stops (a stalled one would
            # wait on for ever, and be reported when collected on a closed loop).
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        self._call(shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def held_bytes(self) -> int:
        """Bytes read but not yet forwarded (held by a delay or a stall)."""

        async def count() -> int:
            return sum(len(d) for c in self._connections for p in c.pipes for _, d in p.buffer)

        return self._call(count())

    # ---- modes (call from any thread) -----------------------------------------------
    def pass_through(self) -> None:
        self._set(PASS)

    def delay(self, seconds: float, direction: str = "both") -> None:
        """Hold every chunk ``seconds`` before forwarding it, in ``direction``."""
        delays = {d: (seconds if direction in (d, "both") else 0.0) for d in DIRECTIONS}
        self._set(DELAY, delays)

    def stall(self) -> None:
        self._set(STALL)

    def drop(self) -> None:
        self._set(DROP)

    def _set(self, mode: str, delays: dict[str, float] | None = None) -> None:
        async def apply() -> None:
            if delays is not None:
                self.delays = delays
            self.mode = mode
            for conn in list(self._connections):
                if mode == DROP:
                    conn.reset()
                conn.wake()

        self._call(apply())

    # ---- internals -------------------------------------------------------------------
    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _handle(self, reader, writer) -> None:
        self.accepted += 1
        if self.mode == DROP:
            _reset(writer)
            return
        try:
            upstream = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(writer)
            return
        conn = _Connection(self, (reader, writer), upstream)
        self._connections.add(conn)
        try:
            await conn.run()
        except asyncio.CancelledError:
            # The proxy stopping (``stop`` cancels every task). Ended here, the task does
            # not end cancelled: asyncio's server asks a finished handler for its
            # exception, and Python 3.11 logs a cancelled one's as an error.
            pass
        finally:
            self._connections.discard(conn)


class ProxyGroup:
    """Several proxies whose added round-trip time is set together."""

    def __init__(self) -> None:
        self.proxies: list[FaultProxy] = []

    def add(self, address: str) -> str:
        """Start a proxy in front of ``host:port``; returns the address to use instead."""
        host, port = address.rsplit(":", 1)
        proxy = FaultProxy(host, int(port)).start()
        self.proxies.append(proxy)
        return proxy.address

    def set_rtt_ms(self, rtt_ms: float) -> None:
        for proxy in self.proxies:
            if rtt_ms > 0:
                proxy.delay(rtt_ms / 2000.0)
            else:
                proxy.pass_through()

    def lateness_ms(self) -> dict[str, float]:
        """How late the held chunks were forwarded since the last call: ms (median and
        90th percentile) and the count. Each hop's delay is half the RTT plus this."""
        late: list[float] = []
        for proxy in self.proxies:
            late += list(proxy.late)  # (one call: taken whole while the loop appends)
            proxy.late.clear()  # (a chunk forwarded between the two is not counted)
        late.sort()
        if not late:
            return {"median": 0.0, "p90": 0.0, "chunks": 0}
        n = len(late)
        median, p90 = late[n // 2], late[min(n - 1, n * 9 // 10)]
        return {"median": median * 1e3, "p90": p90 * 1e3, "chunks": n}

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        self.proxies.clear()
