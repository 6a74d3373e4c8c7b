"""A TCP byte relay on trio, for figure 9c: the floor of what a hop through any trio
proxy costs on this machine, with nothing of HTTP/2 or gRPC in it.

Each client connection gets its own connection upstream, and bytes pass through both
ways as they come, unparsed: two tasks per connection, each waiting for its socket to
be readable, reading what it holds and writing it on (waiting only when the other
socket is full). An HTTP/2 client sees the upstream server itself.

Usage: python benchmarks/trio_relay.py LISTEN_PORT UPSTREAM_PORT (both on 127.0.0.1).
"""

from __future__ import annotations

import os
import sys

import trio

HOST = "127.0.0.1"


async def pump(source: int, sink: int) -> None:
    """Bytes from descriptor ``source`` to ``sink`` until ``source`` ends."""
    while True:
        await trio.lowlevel.wait_readable(source)
        try:
            data = os.read(source, 256 * 1024)
        except BlockingIOError:
            continue
        except OSError:
            return
        if not data:
            return
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(sink, view) :]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sink)
            except OSError:
                return


async def relay(client: trio.SocketStream, upstream_port: int) -> None:
    try:
        upstream = await trio.open_tcp_stream(HOST, upstream_port)
    except OSError:  # the server is not there (yet): this client only is dropped
        await client.aclose()
        return
    async with client, upstream:
        a, b = client.socket.fileno(), upstream.socket.fileno()
        async with trio.open_nursery() as nursery:
            for source, sink in ((a, b), (b, a)):

                async def one_way(source=source, sink=sink) -> None:
                    await pump(source, sink)
                    nursery.cancel_scope.cancel()  # either side ended: both end

                nursery.start_soon(one_way)


def main() -> None:
    listen, upstream = int(sys.argv[1]), int(sys.argv[2])
    trio.run(lambda: trio.serve_tcp(lambda s: relay(s, upstream), listen, host=HOST))


if __name__ == "__main__":
    main()
