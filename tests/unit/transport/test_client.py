"""The transport's client: ``Channel`` against rsrv's own ``GrpcServer`` in this trio
loop (support.echo), and a ``ClientConnection`` fed server frames one by one for what
a polite server never sends (GOAWAY below a stream, REFUSED_STREAM, compressed
responses, HTTP errors)."""

from __future__ import annotations

import functools
import gzip
import os
import socket
import ssl
import struct
from functools import partial

import hpack
import pytest
import trio
import trustme
from purerpc.grpclib.status import StatusCode
from support.echo import (
    FAIL,
    HEADERS,
    HOLD,
    SIZED,
    SLEEP,
    STREAM,
    UNARY,
    echo_server,
    wait_for,
)
from support.rawh2 import RawH2
from support.rawserver import raw_server

from rsrv.transport import (
    TLS_ERRORS,
    CallEnded,
    Channel,
    ClientLimits,
    GrpcServer,
    MessageError,
    MessageTooLarge,
    Method,
    TransportLimits,
    client_tls_context,
    grpc_timeout,
    open_channel,
    server_tls_context,
)
from rsrv.transport import _frames as F
from rsrv.transport._client import ClientConnection, _parse_headers, connect

MIB = 1 << 20


async def test_unary_answers_and_statuses():
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        result = await channel.unary(UNARY, b"hello")
        assert (result.status, result.response, result.reached_server) == (
            StatusCode.OK,
            b"hello",
            True,
        )
        assert (await channel.unary(UNARY, b"")).response == b""
        failed = await channel.unary(FAIL, "5:no such thing: 100% ünïcode".encode())
        assert failed.status is StatusCode.NOT_FOUND
        assert failed.message == "no such thing: 100% ünïcode"  # percent-decoded
        assert failed.response is None and failed.reached_server
        missing = await channel.unary("/rsrv.test.Echo/Nope", b"")
        assert missing.status is StatusCode.UNIMPLEMENTED


async def test_trailers_of_a_failure_reach_the_client():
    def trailers_of(e: BaseException):
        return (("x-failure", type(e).__name__),)

    async with (
        echo_server(trailers_of=trailers_of) as echo,
        open_channel("127.0.0.1", echo.port) as channel,
    ):
        failed = await channel.unary(FAIL, b"14:busy")  # trailers-only
        assert failed.status is StatusCode.UNAVAILABLE
        assert failed.trailers == (("x-failure", "MessageError"),)
        ok = await channel.unary(UNARY, b"fine")
        assert ok.ok and ok.trailers == ()


async def test_an_exception_in_the_block_comes_out_as_itself():
    async with echo_server() as echo:
        with pytest.raises(KeyError, match="mine"):
            async with open_channel("127.0.0.1", echo.port) as channel:
                assert (await channel.unary(UNARY, b"")).ok
                raise KeyError("mine")


async def test_metadata_and_grpc_timeout_reach_the_server():
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        plain = await channel.unary(HEADERS, b"")
        assert plain.response.decode().splitlines() == ["user-agent=rsrv-channel/1", "deadline=no"]
        sent = await channel.unary(
            HEADERS, b"", metadata=[("X-Tenant", "a"), ("admin-key", "k")], timeout=30
        )
        assert sent.response.decode().splitlines() == [
            "admin-key=k",
            "user-agent=rsrv-channel/1",
            "x-tenant=a",
            "deadline=yes",
        ]


async def test_a_handler_sees_the_size_of_the_message_it_was_sent():
    """``received_bytes`` (as inflated): how the inference service tells a large request
    without reading it."""
    sizes = []

    async def handler(message, call):
        sizes.append(call.received_bytes)
        return message

    server = GrpcServer([Method("/t.T/Size", handler, bytes, bytes)], "127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        async with open_channel("127.0.0.1", port) as channel:
            for payload in (b"", b"x" * 1000):
                assert (await channel.unary("/t.T/Size", payload, timeout=5)).ok
        await server.close(timeout=1)
        nursery.cancel_scope.cancel()
    assert sizes == [0, 1000]


def test_grpc_timeout_values():
    assert grpc_timeout(0.25) == b"250000u"
    assert grpc_timeout(5) == b"5000000u"
    assert grpc_timeout(1000) == b"1000000m"
    assert grpc_timeout(10**6) == b"1000000S"
    assert grpc_timeout(0) == b"1u"
    assert grpc_timeout(-1) == b"1u"


async def test_deadline_resets_the_stream_on_the_server():
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        result = await channel.unary(SLEEP, b"", timeout=0.2)
        assert result.status is StatusCode.DEADLINE_EXCEEDED
        assert result.reached_server
        await wait_for(lambda: echo.cancelled == 1 and echo.active == 0, "the handler cancelled")
        assert (await channel.unary(UNARY, b"after")).response == b"after"


async def test_cancelling_the_caller_resets_the_stream():
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.unary, SLEEP, b"")
            await wait_for(lambda: echo.active == 1, "the call to start")
            nursery.cancel_scope.cancel()
        await wait_for(lambda: echo.cancelled == 1, "the server to see the reset")
        assert not channel.connections[0].streams
        assert (await channel.unary(UNARY, b"x")).ok


