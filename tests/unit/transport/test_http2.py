"""The server side of HTTP/2 (RFC 9113) as rsrv speaks it, frame by frame.

A :class:`ServerConnection` is fed bytes as a client would send them and the frames it
queues in answer are read back; calls it starts are recorded instead of run. The same
connection code serves every end-to-end test (tritonclient, grpcio, purerpc clients);
these tests cover what polite clients never send.
"""

from __future__ import annotations

import gzip
import socket
import struct
import threading
import time

import hpack
import pytest
import trio
from purerpc.grpclib.status import StatusCode
from support.echo import HOLD, SIZED, STREAM, STREAM_SIZED, UNARY, echo_server, wait_for
from support.rawh2 import RawH2, message

from rsrv.transport import TransportLimits
from rsrv.transport import _frames as F
from rsrv.transport._connection import ServerConnection
from rsrv.transport._endpoint import (
    INBOX_LIMIT,
    MAX_CONTINUATIONS,
    MAX_HEADER_BLOCK,
    MAX_SETTINGS,
    MAX_UNSENT_ANSWERS,
)

PATH = b"/inference.GRPCInferenceService/ModelInfer"


class _Server:
    def __init__(self, **limits):
        self.limits = TransportLimits(**limits)
        self.started = []

    async def _run_call(self, call):  # pragma: no cover - never awaited here
        raise AssertionError


class _Nursery:
    def __init__(self, server):
        self.server = server

    def start_soon(self, fn, call):
        self.server.started.append(call)


class Client:
    """Bytes in, frames out, against one ServerConnection."""

    def __init__(self, **limits):
        self.server = _Server(**limits)
        self.conn = ServerConnection(object(), self.server, "test")
        self.conn._nursery = _Nursery(self.server)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.conn._take_out()  # (run() would have queued the server preface)

    def send(self, data: bytes) -> list[tuple[int, int, int, bytes]]:
        """Feed ``data``; the frames the server queued in answer."""
        self.conn._receive(data)
        out = self.conn._take_out()
        return F.FrameReader(F.MAX_WINDOW).feed(out)

    def start(self, settings: dict | None = None):
        return self.send(F.PREFACE + F.settings(settings or {}))

    def headers(self, sid: int, extra=(), *, flags=F.END_HEADERS, method=b"POST"):
        block = self.encoder.encode(
            [
                (b":method", method),
                (b":scheme", b"http"),
                (b":path", PATH),
                (b":authority", b"x"),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
                *extra,
            ]
        )
        return F.frame(F.HEADERS, flags, sid, block)

    @property
    def calls(self):
        return self.server.started


def goaway(frames) -> int | None:
    for kind, _, _, payload in frames:
        if kind == F.GOAWAY:
            return struct.unpack(">I", payload[4:8])[0]
    return None


def rst(frames, sid) -> int | None:
    for kind, _, stream, payload in frames:
        if kind == F.RST_STREAM and stream == sid:
            return struct.unpack(">I", payload)[0]
    return None


def protocol_error(client: Client, data: bytes) -> int:
    with pytest.raises(F.ConnectionError_) as info:
        client.send(data)
    return info.value.code


# -- frames and header blocks --------------------------------------------------------


async def test_frame_reader_splits_and_joins():
    data = F.frame(F.PING, 0, 0, b"12345678") + F.frame(F.DATA, 1, 3, b"abc")
    reader = F.FrameReader(100)
    got = []
    for i in range(len(data)):
        got += reader.feed(data[i : i + 1])
    assert got == [(F.PING, 0, 0, b"12345678"), (F.DATA, 1, 3, b"abc")]
    with pytest.raises(F.ConnectionError_) as info:
        F.FrameReader(10).feed(F.frame(F.DATA, 0, 1, bytes(11)))
    assert info.value.code == F.FRAME_SIZE_ERROR


async def test_header_blocks_decode_with_any_table_size():
    headers = [
        (b":status", b"200"),
        (b"content-type", b"application/grpc"),
        (b"grpc-status", b"3"),
        (b"grpc-message", b"x" * 300),  # a length beyond one prefix byte
    ]
    for table_size in (0, 4096):
        decoder = hpack.Decoder()
        decoder.max_allowed_table_size = table_size
        assert decoder.decode(F.header_block(headers), raw=True) == headers


# -- the connection ------------------------------------------------------------------


async def test_preface_must_open_the_connection():
    assert protocol_error(Client(), b"GET / HTTP/1.1\r\n\r\n" + bytes(10)) == F.PROTOCOL_ERROR
    assert protocol_error(Client(), F.PREFACE + F.frame(F.PING, 0, 0, bytes(8))) == (
        F.PROTOCOL_ERROR
    )


