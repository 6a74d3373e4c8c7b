"""The transport's message reader: framing, limits, the per-connection inflate budget, and
where large requests are parsed."""

from __future__ import annotations

import gc
import gzip
import struct
import threading
import zlib

import pytest
from purerpc.grpclib.status import StatusCode
from support.assertions import frames_holding

from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.transport._connection import _parse_timeout
from rsrv.transport._messages import InflateBudget, MessageError, MessageReader, frame
from rsrv.transport._server import PARSE_ON_LOOP_BYTES, Method, request_decoder

MIB = 1 << 20


def reader(encoding=None, limit=MIB, budget=None) -> MessageReader:
    return MessageReader(encoding, limit, budget or InflateBudget(limit))


def compressed(payload: bytes, how=gzip.compress) -> bytes:
    body = how(payload)
    return struct.pack(">?I", True, len(body)) + body


def test_messages_split_and_joined_across_frames():
    data = frame(b"first") + frame(b"") + frame(b"x" * 1000)
    r = reader()
    out = []
    for i in range(0, len(data), 7):
        out += r.feed(data[i : i + 7])
        assert r.partial == (len(out) < 3 and i + 7 < len(data))
    assert out == [b"first", b"", b"x" * 1000]
    assert not r.partial


def test_oversized_message_is_skipped_without_buffering():
    r = reader(limit=100)
    (error,) = r.feed(struct.pack(">?I", False, 5000) + bytes(10))
    assert isinstance(error, MessageError)
    assert error.status.status_code is StatusCode.RESOURCE_EXHAUSTED
    assert "5000 bytes, larger than the maximum 100" in error.status.status_message
    assert r.partial and len(r._buf) == 0  # skipping, holding nothing
    assert r.feed(bytes(4990)) == []
    assert r.feed(frame(b"next")) == [b"next"]


def test_compressed_message_without_or_with_an_unknown_encoding():
    (error,) = reader().feed(compressed(b"x"))
    assert error.status.status_code is StatusCode.INTERNAL
    assert "declared no grpc-encoding" in error.status.status_message
    assert "None" not in error.status.status_message
    (error,) = reader("snappy").feed(compressed(b"x"))
    assert error.status.status_code is StatusCode.UNIMPLEMENTED
    assert "'snappy'" in error.status.status_message


def test_gzip_and_deflate_are_inflated():
    assert reader("gzip").feed(compressed(b"hello" * 100)) == [b"hello" * 100]
    assert reader("deflate").feed(compressed(b"hi", zlib.compress)) == [b"hi"]
    (error,) = reader("gzip").feed(compressed(b"zz")[:-3] + b"abc")
    assert error.status.status_code is StatusCode.INTERNAL


def test_inflate_budget_is_shared_by_a_connection_and_returned_when_calls_end():
    """Four 40-byte-per-MiB bombs on one connection: the first inflates, the others are
    refused while it is held; its call ending returns the budget."""
    budget = InflateBudget(MIB)
    bomb = compressed(bytes(MIB))
    assert len(bomb) < 2000
    first = reader("gzip", budget=budget)
    assert first.feed(bomb) == [bytes(MIB)]
    assert budget.used == MIB
    for _ in range(3):
        (error,) = reader("gzip", budget=budget).feed(bomb)
        assert error.status.status_code is StatusCode.RESOURCE_EXHAUSTED
        assert "this connection's calls in flight" in error.status.status_message
    first.release()
    assert budget.used == 0
    assert reader("gzip", budget=budget).feed(bomb) == [bytes(MIB)]


def test_a_consumed_message_gives_its_budget_back():
    """A long stream of compressed messages, each consumed before the next: the budget
    counts what is held now, not what the stream ever inflated."""
    budget = InflateBudget(MIB)
    stream = reader("gzip", budget=budget)
    for _ in range(8):  # 8 x 300 KiB through a 1 MiB budget
        (message,) = stream.feed(compressed(bytes(300 * 1024)))
        assert message == bytes(300 * 1024) and budget.used == 300 * 1024
        stream.consumed(message)
        assert budget.used == 0
    stream.consumed(b"plain")  # an uncompressed message charged nothing
    (held,) = stream.feed(compressed(bytes(1000)))
    stream.release()  # unread when the call ends
    assert budget.used == 0 and stream.inflated == 0
    assert held


def test_a_cut_short_or_overlong_compressed_message_is_an_error():
    body = gzip.compress(b"hello" * 1000)
    for broken in (body[: len(body) // 2], body + b"trailing"):
        (error,) = reader("gzip").feed(struct.pack(">?I", True, len(broken)) + broken)
        assert isinstance(error, MessageError)
        assert error.status.status_code is StatusCode.INTERNAL
        assert "cut short or has bytes after its end" in error.status.status_message


def test_bomb_larger_than_the_message_limit():
    (error,) = reader("gzip", limit=MIB).feed(compressed(bytes(4 * MIB)))
    assert error.status.status_code is StatusCode.RESOURCE_EXHAUSTED
    assert "decompressed" in error.status.status_message


def test_grpc_timeout_header():
    assert _parse_timeout(b"5S") == 5.0
    assert _parse_timeout(b"250m") == 0.25
    assert _parse_timeout(b"2H") == 7200.0
    assert _parse_timeout(b"100n") == pytest.approx(1e-7)
    for bad in (b"", b"S", b"5", b"-5S", b"123456789S", b"5s", b"1.5S"):
        assert _parse_timeout(bad) is None, bad


async def test_a_large_request_is_parsed_off_the_loop():
    """A protobuf request above PARSE_ON_LOOP_BYTES is parsed in a worker thread (64 MiB
    held the loop 33 ms); a smaller one, or one a method does not parse, on the loop."""
    threads = []

    def decode(raw: bytes) -> int:
        threads.append(threading.current_thread())
        return len(raw)

    parsed = Method("/a.B/C", None, decode, bytes, parse_large=True)
    kept = Method("/a.B/C", None, decode, bytes)
    large = bytes(PARSE_ON_LOOP_BYTES + 1)
    assert await parsed.parse(large[:-1]) == PARSE_ON_LOOP_BYTES
    assert await parsed.parse(large) == len(large)
    assert await kept.parse(large) == len(large)
    main = threading.main_thread()
    assert [t is main for t in threads] == [True, False, True]


async def test_a_large_request_that_fails_to_parse_is_not_held_after_the_failure():
    """What a failed parse raised came back from its thread in a reference cycle that
    held the request's bytes (255 MiB inflated from a gzip bomb) until a collection."""
    parsed = Method("/a.B/C", None, request_decoder(pb.ModelInferRequest), bytes, parse_large=True)
    raw = b"\xff" * (PARSE_ON_LOOP_BYTES + 1)  # not a protobuf message

    gc.collect()
    gc.disable()
    before = frames_holding(raw)
    try:
        with pytest.raises(MessageError, match="cannot parse the request"):
            await parsed.parse(raw)
        assert frames_holding(raw) == before  # none of the parse's frames
    finally:
        gc.enable()