async def test_concurrency_cap_queues_callers():
    limits = ClientLimits(max_concurrent_streams=3)
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port, limits=limits) as ch:
        results = []

        async def call():
            results.append(await ch.unary(HOLD, b""))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(call)
            await wait_for(lambda: echo.active == 3, "three calls in flight")
            await trio.sleep(0.05)  # queued callers stay queued
            assert echo.started == 3
            echo.release.set()
        assert [r.response for r in results] == [b"held"] * 8
        assert echo.max_active == 3


async def test_an_uncapped_call_does_not_queue_behind_the_capped_ones():
    limits = ClientLimits(max_concurrent_streams=1)
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port, limits=limits) as ch:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ch.unary, HOLD, b"")
            await wait_for(lambda: echo.active == 1, "the call holding the one slot")
            queued = await ch.unary(UNARY, b"capped", timeout=0.1)
            assert (queued.status, queued.reached_server) == (StatusCode.DEADLINE_EXCEEDED, False)
            probe = await ch.unary(UNARY, b"probe", timeout=5, capped=False)
            assert probe.response == b"probe"
            echo.release.set()
    # Every connection full at the server's stream limit: a spare one is opened for it,
    # which capped calls never use (max_connections holds for them) and which does not
    # count as a connection opened to the server (a restart, to the gateway).
    limits = ClientLimits(max_concurrent_streams=6, max_connections=2)
    async with (
        echo_server(limits=TransportLimits(max_streams_per_connection=2)) as echo,
        open_channel("127.0.0.1", echo.port, limits=limits) as ch,
    ):
        async with trio.open_nursery() as nursery:
            for _ in range(6):  # two of them wait for room
                nursery.start_soon(ch.unary, HOLD, b"")
            await wait_for(lambda: echo.active == 4, "four calls on two full connections")
            async with trio.open_nursery() as probes:  # at once: one opened, not one each
                for _ in range(2):
                    probes.start_soon(functools.partial(ch.unary, UNARY, b"probe", capped=False))
            for _ in range(3):  # one spare connection, apart from the pool, for them all
                probe = await ch.unary(UNARY, b"probe", timeout=5, capped=False)
                assert probe.response == b"probe"
            assert (len(ch.connections), ch.opened, len(echo.server.connections)) == (2, 2, 3)
            assert echo.active == 4  # the waiting calls did not take the spare
            echo.release.set()


async def test_uncapped_calls_waiting_for_the_spare_share_its_failure():
    """(each waiter opened one more after it failed: the k-th waited k connect timeouts)"""

    async def handler(peer):
        if peer.index == 0:
            await peer.send(F.settings({F.MAX_CONCURRENT_STREAMS: 1}))
            await peer.until(F.HEADERS)  # the capped call: held, unanswered
        await trio.sleep(30)  # later connections never get SETTINGS

    limits = ClientLimits(max_connections=1, streams_per_connection=1, connect_timeout=1.0)
    ended = []
    async with raw_server(handler) as (port, _):
        async with open_channel("127.0.0.1", port, limits=limits) as channel:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(channel.unary, "/x.Y/Z", b"held")  # fills the pool
                await trio.sleep(0.3)
                start = trio.current_time()

                async def probe():
                    result = await channel.unary("/x.Y/Z", b"p", timeout=20, capped=False)
                    ended.append((trio.current_time() - start, result.status))

                async with trio.open_nursery() as probes:
                    for _ in range(4):
                        probes.start_soon(probe)
                nursery.cancel_scope.cancel()
    assert [status for _, status in ended] == [StatusCode.UNAVAILABLE] * 4
    assert max(seconds for seconds, _ in ended) < 2