async def test_settings_are_acknowledged_and_ping_answered():
    client = Client()
    frames = client.start({F.INITIAL_WINDOW_SIZE: 100, F.MAX_FRAME_SIZE: 20000})
    assert (F.SETTINGS, F.ACK, 0, b"") in frames
    assert client.conn.peer_initial_window == 100 and client.conn.peer_max_frame == 20000
    assert client.send(F.frame(F.PING, 0, 0, b"pingpong")) == [(F.PING, F.ACK, 0, b"pingpong")]
    assert client.send(F.frame(F.PING, F.ACK, 0, b"pingpong")) == []  # an answer: none


@pytest.mark.parametrize(
    ("settings", "code"),
    [
        ({F.INITIAL_WINDOW_SIZE: 2**31}, F.FLOW_CONTROL_ERROR),
        ({F.MAX_FRAME_SIZE: 100}, F.PROTOCOL_ERROR),
        ({F.ENABLE_PUSH: 2}, F.PROTOCOL_ERROR),
    ],
)
async def test_bad_settings_end_the_connection(settings, code):
    assert protocol_error(Client(), F.PREFACE + F.settings(settings)) == code


#: A header block beyond MAX_HEADER_BLOCK that decodes to a small header list: table
#: size updates (3 bytes each, to 4096: no change), then a request's headers.
_LONG_SMALL_BLOCK = b"\x3f\xe1\x1f" * (MAX_HEADER_BLOCK // 3) + hpack.Encoder().encode(
    [(b":method", b"POST"), (b":path", PATH)]
)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (F.window_update(0, 0), F.PROTOCOL_ERROR),
        (F.window_update(0, 2**31 - 1), F.FLOW_CONTROL_ERROR),  # overflow
        (F.frame(F.DATA, 0, 1, b"x"), F.PROTOCOL_ERROR),  # never opened
        (F.frame(F.HEADERS, F.END_HEADERS, 2, b""), F.PROTOCOL_ERROR),  # even id
        (F.frame(F.PUSH_PROMISE, 0, 1, bytes(4)), F.PROTOCOL_ERROR),
        (F.frame(F.RST_STREAM, 0, 0, bytes(4)), F.PROTOCOL_ERROR),
        (F.frame(F.RST_STREAM, 0, 9, bytes(4)), F.PROTOCOL_ERROR),  # idle stream
        (F.window_update(9, 1), F.PROTOCOL_ERROR),  # idle stream
        (F.frame(F.PING, 0, 0, b"short"), F.FRAME_SIZE_ERROR),  # (RFC 9113 §6.7)
        (F.frame(F.SETTINGS, 0, 1, b""), F.PROTOCOL_ERROR),
        (F.frame(F.CONTINUATION, F.END_HEADERS, 1, b""), F.PROTOCOL_ERROR),
        (F.frame(F.HEADERS, F.END_HEADERS, 1, b"\xff\xff\xff\xff"), F.COMPRESSION_ERROR),
        # costs bounded per frame: a SETTINGS frame of thousands of entries (each walked
        # every stream), a header block beyond 64 KiB in one HEADERS frame (decoded and
        # cached before: seconds of the loop, MiBs each)
        (F.frame(F.SETTINGS, 0, 0, bytes(6 * (MAX_SETTINGS + 1))), F.ENHANCE_YOUR_CALM),
        (F.frame(F.HEADERS, F.END_HEADERS, 1, _LONG_SMALL_BLOCK), F.ENHANCE_YOUR_CALM),
    ],
)
async def test_protocol_errors_end_the_connection(frame, code):
    client = Client()
    client.start()
    assert protocol_error(client, frame) == code


async def test_unknown_frames_and_priority_are_ignored():
    client = Client()
    client.start()
    assert client.send(F.frame(0x42, 0xFF, 7, b"whatever")) == []
    assert client.send(F.frame(F.PRIORITY, 0, 5, bytes(5))) == []


async def test_a_request_starts_a_call_and_its_data_reaches_it():
    client = Client()
    client.start()
    client.send(client.headers(1))
    (call,) = client.calls
    assert call.path == PATH.decode() and call.id == 1
    payload = struct.pack(">?I", False, 3) + b"abc"
    client.send(F.frame(F.DATA, F.END_STREAM, 1, payload))
    assert list(call._inbox) == [b"abc"] and call._ended


