"""A user-space TCP proxy that adds a fixed one-way delay to every chunk, in
each direction (the kernel here has no netem). An added round-trip time of
R ms is a one-way delay of R/2 ms. Chunks keep their order and are not
rate-limited: it models latency, not bandwidth.

  python -m benchmarks.delay_proxy --listen 127.0.0.1:60051 \\
      --upstream 127.0.0.1:50051 --delay-ms 2.5

In-process (as benchmarks.run uses it): ``DelayProxies`` runs any number of
routes on one background event loop; ``set_delay`` changes the delay of every
route at once, for connections already open too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import threading
import time

CHUNK = 1 << 16


class _Delay:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: _Delay) -> None:
    """Copy reader to writer, delivering each chunk ``delay.seconds`` after it arrived."""
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while True:
            item = await queue.get()
            if item is None:
                break
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()

    sender = asyncio.ensure_future(deliver())
    try:
        while data := await reader.read(CHUNK):
            queue.put_nowait((time.monotonic() + delay.seconds, data))
    except (ConnectionError, OSError):
        pass
    finally:
        queue.put_nowait(None)
    with contextlib.suppress(ConnectionError, OSError):
        await sender


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def start_route(
    listen_host: str, listen_port: int, upstream: str, delay: _Delay
) -> asyncio.base_events.Server:
    up_host, up_port = upstream.rsplit(":", 1)

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(up_host, int(up_port))
        except OSError:
            c_writer.close()
            return
        _nodelay(c_writer)
        _nodelay(u_writer)
        try:
            await asyncio.gather(_pump(c_reader, u_writer, delay), _pump(u_reader, c_writer, delay))
        finally:
            for w in (c_writer, u_writer):
                with contextlib.suppress(Exception):
                    w.close()

    return await asyncio.start_server(handle, listen_host, listen_port)


class DelayProxies:
    """Routes {listen port: upstream address} on a background thread's event loop."""

    def __init__(self, one_way_delay_s: float = 0.0, host: str = "127.0.0.1") -> None:
        self.host = host
        self._delay = _Delay(one_way_delay_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list = []

    def add(self, upstream: str, listen_port: int = 0) -> str:
        """Start a route to ``upstream``; returns the proxy's address."""
        fut = asyncio.run_coroutine_threadsafe(
            start_route(self.host, listen_port, upstream, self._delay), self._loop
        )
        server = fut.result(10)
        self._servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return f"{self.host}:{port}"

    def set_rtt_ms(self, rtt_ms: float) -> None:
        """Added round-trip time: half of it on each direction."""
        self._delay.seconds = rtt_ms / 2000.0

    def close(self) -> None:
        async def stop() -> None:
            for s in self._servers:
                s.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


async def _main(args: argparse.Namespace) -> None:
    host, port = args.listen.rsplit(":", 1)
    server = await start_route(host, int(port), args.upstream, _Delay(args.delay_ms / 1000.0))
    print(
        f"delay proxy {args.listen} -> {args.upstream}, {args.delay_ms} ms each way",
        flush=True,
    )
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.delay_proxy", description=__doc__)
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept connections on")
    ap.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per chunk")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