async def test_a_connection_to_itself_is_refused(monkeypatch):
    """A connection to a local port nothing listens on may be given that very port (TCP's
    simultaneous open): it then holds the port a server restarting there needs, and
    talks to itself. It is closed as the refusal it is."""
    own = socket.socket()
    own.bind(("127.0.0.1", 0))
    port = own.getsockname()[1]
    own.connect(("127.0.0.1", port))  # (connected to itself)

    async def open_tcp_stream(host, port):
        return trio.SocketStream(trio.socket.from_stdlib_socket(own))

    monkeypatch.setattr(trio, "open_tcp_stream", open_tcp_stream)
    with pytest.raises(ConnectionRefusedError, match="connected to itself"):
        await connect("127.0.0.1", port, None, None)
    assert own.fileno() == -1  # closed: the port is free


async def test_pool_spreads_streams_over_a_few_connections():
    limits = ClientLimits(max_connections=2, streams_per_connection=2)
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port, limits=limits) as ch:
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(ch.unary, HOLD, b"")
            await wait_for(lambda: echo.active == 5, "five calls in flight")
            assert sorted(c.load for c in ch.connections) == [2, 3]
            assert len(echo.server.connections) == 2
            echo.release.set()


async def test_server_stream_limit_is_respected():
    """The server allows 2 streams per connection, the channel one connection: the
    other calls wait for a stream instead of being refused."""
    server_limits = TransportLimits(max_streams_per_connection=2)
    limits = ClientLimits(max_connections=1)
    async with (
        echo_server(limits=server_limits) as echo,
        open_channel("127.0.0.1", echo.port, limits=limits) as ch,
    ):
        results = []

        async def call():
            results.append(await ch.unary(HOLD, b""))

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(call)
            await wait_for(lambda: echo.active == 2, "two calls in flight")
            echo.release.set()
        assert [r.status for r in results] == [StatusCode.OK] * 5
        assert echo.max_active == 2


async def test_reconnects_after_a_server_restart():
    async with trio.open_nursery() as nursery:
        channel = Channel("127.0.0.1", 0)
        async with echo_server() as first:
            channel.port = first.port
            await nursery.start(channel.run)
            assert (await channel.unary(UNARY, b"one")).ok
            (old,) = channel.connections
        # the server said GOAWAY and closed: the connection is gone from the pool
        await wait_for(lambda: not channel.connections, "the old connection to close")
        assert old.closed
        down = await channel.unary(UNARY, b"nobody")
        assert (down.status, down.reached_server) == (StatusCode.UNAVAILABLE, False)
        async with echo_server(port=first.port) as second:
            assert (await channel.unary(UNARY, b"two")).response == b"two"
            assert second.started == 1
        await channel.aclose()


async def test_refused_connection_never_reached_the_server():
    with socket.socket() as bound:  # bound, not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        async with open_channel("127.0.0.1", bound.getsockname()[1]) as channel:
            result = await channel.unary(UNARY, b"x")
            assert result.status is StatusCode.UNAVAILABLE
            assert not result.reached_server
            assert "cannot connect" in result.message
            async with channel.stream(STREAM) as call:
                assert [m async for m in call] == []
                assert (call.status, call.reached_server) == (StatusCode.UNAVAILABLE, False)
                with pytest.raises(CallEnded):
                    await call.send(b"x")


async def test_large_messages_both_ways():
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        big = bytes(range(256)) * (24 * MIB // 256)
        assert (await channel.unary(UNARY, big)).response == big
        assert (await channel.unary(SIZED, b"%d" % (24 * MIB))).response == bytes(24 * MIB)

        async def echo_one(i: int):
            payload = bytes([i]) * (2 * MIB + i)
            assert (await channel.unary(UNARY, payload)).response == payload

        async with trio.open_nursery() as nursery:  # many streams share the windows
            for i in range(24):
                nursery.start_soon(echo_one, i)


async def test_message_limits():
    limits = ClientLimits(max_send_message_bytes=MIB, max_receive_message_bytes=MIB)
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port, limits=limits) as ch:
        too_big = await ch.unary(UNARY, bytes(MIB + 1))
        assert (too_big.status, too_big.reached_server) == (StatusCode.RESOURCE_EXHAUSTED, False)
        assert echo.started == 0
        answer = await ch.unary(SIZED, b"%d" % (MIB + 1))
        assert answer.status is StatusCode.RESOURCE_EXHAUSTED
        assert "ClientLimits.max_receive_message_bytes" in answer.message
        assert (await ch.unary(SIZED, b"%d" % MIB)).response == bytes(MIB)
    # a process's own setting, named instead (the gateway's grpc.max_message_bytes)
    limits = ClientLimits(
        max_send_message_bytes=MIB,
        max_receive_message_bytes=MIB,
        message_setting="grpc.max_message_bytes",
    )
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port, limits=limits) as ch:
        too_big = await ch.unary(UNARY, bytes(MIB + 1))
        answer = await ch.unary(SIZED, b"%d" % (MIB + 1))
    for result in (too_big, answer):
        assert result.message.endswith(f"maximum {MIB} (grpc.max_message_bytes)"), result.message