async def test_messages_beyond_a_full_inbox_stay_bytes_until_taken():
    """A stream whose handler does not read holds what its client sends as sent: tiny
    messages split out at once took seven times their size (an object each)."""
    client = Client()
    client.start()
    client.send(client.headers(1, flags=F.END_HEADERS))
    (call,) = client.calls
    message = struct.pack(">?I", False, 2)
    sent = [b"%02d" % (i % 100) for i in range(1000)]
    client.send(F.frame(F.DATA, 0, 1, b"".join(message + m for m in sent)))
    assert list(call._inbox) == sent[: INBOX_LIMIT + 1]
    client.send(F.frame(F.DATA, F.END_STREAM, 1, message + b"ok"))
    got = [await call.receive() for _ in range(1001)]
    assert got == [*sent, b"ok"]
    assert await call.receive() is None and call._messages_in == 1001


async def test_continuation_padding_and_priority():
    client = Client()
    client.start()
    block = client.encoder.encode(
        [(b":method", b"POST"), (b":path", PATH), (b"content-type", b"application/grpc")]
    )
    padded = bytes([3]) + bytes(5) + block[:4] + bytes(3)  # pad length, priority, data, pad
    client.send(F.frame(F.HEADERS, F.PADDED | F.PRIORITY_FLAG, 1, padded))
    assert client.calls == []  # the block is not complete
    client.send(F.frame(F.CONTINUATION, F.END_HEADERS, 1, block[4:]))
    assert len(client.calls) == 1
    payload = struct.pack(">?I", False, 2) + b"hi"
    client.send(F.frame(F.DATA, F.PADDED, 1, bytes([4]) + payload + bytes(4)))
    assert list(client.calls[0]._inbox) == [b"hi"]


async def test_an_interrupted_header_block_is_an_error():
    client = Client()
    client.start()
    client.send(client.headers(1, flags=0))
    assert protocol_error(client, F.frame(F.PING, 0, 0, bytes(8))) == F.PROTOCOL_ERROR


async def test_a_header_block_of_endless_continuations_is_refused():
    """Empty CONTINUATION frames add nothing to a block's size, but each costs the
    reader: a block may have only so many."""
    client = Client()
    client.start()
    client.send(client.headers(1, flags=0))
    flood = F.frame(F.CONTINUATION, 0, 1) * MAX_CONTINUATIONS
    assert protocol_error(client, flood) == F.ENHANCE_YOUR_CALM


async def test_a_peer_that_sends_pings_and_reads_nothing_is_cut_off():
    """Answers (PING and SETTINGS acknowledgements) wait unsent only up to a bound."""
    client = Client()
    client.start()
    ping = F.frame(F.PING, 0, 0, bytes(8))
    client.conn._unsent_answers = 0  # (as if the socket took everything so far)
    assert len(client.send(ping * MAX_UNSENT_ANSWERS)) == MAX_UNSENT_ANSWERS
    assert protocol_error(client, ping) == F.ENHANCE_YOUR_CALM


async def test_streams_beyond_the_limit_are_refused():
    client = Client(max_streams_per_connection=2)
    client.start()
    client.send(client.headers(1) + client.headers(3))
    assert rst(client.send(client.headers(5)), 5) == F.REFUSED_STREAM
    assert len(client.calls) == 2


async def test_a_stream_opened_after_goaway_is_refused_never_started():
    """A request that crossed the server's GOAWAY on the wire (its id above the last
    one announced) is refused, REFUSED_STREAM, so the client knows it may retry it; it
    never becomes a call."""
    client = Client()
    client.start()
    client.send(client.headers(1))
    client.conn._send_goaway(F.NO_ERROR)  # (announces stream 1 as the last)
    assert rst(client.send(client.headers(3)), 3) == F.REFUSED_STREAM
    assert len(client.calls) == 1


async def test_a_request_that_crosses_an_idle_goaway_is_refused_not_reset():
    """The server reads on after its GOAWAY: a request sent before the client saw it is
    refused (REFUSED_STREAM: never started, to be sent again), not lost in a reset of the
    connection (closing with its frames unread sends a TCP RST)."""
    client = Client()
    async with echo_server(limits=TransportLimits(idle_timeout=0.2)) as echo:
        stream = await trio.open_tcp_stream("127.0.0.1", echo.port)
        await stream.send_all(F.PREFACE + F.settings({}))
        reader, frames = F.FrameReader(F.MAX_WINDOW), []
        while goaway(frames) is None:
            frames += reader.feed(await stream.receive_some())
        await stream.send_all(client.headers(1))
        while rst(frames, 1) is None:
            data = await stream.receive_some()
            assert data, "the connection closed"
            frames += reader.feed(data)
        assert rst(frames, 1) == F.REFUSED_STREAM
        await stream.aclose()


