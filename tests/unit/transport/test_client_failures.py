"""The client Channel against servers that go away, from a scripted raw HTTP/2 server:
whether a call "reached the server" (what decides a retry) is said only when certain,
and a connection that is going is never given a new call."""

from __future__ import annotations

import socket
import struct

import trio
from purerpc.grpclib.status import StatusCode
from support.echo import UNARY, echo_server
from support.rawserver import raw_server

from rsrv.transport import Channel, ClientLimits, open_channel
from rsrv.transport import _frames as F

PATH = "/x.Y/Z"
SETTINGS = F.settings({F.MAX_CONCURRENT_STREAMS: 100})


async def test_a_connection_gone_away_before_its_first_stream_takes_no_call():
    """SETTINGS then GOAWAY(last 0) at once (a server draining): the call never reached
    it, so it can be retried elsewhere (it said reached_server=True, 10 of 10)."""

    async def handler(peer):
        await peer.send(SETTINGS + F.goaway(0, F.NO_ERROR))
        with trio.move_on_after(0.5):
            while True:
                await peer.frame()
        await peer.s.aclose()

    async with raw_server(handler) as (port, _):
        for _ in range(3):
            async with open_channel("127.0.0.1", port) as channel:
                result = await channel.unary(PATH, b"x", timeout=3)
            assert result.status is StatusCode.UNAVAILABLE and not result.reached_server


async def test_a_call_refused_unprocessed_by_a_live_server_is_sent_again():
    """A server rotating its connection (GOAWAY past the call, as an idle close or a
    maximum connection age does), or refusing a stream: the call goes out once more and
    is answered (it failed UNAVAILABLE, and a gateway took the worker out of its
    routes). (Refused every time, it fails unprocessed: the test above.)"""

    async def handler(peer):
        await peer.send(SETTINGS)
        _, _, sid, _ = await peer.until(F.HEADERS)
        if peer.index == 0:
            await peer.send(peer.answer(sid, b"first"))
            _, _, sid, _ = await peer.until(F.HEADERS)
            await peer.send(F.goaway(sid - 2, F.NO_ERROR))
            await trio.sleep(1)
            return
        await peer.send(peer.answer(sid, b"on a new connection"))
        _, _, sid, _ = await peer.until(F.HEADERS)
        await peer.send(F.rst_stream(sid, F.REFUSED_STREAM))
        while True:
            _, _, sid, _ = await peer.until(F.HEADERS)
            await peer.send(peer.answer(sid, b"again"))

    async with raw_server(handler) as (port, peers):
        async with open_channel("127.0.0.1", port) as channel:
            assert (await channel.unary(PATH, b"1", timeout=3)).response == b"first"
            result = await channel.unary(PATH, b"2", timeout=3)  # GOAWAY past it
            assert result.ok and result.response == b"on a new connection"
            result = await channel.unary(PATH, b"3", timeout=3)  # REFUSED_STREAM
            assert result.ok and result.response == b"again"
        assert len(peers) == 2


async def test_a_refused_call_whose_retry_runs_out_of_time_never_reached_the_server():
    """Refused (GOAWAY past it), then its deadline passes while a new connection waits
    for the server's SETTINGS: DEADLINE_EXCEEDED, and reached_server False (it said
    True, so a gateway spent the deadline there instead of trying another replica)."""

    async def handler(peer):
        if peer.index == 0:
            await peer.send(SETTINGS)
            await peer.until(F.HEADERS)
            await peer.send(F.goaway(0, F.NO_ERROR))
        await trio.sleep(3)  # (the second connection never gets SETTINGS)

    async with raw_server(handler) as (port, _):
        async with open_channel("127.0.0.1", port) as channel:
            result = await channel.unary(PATH, b"x", timeout=1)
    assert result.status is StatusCode.DEADLINE_EXCEEDED and not result.reached_server