async def test_bidirectional_stream():
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        async with channel.stream(STREAM) as call:
            await call.send(b"one")
            assert await call.__anext__() == b"one"
            for message in (b"two", b"", bytes(3 * MIB)):
                await call.send(message)
            await call.end()
            assert [m async for m in call] == [b"two", b"", bytes(3 * MIB)]
            assert call.status is StatusCode.OK
            with pytest.raises(CallEnded):
                await call.send(b"late")


async def test_a_close_ending_calls_ends_idle_streams_and_not_calls_at_work():
    """At shutdown, an open stream whose requests are answered ends with the server's
    status (its connection was closed under it); a call still at work does not get it
    (the status may say "never processed": it ran)."""
    ending = MessageError(StatusCode.UNAVAILABLE, "server is shutting down")
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        async with trio.open_nursery() as nursery, channel.stream(STREAM) as call:
            held = []

            async def hold():
                held.append(await channel.unary(HOLD, b""))

            nursery.start_soon(hold)
            await call.send(b"one")
            assert await call.__anext__() == b"one"
            await wait_for(lambda: echo.active == 1, "the held call")
            await echo.server.close(timeout=5, ending=ending)
            assert [m async for m in call] == []
            assert (call.status, call.message) == (
                StatusCode.UNAVAILABLE,
                "server is shutting down",
            )
            await wait_for(lambda: held, "the held call's end")
        assert held[0].status is StatusCode.UNAVAILABLE
        assert held[0].message != "server is shutting down" and held[0].reached_server


async def test_an_oversized_stream_message_is_refused_alone():
    limits = ClientLimits(max_send_message_bytes=MIB)
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port, limits=limits) as ch:
        async with ch.stream(STREAM) as call:
            with pytest.raises(MessageTooLarge, match="ClientLimits.max_send_message_bytes"):
                await call.send(bytes(MIB + 1))
            await call.send(b"still open")  # the stream goes on
            await call.end()
            assert [m async for m in call] == [b"still open"]
            assert call.status is StatusCode.OK


async def test_stream_deadline_and_leaving_early():
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        async with channel.stream(STREAM, timeout=0.2) as call:
            await call.send(b"x")
            assert [m async for m in call] == [b"x"]  # ends at the deadline
            assert call.status is StatusCode.DEADLINE_EXCEEDED
        async with channel.stream(STREAM) as call:
            await call.send(b"y")
            assert await call.__anext__() == b"y"  # the handler waits for more
        assert call.status is StatusCode.CANCELLED  # left before the end: reset
        await wait_for(lambda: echo.cancelled == 2, "both streams cancelled on the server")


async def test_a_stream_cancelled_while_connecting_gives_its_call_slot_back():
    """A server that accepts connections and never answers: a stream open cancelled
    while its connection is being made leaves its slot, so the next call connects too
    (a slot kept would, after max_concurrent_streams such cancels, block every call)."""
    accepted = []

    async def silent(stream):
        accepted.append(stream)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        serve = partial(trio.serve_tcp, host="127.0.0.1")
        [listener] = await nursery.start(serve, silent, 0)
        port = listener.socket.getsockname()[1]
        limits = ClientLimits(max_concurrent_streams=1)
        async with open_channel("127.0.0.1", port, limits=limits) as channel:
            for opens in (1, 2):
                with trio.move_on_after(0.05):
                    async with channel.stream(STREAM):
                        raise AssertionError("the server never sends its settings")
                await wait_for(lambda n=opens: len(accepted) == n, f"connection {opens}")
        nursery.cancel_scope.cancel()


async def test_a_stream_reset_while_its_answer_is_being_sent_ends_only_that_call():
    """The client resets the stream (the answer is over its receive limit) while the
    server sends that answer: the handler's generator, which holds a nursery across its
    yields, is closed while suspended at a yield, in a cancelled call. That ends the
    call, never the connection nor the server."""
    limits = ClientLimits(max_receive_message_bytes=100)
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port, limits=limits) as ch:
        for i in range(1, 4):
            async with ch.stream(STREAM) as call:
                await call.send(bytes(1000))
                assert [m async for m in call] == []
            assert call.status is StatusCode.RESOURCE_EXHAUSTED
            await wait_for(lambda: echo.cancelled == i, "the handler closed")  # noqa: B023
            assert (await ch.unary(UNARY, b"still serving")).response == b"still serving"