async def test_malformed_requests_end_their_stream_only():
    client = Client()
    client.start()
    assert rst(client.send(client.headers(1, [(b"Upper", b"x")])), 1) == F.PROTOCOL_ERROR
    assert rst(client.send(client.headers(3, [(b"connection", b"close")])), 3) == (F.PROTOCOL_ERROR)
    statuses = {}
    for sid, frames in (
        (5, client.send(client.headers(5, method=b"GET"))),
        (7, client.send(client.headers(7, [(b"content-type", b"text/plain")]))),
    ):
        for kind, _, stream, payload in frames:
            if kind == F.HEADERS and stream == sid:
                statuses[sid] = dict(client.decoder.decode(payload))[":status"]
    assert statuses == {5: "405", 7: "415"}
    assert client.calls == []
    client.send(client.headers(9))  # the connection carries on
    assert [c.id for c in client.calls] == [9]
    # A malformed grpc-timeout: INVALID_ARGUMENT without a call; a client still sending
    # is stopped (RST_STREAM NO_ERROR).
    frames = client.send(client.headers(11, [(b"grpc-timeout", b"soon")]))
    (block,) = [payload for kind, _, sid, payload in frames if kind == F.HEADERS and sid == 11]
    trailers = dict(client.decoder.decode(block))
    assert trailers["grpc-status"] == "3" and "grpc-timeout" in trailers["grpc-message"]
    assert rst(frames, 11) == F.NO_ERROR and [c.id for c in client.calls] == [9]


async def test_response_respects_the_peer_window_and_frame_size():
    client = Client()
    client.start({F.INITIAL_WINDOW_SIZE: 10})
    client.send(client.headers(1))
    (call,) = client.calls
    sent = client.conn.write_data(call, memoryview(bytes(25)))
    assert sent == 10  # the stream window
    assert client.conn.write_data(call, memoryview(bytes(15))) == 0
    client.send(F.window_update(1, 40_000))
    assert client.conn.write_data(call, memoryview(bytes(15))) == 15
    big = Client()
    big.start({F.INITIAL_WINDOW_SIZE: 2**20})
    big.send(F.window_update(0, 2**20))
    big.send(big.headers(1))
    (call,) = big.calls
    assert big.conn.write_data(call, memoryview(bytes(50_000))) == 50_000
    frames = F.FrameReader(F.MAX_WINDOW).feed(b"".join(bytes(b) for b in big.conn._out))
    assert [len(p) for k, _, _, p in frames if k == F.DATA] == [16_384, 16_384, 16_384, 848]


async def test_what_makes_a_connection_busy_at_the_cap():
    """A connection is quiet (it may be closed to make room at the connection cap)
    while none of its calls owes the client an answer: a call whose message or end has
    not come, or whose messages were all answered, waits on its client; a half-closed
    one (a Health Watch, a unary call) is owed its answers; one parked on the client's
    flow-control window waits on the client again."""
    client = Client()
    client.start({F.INITIAL_WINDOW_SIZE: 0})
    conn = client.conn
    one = struct.pack(">?I", False, 1) + b"x"
    assert conn.quiet_since() is not None  # no call at all
    client.send(client.headers(1))  # a stream that sends nothing
    (stream,) = client.calls
    stream.streams_requests(True)  # (what the server does from the method)
    assert conn.quiet_since() is not None and conn.owed == 0
    client.send(F.frame(F.DATA, 0, 1, one))
    assert conn.quiet_since() is None  # owed the answer to its message
    client.send(client.headers(3) + F.frame(F.DATA, 0, 3, one))  # unary: no end yet
    assert conn.owed == 1  # (waits for the end: on its client)
    client.send(client.headers(5, flags=F.END_HEADERS | F.END_STREAM))  # half-closed
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send, b"answer")  # parked: the client's window is 0
        await trio.sleep(0.01)
        assert conn.owed == 1  # the half-closed call alone
        client.send(F.rst_stream(5, F.CANCEL))
        assert conn.quiet_since() is not None  # parked on the client, the other gone
        client.send(F.window_update(1, 100))
    assert conn.quiet_since() is not None and conn.owed == 0  # answered: waits again
    client.send(F.frame(F.DATA, F.END_STREAM, 1, b""))
    assert conn.quiet_since() is None  # half-closed: owed its last answers
    stream.finish(StatusCode.OK)
    assert conn.owed == 0
    client.send(F.frame(F.DATA, F.END_STREAM, 3, b""))
    assert conn.owed == 1  # the unary call, now whole


