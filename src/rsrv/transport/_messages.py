"""gRPC length-prefixed messages: framing them, and reading them out of DATA frames.

A gRPC message on the wire is a 1-byte compressed flag, a 4-byte big-endian length and
the payload. :class:`MessageReader` turns a stream's DATA payloads into whole messages,
enforcing the message limit on the declared length (an oversized message is skipped
without being buffered) and inflating compressed ones against a per-connection
:class:`InflateBudget`, so that a small compressed body cannot make one connection hold
more than a bounded number of decompressed bytes.

A message that cannot be delivered becomes a :class:`MessageError` in the reader's output
in its place: only that call fails, the connection and its other calls carry on.

A server's reader (no budget) leaves a compressed message :class:`Compressed`
for its call to inflate when it takes it (:meth:`MessageReader.inflate`): in a worker
thread, a few at a time per server (which bounds the memory they take), so that a small
compressed body that inflates to hundreds of megabytes never holds the event loop (a
client's one such call held every other call up for 0.4 s).
"""

from __future__ import annotations

import struct
import zlib

import trio
from purerpc.grpclib.exceptions import RpcFailedError
from purerpc.grpclib.status import Status, StatusCode

from rsrv import threads

__all__ = ["Compressed", "InflateBudget", "MessageError", "MessageReader", "frame"]

_HEADER = struct.Struct(">?I")
ACCEPTED_ENCODINGS = ("gzip", "deflate")


class MessageError(RpcFailedError):
    """A call that fails in the transport (a message that cannot be delivered, an
    unknown method...): the client receives ``status``."""

    def __init__(self, code: StatusCode, message: str):
        super().__init__(Status(code, message))


def frame(payload: bytes) -> bytes:
    """``payload`` as one uncompressed gRPC message."""
    return _HEADER.pack(False, len(payload)) + payload