async def test_a_call_in_flight_when_the_channel_closes_says_the_client_closed_it():
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        results = []

        async def sleeping() -> None:
            results.append(await channel.unary(SLEEP, b""))  # until cancelled

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleeping)
            await wait_for(lambda: echo.active == 1, "the call in flight")
            await channel.aclose()
    assert results[0].status is StatusCode.UNAVAILABLE
    assert results[0].message.startswith("the client closed the channel")


async def test_a_connection_beyond_the_cap_closes_the_oldest_idle_one():
    """Two silent connections (no preface, ever) hold a server's cap of two: a client
    gets in all the same, closing the oldest; with every connection holding a call, a
    new one is refused."""
    async with echo_server(limits=TransportLimits(max_connections=2)) as echo:
        silent = [await trio.open_tcp_stream("127.0.0.1", echo.port) for _ in range(2)]
        await wait_for(lambda: len(echo.server.connections) == 2, "both accepted")
        async with open_channel("127.0.0.1", echo.port) as channel:
            assert (await channel.unary(UNARY, b"in")).response == b"in"
            with trio.fail_after(10):  # closed to make room (after the server's SETTINGS)
                while await silent[0].receive_some(65536):
                    pass
            held = []
            async with trio.open_nursery() as nursery:

                async def hold(ch) -> None:
                    held.append(await ch.unary(HOLD, b""))

                nursery.start_soon(hold, channel)
                async with open_channel("127.0.0.1", echo.port) as second:
                    nursery.start_soon(hold, second)  # (evicts the other silent one)
                    await wait_for(lambda: echo.active == 2, "both calls held")
                    async with open_channel("127.0.0.1", echo.port) as third:
                        refused = await third.unary(UNARY, b"x")
                    assert refused.status is StatusCode.UNAVAILABLE
                    assert not refused.reached_server
                    echo.release.set()
                    await wait_for(lambda: len(held) == 2, "both held calls answered")
            assert [r.response for r in held] == [b"held", b"held"]
        for stream in silent:
            await stream.aclose()


async def test_calls_that_never_send_their_request_do_not_hold_the_cap():
    """A connection whose calls all wait on its client (a stream that sends nothing, a
    unary call whose message never comes) gives way at the cap, the one waiting longest
    first; one whose call is owed an answer does not."""

    def open_calls() -> int:
        return sum(len(c.streams) for c in echo.server.connections)

    async with echo_server(limits=TransportLimits(max_connections=2)) as echo:
        silent_stream = await trio.to_thread.run_sync(RawH2, echo.port)
        silent_stream.start(STREAM)  # headers only, ever
        await wait_for(lambda: open_calls() == 1, "the stream opened")
        silent_unary = await trio.to_thread.run_sync(RawH2, echo.port)
        silent_unary.start(UNARY)
        await wait_for(lambda: open_calls() == 2, "the unary call opened")
        try:
            async with open_channel("127.0.0.1", echo.port) as channel:
                assert (await channel.unary(UNARY, b"in")).response == b"in"
                assert await trio.to_thread.run_sync(silent_stream.goaway, 5.0)
                held = []
                async with trio.open_nursery() as nursery:

                    async def hold() -> None:
                        held.append(await channel.unary(HOLD, b""))

                    nursery.start_soon(hold)  # owed an answer from now on
                    await wait_for(lambda: echo.active == 1, "the call held")
                    async with open_channel("127.0.0.1", echo.port) as other:
                        assert (await other.unary(UNARY, b"too")).response == b"too"
                    assert await trio.to_thread.run_sync(silent_unary.goaway, 5.0)
                    echo.release.set()
                assert [r.response for r in held] == [b"held"]
        finally:
            silent_stream.close()
            silent_unary.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    path = tmp_path_factory.mktemp("pki")
    cert.private_key_and_cert_chain_pem.write_to_path(str(path / "server.pem"))
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server_tls_context(str(path / "server.pem"), str(path / "server.pem")), client