async def test_window_settings_change_open_streams():
    client = Client()
    client.start({F.INITIAL_WINDOW_SIZE: 100})
    client.send(client.headers(1))
    (call,) = client.calls
    client.send(F.settings({F.INITIAL_WINDOW_SIZE: 40}))
    assert call.send_window == 40
    # the last of several values counts, applied once
    client.send(F.settings({F.INITIAL_WINDOW_SIZE: 10}) + F.settings({F.INITIAL_WINDOW_SIZE: 70}))
    assert call.send_window == 70
    # a change that takes a stream's window past 2**31 - 1: FLOW_CONTROL_ERROR (§6.9.2)
    client.send(F.window_update(1, F.MAX_WINDOW - 70))
    assert protocol_error(client, F.settings({F.INITIAL_WINDOW_SIZE: 71})) == F.FLOW_CONTROL_ERROR


async def test_a_connection_window_update_wakes_streams_only_when_it_was_exhausted():
    """Each stream waking on every WINDOW_UPDATE of the connection cost a flood of +1
    increments 13 times a PING flood; only an exhausted window can hold streams up."""
    client = Client()
    client.start()
    client.send(client.headers(1))
    (call,) = client.calls
    waiting = call._window = trio.Event()  # (as a send out of window waits)
    client.send(F.window_update(0, 1) * 3)
    assert not waiting.is_set()
    client.conn.send_window = -5  # (a smaller SETTINGS_INITIAL_WINDOW_SIZE can do this)
    client.send(F.window_update(0, 5))  # still not positive: nobody can send yet
    assert not waiting.is_set()
    client.send(F.window_update(0, 1))
    assert waiting.is_set() and call._window is None


async def test_data_after_the_clients_end_and_a_short_priority_reset_the_stream():
    """RFC 9113: DATA on a half-closed (remote) stream is a STREAM_CLOSED stream error
    (it reached the call, which then failed INTERNAL: more than one message); a PRIORITY
    frame of other than 5 bytes a FRAME_SIZE_ERROR one."""
    client = Client()
    client.start()
    client.send(client.headers(1) + F.frame(F.DATA, F.END_STREAM, 1, message(b"a")))
    (call,) = client.calls
    assert rst(client.send(F.frame(F.DATA, 0, 1, message(b"b"))), 1) == F.STREAM_CLOSED
    assert call._closed and len(call._inbox) == 1
    client.send(client.headers(3))
    assert rst(client.send(F.frame(F.PRIORITY, 0, 3, bytes(4))), 3) == F.FRAME_SIZE_ERROR
    assert rst(client.send(F.frame(F.PRIORITY, 0, 7, bytes(6))), 7) == F.FRAME_SIZE_ERROR


async def test_a_stream_reset_for_its_window_is_reset_once():
    """Every later frame on it brought another RST_STREAM (201 for 200 DATA frames)."""
    client = Client()
    client.start()
    client.conn.stream_window = 10
    client.send(client.headers(1))
    assert rst(client.send(F.frame(F.DATA, 0, 1, bytes(11))), 1) == F.FLOW_CONTROL_ERROR
    for _ in range(3):
        assert client.send(F.frame(F.DATA, 0, 1, bytes(1))) == []
        assert client.send(F.window_update(1, 0)) == []
        assert client.send(F.frame(F.PRIORITY, 0, 1, bytes(4))) == []
    trailers = client.encoder.encode([(b":path", PATH)])  # (malformed: reset, if it were open)
    assert client.send(F.frame(F.HEADERS, F.END_HEADERS | F.END_STREAM, 1, trailers)) == []


BASE_REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", PATH),
    (b":authority", b"x"),
    (b"content-type", b"application/grpc"),
]


@pytest.mark.parametrize(
    "headers",
    [
        [(b":path", PATH), *BASE_REQUEST],  # a pseudo-header twice (RFC 9113 §8.3)
        [*BASE_REQUEST, (b"x-note", b"one\r\ntwo")],  # CR, LF or NUL in a value (§8.2.1)
        [*BASE_REQUEST, (b"x-note", b"nul\0")],
    ],
)
async def test_a_malformed_request_is_reset(headers):
    client = Client()
    client.start()
    block = client.encoder.encode(headers)
    assert rst(client.send(F.frame(F.HEADERS, F.END_HEADERS, 1, block)), 1) == F.PROTOCOL_ERROR
    assert client.calls == []


