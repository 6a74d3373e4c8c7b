"""HTTP/2 frames (RFC 9113 §4, §6): what rsrv reads and writes, as bytes.

Reading is :class:`FrameReader` (bytes in, ``(type, flags, stream_id, payload)`` out,
the frame size limit enforced); writing is a handful of functions returning one frame's
bytes each. Header blocks are HPACK-encoded without the dynamic table
(:func:`header_block`: indexed static entries and literals "without indexing"), so the
encoder keeps no state and a response's (or a request's) headers can be prebuilt once;
the peer's blocks are decoded by :class:`HeaderDecoder` (``hpack``), each distinct block
once per dynamic-table state.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import hpack
import hpack.exceptions

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9

# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# settings
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME = 16_384
MAX_WINDOW = 2**31 - 1

_HEADER = struct.Struct(">HBBBI")  # 24-bit length as (high 16, low 8), type, flags, id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")


class ConnectionError_(Exception):
    """The peer broke the protocol: the connection ends with GOAWAY ``code``."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


def frame_header(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    return _HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream_id)


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in values.items()))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _U32.pack(last_stream_id) + _U32.pack(code) + debug)


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6")
    return [_SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]


def parse_u32(payload: bytes, what: str) -> int:
    if len(payload) != 4:
        raise ConnectionError_(FRAME_SIZE_ERROR, f"{what} payload is {len(payload)} bytes, not 4")
    return _U32.unpack(payload)[0] & 0x7FFFFFFF


def strip_padding(flags: int, payload: bytes) -> bytes:
    """The payload of a DATA or HEADERS frame without its padding."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]


class FrameReader:
    """Frames out of a byte stream. ``feed`` returns the complete frames so far.

    A frame that arrives in many reads is gathered without copying what came before
    at each read (a 16 MiB frame comes in 64 reads of 256 KiB)."""

    __slots__ = ("_buf", "_need", "max_frame_size")

    def __init__(self, max_frame_size: int):
        self._buf = bytearray()
        self._need = 0  # bytes the buffered partial frame needs before parsing resumes
        self.max_frame_size = max_frame_size

    def feed(self, data: bytes) -> list[tuple[int, int, int, bytes]]:
        if self._buf:
            self._buf += data
            if len(self._buf) < self._need:
                return []
            data = bytes(self._buf)
            self._buf.clear()
        frames = []
        pos, end = 0, len(data)
        unpack = _HEADER.unpack_from
        limit = self.max_frame_size
        need = 9
        while end - pos >= 9:
            high, low, kind, flags, sid = unpack(data, pos)
            length = (high << 8) | low
            if length > limit:
                raise ConnectionError_(
                    FRAME_SIZE_ERROR, f"frame of {length} bytes, above the {limit} allowed"
                )
            if end - pos - 9 < length:
                need = 9 + length
                break
            frames.append((kind, flags, sid & 0x7FFFFFFF, data[pos + 9 : pos + 9 + length]))
            pos += 9 + length
        if pos < end:
            self._buf += data[pos:]
            self._need = need
        return frames


# -- HPACK without the dynamic table (RFC 7541) ------------------------------------------


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(value: bytes) -> bytes:
    return _integer(len(value), 7, 0) + value  # not Huffman-coded


#: Static-table entries used here (RFC 7541 Appendix A): name -> index, and full
#: (name, value) -> index.
_STATIC_NAME = {
    b":authority": 1,
    b":path": 4,
    b":status": 8,
    b"content-type": 31,
    b"user-agent": 58,
}
_STATIC_FULL = {
    (b":method", b"POST"): 3,
    (b":scheme", b"http"): 6,
    (b":scheme", b"https"): 7,
    (b":status", b"200"): 8,
}


def header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HPACK block that touches no dynamic table: indexed static entries, else
    literals without indexing (static name index where there is one). It opens with a
    dynamic table size update to 0, so it stays valid whatever table size the peer's
    SETTINGS_HEADER_TABLE_SIZE allows (RFC 7541 §4.2, §6.3). :func:`header_fields`
    of more headers may be appended to it."""
    return b"\x20" + header_fields(headers)


def header_fields(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The HPACK representations of ``headers`` (as in :func:`header_block`), without
    the table size update that opens a block: what is appended to a prebuilt block."""
    out = []
    for name, value in headers:
        full = _STATIC_FULL.get((name, value))
        if full is not None:
            out.append(_integer(full, 7, 0x80))
            continue
        index = _STATIC_NAME.get(name)
        if index is not None:
            out.append(_integer(index, 4, 0x00) + _string(value))
        else:
            out.append(b"\x00" + _string(name) + _string(value))
    return b"".join(out)


class HeaderListTooLarge(Exception):
    """A header list larger than this side accepts (its stream fails, not the
    connection)."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"a header list of {size} bytes, above the {limit} accepted")
        self.size, self.limit = size, limit


class HeaderDecoder:
    """The peer's header blocks, decoded (``hpack``) once per dynamic-table state.

    Peers send the same block over and over (every field indexed, the table unchanged
    by it); decoding it again would give the same list. The table's state is named by
    its newest entry (each insertion makes a new object, kept alive by the table) and
    its length; a block that changed the table is never reused. ``parse`` turns a
    decoded list into what the connection keeps (cached with it, so it must not be
    mutated); by default the list itself.

    :meth:`decode` raises :class:`HeaderListTooLarge` for a list above
    ``max_header_list_size`` (RFC 9113 §6.5.2's size: names, values, 32 bytes each)
    that was decoded whole: only its stream fails. It raises :class:`ConnectionError_`
    (ENHANCE_YOUR_CALM for a list above four times that, at which hpack stops
    mid-block; COMPRESSION_ERROR for a malformed block) when the decoder's state no
    longer matches the peer's, so the connection must end.
    """

    __slots__ = ("_decoder", "_decoded", "_parse", "max_header_list_size")

    def __init__(self, max_header_list_size: int, parse: Callable[[list], Any] | None = None):
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = 4 * max_header_list_size
        self._decoded: dict[bytes, tuple] = {}  # block -> (table state, parsed)
        self._parse = parse
        self.max_header_list_size = max_header_list_size

    def decode(self, block: bytes) -> Any:
        table = self._decoder.header_table
        state = _table_state(table)
        hit = self._decoded.get(block)
        if hit is not None and hit[0] == state and hit[0][0] is state[0]:
            return hit[1]
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.exceptions.OversizedHeaderListError:
            # hpack stops mid-block, so its table may no longer match the peer's
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header list too large") from None
        except hpack.exceptions.HPACKError as e:  # (its text may show a memory address)
            why = f"bad header block ({type(e).__name__})"
            raise ConnectionError_(COMPRESSION_ERROR, why) from None
        size = sum(len(name) + len(value) + 32 for name, value in headers)
        if size > self.max_header_list_size:
            raise HeaderListTooLarge(size, self.max_header_list_size)
        parsed = headers if self._parse is None else self._parse(headers)
        if _table_state(table) == state and len(block) <= _CACHED_BLOCK:
            if len(self._decoded) >= 64:
                self._decoded.clear()
            self._decoded[block] = (state, parsed)
        return parsed


_CACHED_BLOCK = 4096  # larger header blocks are decoded each time, never kept


def _table_state(table) -> tuple:
    entries = table.dynamic_entries
    return (entries[0] if entries else None, len(entries), table.maxsize)