async def test_tls(pki):
    server_context, client_context = pki
    async with echo_server(tls=server_context) as echo:
        async with open_channel("127.0.0.1", echo.port, tls=client_context) as channel:
            assert (await channel.unary(UNARY, b"secret")).response == b"secret"
            big = bytes(5 * MIB)
            assert (await channel.unary(UNARY, big)).response == big
        async with open_channel("127.0.0.1", echo.port) as plaintext:
            assert (await plaintext.unary(UNARY, b"x")).status is StatusCode.UNAVAILABLE
        wrong = open_channel(
            "127.0.0.1", echo.port, tls=ssl.create_default_context(), server_hostname="localhost"
        )
        async with wrong as channel:  # a CA it does not trust
            result = await channel.unary(UNARY, b"x")
            assert (result.status, result.reached_server) == (StatusCode.UNAVAILABLE, False)
            assert "CERTIFICATE_VERIFY_FAILED" in result.message


# -- frame by frame -------------------------------------------------------------------------


class Server:
    """Server frames into one ClientConnection (no socket)."""

    def __init__(self, **options):
        self.changes = 0
        self.conn = ClientConnection(
            object(),
            stream_window=MIB,
            max_send=MIB,
            max_receive=MIB,
            on_change=self._changed,
            **options,
        )
        self.encoder = hpack.Encoder()
        self.conn._take_out()
        self.send(F.settings({F.MAX_CONCURRENT_STREAMS: 10}))

    def _changed(self, conn):
        self.changes += 1

    def send(self, data: bytes) -> list:
        self.conn._receive(data)
        out = self.conn._take_out()
        return F.FrameReader(F.MAX_WINDOW).feed(out)

    def open(self):
        stream = self.conn.open_stream(F.header_block([(b":path", b"/x")]))
        self.conn._take_out()
        return stream

    def headers(self, sid, headers, *, end=False) -> bytes:
        flags = F.END_HEADERS | (F.END_STREAM if end else 0)
        return F.frame(F.HEADERS, flags, sid, self.encoder.encode(headers))


async def test_goaway_below_a_stream_means_it_was_never_processed():
    server = Server()
    one, three = server.open(), server.open()
    assert server.conn.peer_max_streams == 10
    server.send(F.goaway(1, F.NO_ERROR))
    assert (three.status, three.reached_server) == (StatusCode.UNAVAILABLE, False)
    assert not one.done and not server.conn.available  # one still runs; no new streams
    server.send(server.headers(1, [(":status", "200"), ("grpc-status", "0")], end=True))
    assert (one.status, one.reached_server) == (StatusCode.OK, True)
    assert server.conn.streams == {}


async def test_refused_and_reset_streams():
    server = Server()
    refused, reset = server.open(), server.open()
    server.send(F.rst_stream(refused.id, F.REFUSED_STREAM) + F.rst_stream(reset.id, F.CANCEL))
    assert (refused.status, refused.reached_server) == (StatusCode.UNAVAILABLE, False)
    assert (reset.status, reset.reached_server) == (StatusCode.CANCELLED, True)


async def test_compressed_responses_are_inflated_when_asked_for():
    """Not asked for (no grpc-accept-encoding sent), a compressed response is the
    server's mistake: refused, not inflated (on the event loop: a worker's 250 MiB
    response held a gateway's loop 1.6 s)."""
    body = gzip.compress(b"zipped" * 1000)
    for asked in (True, False):
        server = Server(accept_compressed=asked)
        stream = server.open()
        server.send(
            server.headers(stream.id, [(":status", "200"), ("grpc-encoding", "gzip")])
            + F.frame(F.DATA, 0, stream.id, struct.pack(">?I", True, len(body)) + body)
            + server.headers(stream.id, [("grpc-status", "0"), ("x-cost", "3")], end=True)
        )
        if asked:
            assert stream.status is StatusCode.OK
            assert stream.take_messages() == [b"zipped" * 1000]
            assert stream.trailers == (("x-cost", "3"),)
        else:
            assert stream.status is StatusCode.INTERNAL
            assert "compressed responses were not asked for" in stream.message


async def test_a_send_cancelled_mid_message_resets_its_stream():
    """The window closes in the middle of a message and the sender is cancelled: the rest
    of it can never follow, so the call ends (RST_STREAM CANCEL) instead of carrying
    half a message on (DEADLINE_EXCEEDED when the call's deadline cut it); a send
    cancelled before any of it went out leaves its call as it was."""
    server = Server()
    cut, untouched = server.open(), server.open()
    with trio.move_on_after(0.05):
        await cut.send(bytes(100_000), end=True)  # 65,535 bytes of window: part goes out
    assert (cut.status, cut.message) == (
        StatusCode.CANCELLED,
        "the call was cancelled in the middle of a message",
    )
    sent = server.send(b"")
    assert sum(len(f[3]) for f in sent if f[0] == F.DATA) == 65_535
    assert (F.RST_STREAM, 0, cut.id, struct.pack(">I", F.CANCEL)) in sent
    with trio.move_on_after(0.05):
        await untouched.send(b"x")  # the connection's window is spent: nothing goes out
    assert not untouched.done and not untouched.half_closed
    assert [f for f in server.send(b"") if f[2] == untouched.id] == []

    server = Server()  # cut by the call's own deadline: that is its status
    late = server.conn.open_stream(b"", deadline=trio.current_time() + 0.05)
    with trio.move_on_at(late.deadline):
        await late.send(bytes(100_000))
    assert (late.status, late.message) == (
        StatusCode.DEADLINE_EXCEEDED,
        "deadline exceeded (client timeout)",
    )