async def test_trailers_with_a_pseudo_header_reset_the_stream():
    client = Client()
    client.start()
    client.send(client.headers(1))
    (call,) = client.calls
    trailers = client.encoder.encode([(b":path", PATH)])
    frames = client.send(F.frame(F.HEADERS, F.END_HEADERS | F.END_STREAM, 1, trailers))
    assert rst(frames, 1) == F.PROTOCOL_ERROR and call._closed


async def test_a_bad_header_block_is_named_without_the_decoders_words():
    """They showed a memory address (`<memory at 0x7f...>`) to any client."""
    client = Client()
    client.start()
    with pytest.raises(F.ConnectionError_) as info:
        client.send(F.frame(F.HEADERS, F.END_HEADERS, 1, b"\xff\xff\xff\xff"))
    assert str(info.value.args[-1]).startswith("bad header block (") and "0x" not in str(info.value)


async def test_headers_on_a_closed_stream_and_oversized_header_lists():
    client = Client()
    client.start()
    client.send(client.headers(3))
    assert rst(client.send(client.headers(1)), 1) == F.STREAM_CLOSED  # a lower id
    # Above the advertised limit: that request fails, the connection goes on.
    frames = client.send(client.headers(5, [(b"x-big", b"v" * 20_000)]))
    (block,) = [payload for kind, _, sid, payload in frames if kind == F.HEADERS and sid == 5]
    trailers = dict(hpack.Decoder().decode(block, raw=True))
    assert trailers[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
    assert b"headers%20are%20too%20large" in trailers[b"grpc-message"]
    assert rst(frames, 5) == F.NO_ERROR and len(client.calls) == 1
    client.send(client.headers(7))
    assert len(client.calls) == 2
    # Far above it, hpack stops mid-block: its table may differ from the peer's.
    assert protocol_error(client, client.headers(9, [(b"x-big", b"v" * 70_000)])) == (
        F.ENHANCE_YOUR_CALM
    )


async def test_reset_and_trailers_from_the_client():
    client = Client()
    client.start()
    client.send(client.headers(1) + client.headers(3))
    one, three = client.calls
    client.send(F.frame(F.RST_STREAM, 0, 1, struct.pack(">I", F.CANCEL)))
    assert one._closed and one.scope.cancel_called
    trailers = client.encoder.encode([(b"x-trailer", b"1")])
    client.send(F.frame(F.HEADERS, F.END_HEADERS | F.END_STREAM, 3, trailers))
    assert three._ended


async def test_data_for_a_finished_stream_is_counted_and_dropped():
    client = Client()
    client.start()
    client.send(client.headers(1))
    (call,) = client.calls
    call.release()  # the call ended; the client still sends
    before = client.conn._recv_window
    assert client.send(F.frame(F.DATA, 0, 1, bytes(100))) == []
    assert client.conn._recv_window == before - 100


async def test_repeated_header_blocks_decode_as_the_table_says():
    """A block decoded before is reused only while the dynamic table is as it was: the
    same bytes (index 62, the newest entry) mean another header once the table grew."""
    client = Client()
    client.start()
    base = F.header_block(
        [(b":method", b"POST"), (b":path", PATH), (b"content-type", b"application/grpc")]
    )[1:]  # without its table size update: this block must not shrink the table
    add_a = base + b"\x40" + bytes([4]) + b"x-id" + bytes([1]) + b"a"  # with indexing
    add_b = base + b"\x40" + bytes([4]) + b"x-id" + bytes([1]) + b"b"
    newest = base + b"\xbe"  # indexed: dynamic entry 62
    sid = 1
    for block, want in ((add_a, "a"), (newest, "a"), (newest, "a"), (add_b, "b"), (newest, "b")):
        client.send(F.frame(F.HEADERS, F.END_HEADERS, sid, block))
        assert client.calls[-1].metadata["x-id"] == want, (sid, want)
        sid += 2


async def test_a_client_that_sends_and_never_reads_holds_a_bounded_output():
    """Each read of requests is answered (here: UNIMPLEMENTED, by the calls' tasks) and
    the client reads none of it: past ``max_unsent_bytes`` the server stops reading, so
    the client's sends block (18 MB of requests is more than the sockets' buffers hold)
    instead of the server's output growing."""
    limit = 32 * 1024
    unsent: list[int] = []
    sent = 0

    def flood(port: int) -> None:
        nonlocal sent
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.settimeout(2)  # (a send that waits this long: the server stopped reading)
            encoder = hpack.Encoder()
            message = struct.pack(">?I", False, 1000) + bytes(1000)
            s.sendall(F.PREFACE + F.settings({}))
            try:
                for burst in range(300):
                    frames = []
                    for i in range(60):
                        sid = 2 * (60 * burst + i) + 1
                        block = encoder.encode(
                            [
                                (b":method", b"POST"),
                                (b":scheme", b"http"),
                                (b":path", b"/no.Such/Method"),
                                (b":authority", b"x"),
                                (b"content-type", b"application/grpc"),
                            ]
                        )
                        frames.append(F.frame(F.HEADERS, F.END_HEADERS, sid, block))
                        frames.append(F.frame(F.DATA, F.END_STREAM, sid, message))
                    s.sendall(b"".join(frames))
                    sent += 60
                    time.sleep(0.001)
            except (TimeoutError, OSError):
                pass  # the server stopped reading: the sends block

    async with echo_server(limits=TransportLimits(max_unsent_bytes=limit)) as echo:
        thread = threading.Thread(target=flood, args=(echo.port,), daemon=True)
        thread.start()
        while thread.is_alive():
            for conn in echo.server.connections:
                conn.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                unsent.append(conn._unsent())
            await trio.sleep(0.01)
    assert sent < 300 * 60  # held up
    # the limit, and the answers to one read (256 KiB: about 250 of these requests)
    assert max(unsent) < limit + 64 * 1024


def _request_block(encoder: hpack.Encoder, path: str) -> bytes:
    return encoder.encode(
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", b"x"),
            (b"content-type", b"application/grpc"),
        ]
    )