async def test_a_draining_connection_does_not_hold_new_calls_at_max_connections():
    """GOAWAY(last 1) while stream 1 runs on (a server rotating its connections): a new
    call opens a fresh connection at once (it waited for the old call, to its deadline)."""

    async def handler(peer):
        await peer.send(SETTINGS)
        if peer.index == 0:
            _, _, sid, _ = await peer.until(F.HEADERS)
            await peer.send(F.goaway(sid, F.NO_ERROR))
            goaway_sent.set()
            await trio.sleep(3)
            await peer.send(peer.answer(sid, b"long"))
            await trio.sleep(1)
        else:
            while True:
                _, _, sid, _ = await peer.until(F.HEADERS)
                await peer.send(peer.answer(sid, b"fresh"))

    goaway_sent = trio.Event()
    limits = ClientLimits(max_connections=1)
    async with raw_server(handler) as (port, _):
        async with open_channel("127.0.0.1", port, limits=limits) as channel:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(channel.unary, PATH, b"long")
                await goaway_sent.wait()
                with trio.move_on_after(1):  # (read at once; the old call runs 3 s)
                    while not channel.connections[0].draining:
                        await trio.sleep(0.01)
                assert channel.connections[0].draining
                result = await channel.unary(PATH, b"new", timeout=1.5)
    assert result.ok and result.response == b"fresh"


async def test_a_connection_whose_server_ended_it_takes_no_new_call():
    """After the server's FIN the connection drains its writer (up to 1 s): a call put on
    it meanwhile never left, yet said reached_server=True."""

    async def handler(peer):
        window = F.settings({F.MAX_CONCURRENT_STREAMS: 100, F.INITIAL_WINDOW_SIZE: 1 << 30})
        await peer.send(window + F.window_update(0, 1 << 30))
        if peer.index > 0:
            while True:
                _, _, sid, _ = await peer.until(F.HEADERS)
                await peer.send(peer.answer(sid, b"ok"))
        await peer.until(F.HEADERS)
        await trio.sleep(0.3)  # the client's writer is stuck: nothing is read
        peer.s.socket.shutdown(socket.SHUT_WR)
        fin_sent.set()
        await trio.sleep(3)

    fin_sent = trio.Event()
    limits = ClientLimits(max_connections=1)
    async with raw_server(handler) as (port, _):
        async with open_channel("127.0.0.1", port, limits=limits) as channel:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(channel.unary, PATH, bytes(64 << 20))
                await fin_sent.wait()
                (old,) = channel.connections
                with trio.move_on_after(0.5):  # (the FIN is read at once; well within
                    while old.available:  # the 1 s the writer is given to drain)
                        await trio.sleep(0.01)
                result = await channel.unary(PATH, b"new", timeout=3)
                nursery.cancel_scope.cancel()
    assert result.ok or not result.reached_server, result


async def test_refused_after_the_answer_began_reached_the_server():
    """RST_STREAM REFUSED_STREAM after response headers and a message: the server saw the
    call (it said reached_server=False: a retry of a call that may have run)."""

    async def handler(peer):
        await peer.send(SETTINGS)
        _, _, sid, _ = await peer.until(F.HEADERS)
        message = F.frame(F.DATA, 0, sid, struct.pack(">?I", False, 2) + b"ok")
        await peer.send(
            peer.headers(sid, [(":status", "200")]) + message + F.rst_stream(sid, F.REFUSED_STREAM)
        )
        await trio.sleep(1)

    async with raw_server(handler) as (port, _):
        async with open_channel("127.0.0.1", port) as channel:
            result = await channel.unary(PATH, b"x", timeout=3)
    assert result.status is StatusCode.UNAVAILABLE and result.reached_server


async def test_a_call_after_the_channels_run_ended_is_unavailable():
    """``nursery.start(channel.run)``, that nursery cancelled, no aclose(): a later call is
    UNAVAILABLE, never sent (it raised trio's RuntimeError, "Nursery is closed")."""
    async with echo_server() as echo:
        channel = Channel("127.0.0.1", echo.port)
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.run)
            assert (await channel.unary(UNARY, b"x", timeout=2)).ok
            nursery.cancel_scope.cancel()
        result = await channel.unary(UNARY, b"x", timeout=2)
    assert result.status is StatusCode.UNAVAILABLE and not result.reached_server


