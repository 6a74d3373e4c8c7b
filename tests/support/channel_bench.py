"""Paired benchmark: rsrv's transport client (``rsrv.transport.Channel``) against
purerpc's client, both calling the same server (rsrv's ``GrpcServer`` serving
:mod:`support.echo`'s raw-bytes UNARY echo) in another process on 127.0.0.1.

    python tests/support/channel_bench.py [--seconds 1.5] [--rounds 5] [--size 1100]

For each concurrency (1, 8, 32 callers: closed loops of trio tasks sharing one channel
/ one purerpc connection) the two clients take turns in short rounds whose order
alternates; each round's ratio is ours / purerpc in calls per second, and the median
with the lowest and highest ratio is printed (no absolute figure is asserted
anywhere). Both clients send the same bytes and receive raw bytes (purerpc gets a
message type that neither parses nor serializes), so the figure is transport cost.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rsrv.transport import ClientLimits, open_channel  # noqa: E402
from support.echo import UNARY, echo_server  # noqa: E402


class _Raw:
    """A 'message type' for purerpc that carries bytes unchanged."""

    class DESCRIPTOR:
        full_name = "rsrv.test.Raw"

    def __init__(self, data: bytes = b""):
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return self.data

    def ParseFromString(self, data: bytes) -> None:  # noqa: N802
        self.data = data


async def _loop(call, concurrency: int, seconds: float) -> tuple[float, float]:
    """(calls per second, client CPU µs per call) of ``concurrency`` closed loops."""
    done = 0
    stop = trio.current_time() + seconds
    cpu = time.process_time()

    async def worker():
        nonlocal done
        while trio.current_time() < stop:
            await call()
            done += 1

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return done / seconds, (time.process_time() - cpu) / max(done, 1) * 1e6


async def _ours(port, payload, concurrency, seconds):
    limits = ClientLimits(max_concurrent_streams=max(concurrency, 1))
    async with open_channel("127.0.0.1", port, limits=limits) as channel:

        async def call():
            result = await channel.unary(UNARY, payload)
            assert result.ok, result

        await _loop(call, concurrency, 0.2)  # warm up, connect
        return await _loop(call, concurrency, seconds)


async def _purerpc(port, payload, concurrency, seconds):
    import purerpc
    from purerpc.wrappers import (
        extract_message_from_singleton_stream,
        send_single_message_client,
    )

    request = _Raw(payload)
    async with purerpc.insecure_channel("127.0.0.1", port) as channel:
        client = purerpc.Client("rsrv.test.Echo", channel)

        async def call():
            stream = await client.rpc("Unary", _Raw, _Raw)
            await send_single_message_client(stream, request)
            response = await extract_message_from_singleton_stream(stream)
            assert len(response.data) == len(payload)

        await _loop(call, concurrency, 0.2)
        return await _loop(call, concurrency, seconds)


async def _serve(port: int) -> None:
    async with echo_server(port=port) as echo:
        print(f"READY {echo.port}", flush=True)
        await trio.sleep_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=1100, help="request/response bytes")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        trio.run(_serve, args.serve)
        return
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline().split()[1])
        payload = bytes(range(256)) * (args.size // 256) + bytes(args.size % 256)
        print(f"{args.size}-byte unary echo, {args.rounds} rounds of {args.seconds} s")
        print(
            "| callers | rsrv Channel calls/s | purerpc calls/s | ratio (min-max) "
            "| client CPU µs/call: rsrv, purerpc | CPU ratio (min-max) |"
        )
        print("|---|---|---|---|---|---|")
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            runs = {_ours: [], _purerpc: []}
            for r in range(args.rounds):
                order = [_ours, _purerpc] if r % 2 == 0 else [_purerpc, _ours]
                for client in order:
                    runs[client].append(trio.run(client, port, payload, concurrency, args.seconds))
            ours, theirs = runs[_ours], runs[_purerpc]
            rates = [a[0] / b[0] for a, b in zip(ours, theirs, strict=True)]
            cpus = [a[1] / b[1] for a, b in zip(ours, theirs, strict=True)]

            def median(values, i):
                return statistics.median(v[i] for v in values)

            print(
                f"| {concurrency} | {median(ours, 0):,.0f} | {median(theirs, 0):,.0f} | "
                f"{statistics.median(rates):.2f}x ({min(rates):.2f}-{max(rates):.2f}) | "
                f"{median(ours, 1):.0f}, {median(theirs, 1):.0f} | "
                f"{statistics.median(cpus):.2f}x ({min(cpus):.2f}-{max(cpus):.2f}) |",
                flush=True,
            )
    finally:
        server.kill()
        server.wait()
        time.sleep(0.1)


if __name__ == "__main__":
    main()