async def _unsent_behind_a_client_that_does_not_read(frames: bytes, limit: int) -> list[int]:
    """Send ``frames`` after opening every flow-control window, read nothing; the
    server connection's unsent bytes, sampled for 1.5 s (``max_unsent_bytes=limit``)."""
    unsent: list[int] = []
    done = threading.Event()

    def client(port: int) -> None:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(
                F.PREFACE
                + F.settings({F.INITIAL_WINDOW_SIZE: F.MAX_WINDOW})
                + F.window_update(0, F.MAX_WINDOW - F.DEFAULT_WINDOW)
                + frames
            )
            done.wait(10)

    async with echo_server(limits=TransportLimits(max_unsent_bytes=limit)) as echo:
        thread = threading.Thread(target=client, args=(echo.port,), daemon=True)
        thread.start()
        try:
            with trio.move_on_after(1.5):
                while True:
                    for conn in echo.server.connections:
                        conn.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                        unsent.append(conn._unsent())
                    await trio.sleep(0.005)
        finally:
            done.set()
    return unsent


async def test_a_stream_whose_client_does_not_read_waits_to_send():
    """Small requests asking for large answers on one stream, from a client that opens
    every flow-control window and reads nothing: past ``max_unsent_bytes`` the stream's
    handler waits in its send, so the answers queued stay near the limit instead of
    growing with every request (400 of 64 KiB here)."""
    limit = 256 * 1024
    block = _request_block(hpack.Encoder(), STREAM_SIZED)
    requests = b"".join(message(b"65536") for _ in range(400))
    frames = F.frame(F.HEADERS, F.END_HEADERS, 1, block) + F.frame(F.DATA, 0, 1, requests)
    unsent = await _unsent_behind_a_client_that_does_not_read(frames, limit)
    assert max(unsent) > limit  # the client held the answers up
    assert max(unsent) < limit + 4 * 65536  # and the handler waited


async def test_unary_answers_to_a_client_that_does_not_read_wait_to_be_queued():
    """Unary calls asking for large answers (100 of 256 KiB here), from a client that
    opens every flow-control window and reads nothing: past ``max_unsent_bytes`` each
    handler waits before queuing its answer, so the connection's output stays near the
    limit (it held every answer, 25 MiB, before)."""
    limit = 256 * 1024
    encoder = hpack.Encoder()
    frames = b"".join(
        F.frame(F.HEADERS, F.END_HEADERS, sid, _request_block(encoder, SIZED))
        + F.frame(F.DATA, F.END_STREAM, sid, message(b"262144"))
        for sid in range(1, 201, 2)
    )
    unsent = await _unsent_behind_a_client_that_does_not_read(frames, limit)
    assert max(unsent) > limit  # the client held the answers up
    assert max(unsent) < limit + 2 * 262144  # and the handlers waited


async def test_a_request_cut_short_by_its_end_fails_internal():
    """A client that half-closes in the middle of a message (as gRPC's servers answer
    it): INTERNAL, for a stream and a unary call alike, never a clean end."""
    async with echo_server() as echo:
        raw = await trio.to_thread.run_sync(RawH2, echo.port)
        try:
            stream, unary = raw.start(STREAM), raw.start(UNARY)
            await trio.to_thread.run_sync(
                lambda: (
                    raw.send(stream, message(b"a") + message(b"bc")[:-1], end=True),
                    raw.send(unary, message(b"bc")[:-1], end=True),
                )
            )
            for sid in (stream, unary):
                status = await trio.to_thread.run_sync(raw.status, sid)
                assert status == (StatusCode.INTERNAL.value, "the request ended mid-message")
        finally:
            raw.close()