class Compressed:
    """A compressed message, inflated when its call takes it."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes):
        self.payload = payload


class InflateBudget:
    """Decompressed bytes that the messages of one connection may hold at once.

    Charged when a client's reader inflates a compressed message, until the message is
    consumed (:meth:`MessageReader.consumed`) or its call ends. (A server's reader has
    none: it leaves a message to its call, which inflates it when it takes it.)
    """

    __slots__ = ("limit", "used")

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0


class MessageReader:
    """Whole messages out of one stream's DATA payloads.

    ``feed`` returns the messages (``bytes``, or :class:`MessageError` for one that
    cannot be delivered) completed by a payload. ``partial`` is True while a message
    has started arriving and is not complete. Each message taken from the stream's
    inbox is passed to ``consumed``, which gives back what it charged to the
    connection's inflate budget; ``release`` gives back the rest (call it when the
    call ends).
    """

    __slots__ = (
        "_buf",
        "_length",
        "_compressed",
        "_skip",
        "_encoding",
        "_limit",
        "_budget",
        "_setting",
        "_accepts_compressed",
        "_charged",
        "inflated",
    )

    def __init__(
        self,
        encoding: str | None,
        limit: int,
        budget: InflateBudget | None,
        setting: str = "endpoints.max_message_bytes",
        *,
        compressed: bool = True,
    ):
        self._buf = bytearray()
        self._accepts_compressed = compressed  # (a client that did not ask: refused)
        self._length: int | None = None  # payload length of the message being read
        self._compressed = False
        self._skip = 0  # bytes of an oversized message still to discard
        self._encoding = encoding
        self._limit = limit
        self._budget = budget
        self._setting = setting  # what sets ``limit``, named when a message exceeds it
        self.inflated = 0  # bytes charged to the budget by this stream, not given back
        # id -> size of each inflated message not consumed yet (alive in the inbox, so
        # no other object has its id meanwhile)
        self._charged: dict[int, int] = {}

    @property
    def partial(self) -> bool:
        return bool(self._buf) or self._length is not None or self._skip > 0

    def feed(self, data: bytes, room: int | None = None) -> list[bytes | Compressed | MessageError]:
        """The messages ``data`` completes; at most ``room`` (None: no limit), the others
        kept as bytes until a later call (``feed(b"", room)``) takes them: a stream
        whose inbox is full holds what its client sent as sent, not as one object per
        message (tiny messages would take several times their size)."""
        out: list[bytes | Compressed | MessageError] = []
        if self._skip:  # (the rest of an oversized message: nothing is buffered)
            take = min(self._skip, len(data))
            self._skip -= take
            data = data[take:]
            if self._skip:
                return out
        if room == 0:
            self._buf += data
            return out
        if not self._buf and self._length is None and len(data) >= 5:
            # The common case: the payload starts at a message boundary.
            compressed, length = _HEADER.unpack_from(data)
            if len(data) == 5 + length and length <= self._limit:
                out.append(self._deliver(compressed, data[5:]))
                return out
        self._buf += data
        buf = self._buf
        while room is None or len(out) < room:
            if self._length is None:
                if len(buf) < 5:
                    break
                self._compressed, self._length = _HEADER.unpack_from(buf)
                del buf[:5]
                if self._length > self._limit:
                    out.append(_too_large(self._length, self._limit, self._setting))
                    take = min(self._length, len(buf))
                    del buf[:take]
                    self._skip = self._length - take
                    self._length = None
                    if self._skip:
                        break
                    continue
            if len(buf) < self._length:
                break
            with memoryview(buf) as view:  # (one copy: a slice of buf would be two)
                payload = bytes(view[: self._length])
            del buf[: self._length]
            self._length = None
            out.append(self._deliver(self._compressed, payload))
        return out

    def _deliver(self, compressed: bool, payload: bytes) -> bytes | Compressed | MessageError:
        if not compressed:
            return payload
        encoding = self._encoding
        if encoding is None or encoding == "identity":
            return MessageError(
                StatusCode.INTERNAL,
                "the message has the compressed flag set, but the call declared no grpc-encoding",
            )
        if not self._accepts_compressed:
            return MessageError(
                StatusCode.INTERNAL,
                f"the message is compressed ({encoding}), but compressed responses were not "
                "asked for (ClientLimits.accept_compressed)",
            )
        if encoding not in ACCEPTED_ENCODINGS:
            return MessageError(
                StatusCode.UNIMPLEMENTED,
                f"message compressed with {encoding!r}; rsrv accepts gzip and deflate "
                "(or no compression)",
            )
        budget = self._budget
        if budget is None:  # (a server's: its call inflates it)
            return Compressed(payload)
        out = self._decompress(payload, min(self._limit, budget.limit - budget.used))
        if isinstance(out, bytes):
            budget.used += len(out)
            self.inflated += len(out)
            self._charged[id(out)] = len(out)
        return out

    async def inflate(
        self, message: Compressed, limiter: trio.CapacityLimiter
    ) -> bytes | MessageError:
        """``message`` inflated, up to the message limit, in a worker thread (one of
        ``limiter``'s, which bounds the memory inflating takes); the bytes are the
        caller's once it returns, so nothing is charged to the inflate budget."""
        return await threads.run_sync(
            self._decompress, message.payload, self._limit, limiter=limiter
        )

    def _decompress(self, payload: bytes, room: int) -> bytes | MessageError:
        """``payload`` inflated, or why not (more than ``room`` bytes, malformed)."""
        encoding = self._encoding
        inflater = zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib or gzip header
        try:
            out = inflater.decompress(payload, room + 1)
        except zlib.error as e:
            return MessageError(
                StatusCode.INTERNAL, f"cannot decompress the {encoding} message: {e}"
            )
        if len(out) > room:
            if room < self._limit:
                return MessageError(
                    StatusCode.RESOURCE_EXHAUSTED,
                    f"decompressed messages of this connection's calls in flight would exceed "
                    f"{self._budget.limit} bytes; send fewer compressed messages at once",
                )
            return _too_large(f"more than {self._limit} (decompressed)", self._limit, self._setting)
        if not inflater.eof or inflater.unused_data:
            return MessageError(
                StatusCode.INTERNAL,
                f"cannot decompress the {encoding} message: it is cut short or has bytes "
                "after its end",
            )
        return out

    def consumed(self, message: bytes | MessageError) -> None:
        """``message``, taken from the inbox, is the handler's now: what it charged to
        the inflate budget is given back."""
        if self._charged:
            size = self._charged.pop(id(message), 0)
            self._budget.used -= size
            self.inflated -= size

    def release(self) -> None:
        if self.inflated:  # (only a client's reader charges a budget)
            self._budget.used -= self.inflated
        self.inflated = 0
        self._charged.clear()
        self._buf = bytearray()


def _too_large(size: int | str, limit: int, setting: str) -> MessageError:
    return MessageError(
        StatusCode.RESOURCE_EXHAUSTED,
        f"received message of {size} bytes, larger than the maximum {limit} ({setting})",
    )