async def test_an_end_during_a_send_follows_its_message():
    """Another task half-closes while a send waits for the window: END_STREAM goes out
    after that message, or at once if the send is cancelled before any of it went out;
    the call stays half-closed either way (no DATA may follow END_STREAM)."""
    server = Server()
    spender, stream = server.open(), server.open()
    spender.send_window = 65_535  # (it takes the connection's whole window)
    with trio.move_on_after(0.01):
        await spender.send(bytes(100_000))

    def frames() -> list[tuple[int, int]]:
        return [(kind, flags) for kind, flags, sid, _ in server.send(b"") if sid == stream.id]

    async with trio.open_nursery() as nursery:
        cancelled = trio.CancelScope()

        async def send(scope: trio.CancelScope, payload: bytes) -> None:
            with scope:
                await stream.send(payload)

        nursery.start_soon(send, cancelled, b"first")
        await wait_for(lambda: stream._sending, "the send to wait for the window")
        stream.end()
        assert stream.half_closed and frames() == []  # not before the message
        cancelled.cancel()  # none of it went out: the end goes at once
    assert stream.half_closed and frames() == [(F.DATA, F.END_STREAM)]

    server = Server()
    stream = server.open()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, trio.CancelScope(), bytes(70_000))
        await wait_for(lambda: stream._sending, "the send to wait for the window")
        stream.end()
        server.send(F.window_update(0, 10_000) + F.window_update(stream.id, 10_000))
    sent = frames()
    assert sent[-1] == (F.DATA, F.END_STREAM) and all(k == F.DATA for k, _ in sent)
    assert sum(1 for _, flags in sent if flags & F.END_STREAM) == 1


async def test_trailers_that_end_a_response_mid_message_fail_it():
    server = Server()
    stream = server.open()
    server.send(
        server.headers(stream.id, [(":status", "200")])
        + F.frame(F.DATA, 0, stream.id, struct.pack(">?I", False, 10) + b"abc")
        + server.headers(stream.id, [("grpc-status", "0")], end=True)
    )
    assert (stream.status, stream.message) == (
        StatusCode.INTERNAL,
        "the server ended the call mid-message",
    )


async def test_trailers_only_http_errors_and_missing_trailers():
    server = Server()
    a, b, c = server.open(), server.open(), server.open()
    frames = server.send(
        server.headers(
            a.id, [(":status", "200"), ("grpc-status", "7"), ("grpc-message", "no%20way")], end=True
        )
        + server.headers(b.id, [(":status", "503")], end=True)
        + server.headers(c.id, [(":status", "200")])
        + F.frame(F.DATA, F.END_STREAM, c.id, b"")
    )
    assert (a.status, a.message) == (StatusCode.PERMISSION_DENIED, "no way")
    assert b.status is StatusCode.UNAVAILABLE and "HTTP 503" in b.message
    assert c.status is StatusCode.INTERNAL and "without trailers" in c.message
    # ended on the server's side while open on ours (no END_STREAM sent): each reset
    # (NO_ERROR), so that it stops counting against the server's stream limit
    no_error = struct.pack(">I", F.NO_ERROR)
    assert frames == [(F.RST_STREAM, 0, s.id, no_error) for s in (a, b, c)]


async def test_nothing_is_written_to_a_connection_once_its_socket_is_closed(monkeypatch):
    """A server that closes the connection before its settings (over its connection
    limit): the channel gives up on it without writing a GOAWAY to the closed socket's
    descriptor, which by then may be another file's."""
    written_to_closed: list[int] = []
    write = os.write

    def checked_write(fd, data):
        try:
            os.fstat(fd)
        except OSError:
            written_to_closed.append(fd)
        return write(fd, data)

    monkeypatch.setattr("rsrv.transport._endpoint.os.write", checked_write)
    async with (
        echo_server(limits=TransportLimits(max_connections=0)) as echo,
        open_channel("127.0.0.1", echo.port, limits=ClientLimits(max_connections=1)) as channel,
    ):
        result = await channel.unary(UNARY, b"x")
    assert result.status == StatusCode.UNAVAILABLE and not result.reached_server
    assert written_to_closed == []