async def test_a_unary_call_with_more_than_one_request_message_fails_internal():
    """gRPC's servers answer INTERNAL to a unary call whose client sends two messages;
    rsrv does too, and never runs the handler: it starts once the client half-closes
    (with the message, as clients send it, or later)."""
    async with echo_server(limits=TransportLimits(max_message_bytes=64 * 1024)) as echo:
        raw = await trio.to_thread.run_sync(RawH2, echo.port)
        try:
            both = raw.start(UNARY)
            await trio.to_thread.run_sync(
                lambda: raw.send(both, message(b"a") + message(b"b"), end=True)
            )
            status = await trio.to_thread.run_sync(raw.status, both)
            assert status is not None and status[0] == StatusCode.INTERNAL.value, status
            assert "more than one request message" in status[1]

            late = raw.start(HOLD)
            await trio.to_thread.run_sync(raw.send, late, message(b"a"))
            await trio.sleep(0.05)
            assert echo.started == 0  # not before the end
            await trio.to_thread.run_sync(lambda: raw.send(late, message(b"b"), end=True))
            status = await trio.to_thread.run_sync(raw.status, late)
            assert status is not None and status[0] == StatusCode.INTERNAL.value, status
            assert echo.started == 0

            ended_later = raw.start(UNARY)
            await trio.to_thread.run_sync(raw.send, ended_later, message(b"x"))
            await trio.sleep(0.05)
            await trio.to_thread.run_sync(lambda: raw.send(ended_later, b"", end=True))
            status = await trio.to_thread.run_sync(raw.status, ended_later)
            assert status == (0, "")  # one message, its end apart: answered as ever

            limits = echo.server.limits
            big = raw.start(UNARY)  # a second message over the limit, or compressed,
            zipped = raw.start(UNARY, headers=[("grpc-encoding", "gzip")])
            cut = raw.start(UNARY)  # or cut short by the end: never read, never inflated
            await trio.to_thread.run_sync(
                lambda: (
                    raw.send(
                        big, message(b"a") + message(bytes(limits.max_message_bytes + 1)), end=True
                    ),
                    raw.send(
                        zipped,
                        message(b"a") + message(gzip.compress(b"b"), compressed=True),
                        end=True,
                    ),
                    raw.send(cut, message(b"a") + message(b"bc")[:-1], end=True),
                )
            )
            for sid in (big, zipped, cut):
                status = await trio.to_thread.run_sync(raw.status, sid)
                assert status is not None and status[0] == StatusCode.INTERNAL.value, status
                assert "more than one request message" in status[1]
            assert echo.started == 1  # the call with one message, alone
        finally:
            raw.close()


async def test_connections_take_turns_to_inflate(monkeypatch):
    """One connection's six compressed requests took both of the server's inflaters
    in turn: another client's one waited behind all six (19 s behind 24 gzip bombs)."""
    from rsrv.transport import _messages

    started: list[bytes] = []
    decompress = _messages.MessageReader._decompress

    def slow(reader, payload, room):
        started.append(gzip.decompress(payload)[:1])
        time.sleep(0.2)  # (a bomb's inflation)
        return decompress(reader, payload, room)

    monkeypatch.setattr(_messages.MessageReader, "_decompress", slow)
    async with echo_server() as echo:
        busy, other = RawH2(echo.port), RawH2(echo.port)
        try:

            def send(raw, tag: bytes, count: int) -> list[int]:
                sids = [raw.start(UNARY, headers=[("grpc-encoding", "gzip")]) for _ in range(count)]
                for sid in sids:
                    raw.send(sid, message(gzip.compress(tag), compressed=True), end=True)
                return sids

            many = await trio.to_thread.run_sync(send, busy, b"a", 6)
            await wait_for(lambda: len(started) >= 1, "the first inflation")
            (one,) = await trio.to_thread.run_sync(send, other, b"b", 1)
            assert await trio.to_thread.run_sync(other.status, one) == (0, "")
            for sid in many:
                assert await trio.to_thread.run_sync(busy.status, sid) == (0, "")
        finally:
            busy.close()
            other.close()
    assert started.index(b"b") <= 3  # (it was 6: after every one of the other's)