async def test_client_sockets_keep_alive():
    """A server host gone without a FIN is noticed (TCP keepalive), as on the server."""
    async with echo_server() as echo, open_channel("127.0.0.1", echo.port) as channel:
        assert (await channel.unary(UNARY, b"x", timeout=2)).ok
        sock = channel.connections[0].stream.socket
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)


async def test_a_server_that_allows_no_stream_gets_none_until_it_allows_one():
    """MAX_CONCURRENT_STREAMS 0 (RFC 9113 §5.1.2: a client must not exceed it): the
    call was sent anyway, refused, sent again on a second connection and failed
    UNAVAILABLE (reached_server False: a gateway takes such a worker out of its routes).
    It waits, on one connection, until the server's SETTINGS allow a stream, or for
    its deadline."""
    headers, connections, allow = [], [], trio.Event()

    async def handler(peer):
        connections.append(peer.index)
        await peer.send(F.settings({F.MAX_CONCURRENT_STREAMS: 0}))
        async with trio.open_nursery() as nursery:

            async def allow_later():
                await allow.wait()
                await peer.send(F.settings({F.MAX_CONCURRENT_STREAMS: 4}))

            nursery.start_soon(allow_later)
            while True:
                kind, _, sid, _ = await peer.frame()
                if kind == F.HEADERS:
                    headers.append(sid)
                    await peer.send(peer.answer(sid, b"ok"))

    async with raw_server(handler) as (port, _):
        limits = ClientLimits(max_connections=2)
        async with open_channel("127.0.0.1", port, limits=limits) as channel:
            result = await channel.unary(UNARY, b"x", timeout=0.5)
            assert result.status is StatusCode.DEADLINE_EXCEEDED and not headers
            assert connections == [0]  # (not a connection after another)
            results = []
            async with trio.open_nursery() as nursery:

                async def call():
                    results.append(await channel.unary(UNARY, b"y", timeout=10))

                nursery.start_soon(call)
                await trio.sleep(0.2)
                assert not headers
                allow.set()
    assert headers == [1] and results[0].status is StatusCode.OK


async def test_a_server_announcing_push_is_a_protocol_error():
    """RFC 9113 §6.5.2: a client MUST treat SETTINGS_ENABLE_PUSH 1 from a server as a
    connection error (it was accepted: only values above 1 were refused)."""
    goaway = []

    async def handler(peer):
        await peer.send(F.settings({F.ENABLE_PUSH: 1}))
        kind, _, _, payload = await peer.until(F.GOAWAY)
        goaway.append(struct.unpack(">II", payload[:8])[1])

    async with raw_server(handler) as (port, _):
        async with open_channel("127.0.0.1", port) as channel:
            result = await channel.unary(UNARY, b"x", timeout=5)
    assert result.status is StatusCode.UNAVAILABLE and not result.reached_server
    assert goaway == [F.PROTOCOL_ERROR]


async def test_a_unary_call_answered_with_many_messages_ends_at_the_second():
    """(Every message was split out and kept until the call ended: a window of 2-byte
    messages took over 1 GiB of the gateway's memory for one call.) After the second,
    the stream is reset and the call fails INTERNAL; nothing more is kept."""
    resets = []

    async def handler(peer):
        await peer.send(SETTINGS)
        _, _, sid, _ = await peer.until(F.HEADERS)
        tiny = struct.pack(">?I", False, 2) + b"ok"
        await peer.send(
            peer.headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
            + F.frame(F.DATA, 0, sid, tiny * 3000)
        )
        _, _, _, payload = await peer.until(F.RST_STREAM)
        resets.append(payload)

    async with raw_server(handler) as (port, _):
        async with open_channel("127.0.0.1", port) as channel:
            result = await channel.unary(PATH, b"x", timeout=3)
            with trio.fail_after(3):
                while not resets:
                    await trio.sleep(0.01)
    assert result.status is StatusCode.INTERNAL
    assert result.message == "the server sent more than one message for a unary call"