def test_a_grpc_status_of_endless_digits_is_unknown_not_a_crash():
    _, status, *_ = _parse_headers([(b":status", b"200"), (b"grpc-status", b"9" * 5000)])
    assert status == -1


async def test_a_long_status_message_is_cut_and_fails_only_its_call():
    """A handler's error message of 16 KB (48 KB percent-encoded) would exceed the
    client's header list limit: it is cut, and neither the call nor a call beside it
    on the same connection loses its status."""
    async with (
        echo_server() as echo,
        open_channel("127.0.0.1", echo.port, limits=ClientLimits(max_connections=1)) as channel,
    ):
        results = {}

        async def beside():
            results["beside"] = await channel.unary(SLEEP, b"0.5")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(beside)
            await wait_for(lambda: channel.connections and channel.connections[0].streams)
            results["failed"] = await channel.unary(FAIL, b"3:" + "é ".encode() * 8000)
    failed = results["failed"]
    assert failed.status == StatusCode.INVALID_ARGUMENT
    assert failed.message.startswith("é é ") and failed.message.endswith(" ...")
    assert len(failed.message) < 2000 and "\ufffd" not in failed.message  # whole characters
    assert results["beside"].ok and channel.opened == 1


async def test_streams_that_nobody_reads_leave_room_for_the_calls_beside_them(monkeypatch):
    """Three bidirectional calls whose responses are not read, and whose handlers then
    stop reading too, on the one connection of a channel: each holds at most a stream
    window (an eighth of the connection's), so a unary call beside them still goes
    through. (The windows are scaled down: 8 MiB for the connection.)"""
    from rsrv.transport import _endpoint

    monkeypatch.setattr(_endpoint, "CONNECTION_WINDOW", 8 * MIB)
    monkeypatch.setattr(_endpoint, "MAX_STREAM_WINDOW", MIB)
    limits = ClientLimits(
        max_connections=1, max_send_message_bytes=4 * MIB, max_receive_message_bytes=4 * MIB
    )
    async with (
        echo_server(limits=TransportLimits(max_message_bytes=4 * MIB)) as echo,
        open_channel("127.0.0.1", echo.port, limits=limits) as channel,
    ):

        async def stalled():
            async with channel.stream(STREAM) as call:
                while True:
                    await call.send(bytes(256 * 1024))  # until flow control stops it

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(stalled)
            await trio.sleep(0.5)
            with trio.fail_after(10):
                result = await channel.unary(UNARY, bytes(2 * MIB))
            nursery.cancel_scope.cancel()
    assert result.ok and len(result.response) == 2 * MIB and channel.opened == 1


@pytest.mark.parametrize("side", ["server", "client"])
def test_an_encrypted_key_is_refused_without_asking_for_its_passphrase(tmp_path, side):
    """Nobody is there to type it (a supervised process, no terminal): OpenSSL's prompt
    is answered with an error that says what is wrong."""
    from cryptography.hazmat.primitives import serialization

    ca = trustme.CA()
    issued = ca.issue_cert("localhost")
    issued.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    key = serialization.load_pem_private_key(issued.private_key_pem.bytes(), None)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    cert, key_file = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    with pytest.raises(TLS_ERRORS) as info:
        if side == "server":
            server_tls_context(cert, key_file)
        else:
            client_tls_context(str(tmp_path / "ca.pem"), cert, key_file)
    assert "encrypted" in str(info.value)


async def test_a_message_over_the_limit_is_refused_naming_the_servers_own_setting():
    """A gateway's refusals named a worker's key (endpoints.max_message_bytes)."""
    limits = TransportLimits(max_message_bytes=64, message_setting="grpc.max_message_bytes")
    async with (
        echo_server(limits=limits) as echo,
        open_channel("127.0.0.1", echo.port) as channel,
    ):
        received = await channel.unary(UNARY, bytes(100))
        sent = await channel.unary(SIZED, b"100")
    assert received.status == sent.status == StatusCode.RESOURCE_EXHAUSTED
    assert received.message.endswith("larger than the maximum 64 (grpc.max_message_bytes)")
    assert sent.message.endswith("exceeds the maximum 64 (grpc.max_message_bytes)")
