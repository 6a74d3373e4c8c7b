"""The KServe V2 REST protocol (Triton's HTTP endpoint) as an ASGI app over the same
backend and checks as the gRPC service: :class:`RestService`.

What every request goes through, in order (specs/http.md):

1. **Routing** (``_rest_routes.route``): an unknown path is 404, a known path with
   another method 405 (with ``Allow``).
2. **Restricted protocols**: the endpoint's protocol group, as on gRPC; a request
   without the header (or with another value) is 403 with Triton's message.
3. **The body**, for POST: a ``Content-Length`` above ``max_body_bytes`` is 413 before a
   byte of it is kept (what the client goes on sending is read and dropped, so that it
   sees the answer); a chunked body is counted as it arrives and refused the same way
   once it passes the limit. It must arrive within ``receive_timeout`` (else 408).
   ``Content-Encoding: gzip`` or ``deflate`` is inflated up to the same limit (above:
   413; another encoding: 415; corrupt: 400).
4. **Admission**: the in-flight cap and shutdown, shared with the gRPC port (429 / 503);
   not for the probes ``/v2/health/live`` and ``/ready``, which are never refused.
5. **The handler**: ``/infer`` here, the others in ``_rest_routes`` (through the gRPC
   handlers). Any exception becomes ``{"error": message}`` with the HTTP status of its
   gRPC status (``http_status``), the message exactly the gRPC one.

Inference responses are compressed when the request's ``Accept-Encoding`` names gzip or
deflate (others never are: tritonclient inflates only those), in a worker thread when
large. A request body that does not parse counts as its model's failure.
A client that disconnects while its inference is under way cancels it (withdrawn from
the scheduler's queue as a reset gRPC call is).
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import trio

from rsrv import threads
from rsrv.asgi import answer_lifespan, request_path
from rsrv.errors import InvalidArgument, ResourceExhausted, RsrvError, Unavailable
from rsrv.protocol._calls import Admission, Restriction
from rsrv.protocol._infer_flow import infer_counted
from rsrv.protocol._inference import InferenceService
from rsrv.protocol._rest_codec import (
    JSON_PARSE_BYTE_SECONDS,
    decode_rest_inputs,
    encode_rest_response,
    parse_rest_request,
    rest_deadline,
    rest_decode_seconds,
    rest_encode_seconds,
    rest_outputs,
    rest_priority,
)
from rsrv.protocol._rest_routes import (
    Body,
    Call,
    NoRoute,
    Reply,
    RestRoutes,
    json_reply,
    route,
)
from rsrv.protocol._status import http_status
from rsrv.transport import INFLATING_AT_ONCE
from rsrv.versions import parse_version

__all__ = ["RestService"]

log = logging.getLogger(__name__)
_EMPTY = memoryview(b"")
#: The health probes (a Kubernetes httpGet on /v2/health/live or /ready): answered at the
#: in-flight cap and while the worker drains (ready: false), as gRPC's health service is.
_PROBES = frozenset({"live", "ready"})
#: Answers compressed on the event loop up to this size (about 1 ms of zlib at level 6);
#: larger ones in a worker thread.
COMPRESS_ON_LOOP = 64 * 1024


class _HttpError(RsrvError):
    """A failure of the HTTP exchange itself, with its own HTTP status (its gRPC
    counterpart's status in ``code``, for the statistics)."""

    def __init__(self, message: str, status: int, code: str):
        super().__init__(message)
        self.http_status = status
        self.code = code


class _BodyTooLarge(ResourceExhausted):
    http_status = 413


class _Forbidden(Unavailable):
    http_status = 403


class _Disconnected(Exception):
    """The client went away before its request was read."""


class RestService:
    """The ASGI app. ``service`` is the gRPC service of the same backend: the endpoints
    other than ``/infer`` call its handlers. ``restrictions`` as on the gRPC port;
    ``max_body_bytes``: the largest request body, before and after inflating;
    ``receive_timeout``: seconds a request body may take to arrive."""

    def __init__(
        self,
        service: InferenceService,
        restrictions: Iterable[Restriction] = (),
        *,
        max_body_bytes: int,
        receive_timeout: float = 60.0,
    ):
        self.backend = service.backend
        self.routes = RestRoutes(service)
        self.admission: Admission = self.backend.admission
        self.max_body_bytes = max_body_bytes
        self.receive_timeout = receive_timeout
        # compressed bodies inflating at once, each in a worker thread (a small body may
        # inflate to max_message_bytes: seconds of zlib that must not hold the loop)
        self._inflating = trio.CapacityLimiter(INFLATING_AT_ONCE)
        self._restricted = {p: r for r in restrictions for p in r.protocols}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
        if scope["type"] == "websocket":  # refused: 403 (ignored, hypercorn answered 500)
            await receive()
            await send({"type": "websocket.close"})
        if scope["type"] != "http":
            return
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope["headers"]
        }
        path = request_path(scope)
        try:
            reply = await self._handle(scope["method"], path, headers, receive)
        except _Disconnected:
            return
        except Exception as e:
            status, message = http_status(e)
            reply = json_reply({"error": message}, status)
            if isinstance(e, NoRoute) and e.allowed:
                reply.headers.append((b"allow", ", ".join(e.allowed).encode()))
        await _send(send, reply, head=scope["method"] == "HEAD")

    async def _handle(self, method: str, path: str, headers: dict[str, str], receive) -> Reply:
        try:
            name, group, params = route(method, path)
            restriction = self._restricted.get(group)
            if restriction is not None:
                try:
                    restriction.check(headers)
                except Unavailable as e:
                    raise _Forbidden(str(e)) from None
        except (NoRoute, _Forbidden):
            if method == "POST":  # (read, so that the client sees the answer, not a reset)
                await self._discard(receive)
            raise
        body = b""
        if method == "POST":
            body = await self._body(headers, receive)
        call = Call(method, path, params, headers, body)
        if name in _PROBES:  # never refused at the in-flight cap nor while draining
            return await getattr(self.routes, name)(call)
        with self.admission:
            if name == "infer":
                reply = await _cancel_on_disconnect(self.infer(call), receive)
                # (in its slot: a graceful shutdown waits for it)
                return await _compressed(reply, headers.get("accept-encoding"), self._inflating)
            return await getattr(self.routes, name)(call)

    async def _body(self, headers: dict[str, str], receive) -> Body:
        limit = self.max_body_bytes
        length = headers.get("content-length")
        if length is not None:
            count = _count(length)
            if count is None:
                raise _HttpError(f"invalid Content-Length {length!r}", 400, "INVALID_ARGUMENT")
            if count > limit:
                await self._discard(receive)
                raise _BodyTooLarge(
                    f"request body of {count} bytes is larger than the maximum "
                    f"{limit} (endpoints.max_message_bytes)"
                )
        received = _Received(count if length is not None else None)
        with trio.move_on_after(self.receive_timeout) as scope:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Disconnected
                chunk = message.get("body", b"")
                if received.size + len(chunk) > limit:
                    if message.get("more_body", False):
                        await self._discard(receive)
                    raise _BodyTooLarge(
                        f"request body of more than {limit} bytes is larger than the maximum "
                        f"{limit} (endpoints.max_message_bytes)"
                    )
                received.add(chunk)
                if not message.get("more_body", False):
                    break
        if scope.cancelled_caught:
            raise _HttpError(
                f"the request body did not arrive in full within {self.receive_timeout:g} s "
                "(endpoints.receive_timeout_seconds)",
                408,
                "DEADLINE_EXCEEDED",
            )
        body = received.body()
        encoding = headers.get("content-encoding", "")
        if encoding.strip().lower() in ("", "identity"):
            return body
        return await threads.run_sync(_inflate, body, encoding, limit, limiter=self._inflating)

    async def _discard(self, receive) -> None:
        """Read and drop what the client keeps sending of a refused body (never held), so
        that a client still writing it (tritonclient) reads the 413 rather than a reset;
        a pause of 0.25 s, or ``receive_timeout`` in all, ends it."""
        with trio.move_on_after(self.receive_timeout):
            while True:
                with trio.move_on_after(0.25):
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body"):
                        return
                    continue
                return

    async def infer(self, call: Call) -> Reply:
        """``POST /v2/models/{m}[/versions/{v}]/infer``: JSON (and binary data) in, the
        same checks, queue and statistics as ModelInfer, JSON (and binary data) out."""
        model = call.params["m"]
        if not model:
            raise InvalidArgument("model_name is empty")
        backend = self.backend
        start = time.perf_counter()
        served = backend.model(model, parse_version(call.params.get("v", "")))
        sig = served.bundle.signature
        produced = [t.name for t in sig.client_outputs]
        request = plan = None
        binary = _EMPTY

        def decode():
            return decode_rest_inputs(
                request, model, sig.client_inputs, binary, backend.shm, check_rows=served.check_rows
            )

        def prepare(now: float):
            nonlocal request, binary, plan
            # (parsed here: a request that cannot be parsed counts as the model's failure)
            request, binary = _parse_infer(call)
            plan = rest_outputs(request, model, produced, backend.shm)
            rest_priority(request)  # validated; the scheduler has no priorities
            # (JSON values are parsed as the inputs are checked: both in materialize)
            return _Deferred(rest_decode_seconds(request), decode), rest_deadline(request, now)

        def finish(outputs):  # (the join too: off the loop with the rest when large)
            order, as_values = plan
            header_json, parts = encode_rest_response(
                request, served.name, served.version, outputs, order, as_values, backend.shm
            )
            return header_json, b"".join([header_json, *parts]) if parts else None

        header_json, body = await infer_counted(
            backend,
            served,
            start,
            prepare,
            finish,
            _json_length(call) * JSON_PARSE_BYTE_SECONDS,
            lambda outputs: rest_encode_seconds(outputs, plan[1]),
        )
        if body is None:
            return Reply(200, header_json)
        return Reply(
            200,
            body,
            "application/octet-stream",
            [(b"inference-header-content-length", str(len(header_json)).encode())],
        )


class _Received:
    """A request body as its pieces arrive. One of a known length past ``_JOIN_BELOW``
    is copied into a buffer of that length piece by piece (joining the pieces at the
    end held the loop ~130 ms for 200 MB; growing a bytearray copied it again and
    again); others are joined."""

    def __init__(self, length: int | None):
        self._buffer = np.empty(length, np.uint8) if length and length > _JOIN_BELOW else None
        self._pieces: list[bytes] = []
        self.size = 0  # received so far

    def add(self, piece: bytes) -> None:
        end = self.size + len(piece)
        if self._buffer is None:
            if piece:
                self._pieces.append(piece)
        elif end <= len(self._buffer):
            self._buffer[self.size : end] = np.frombuffer(piece, np.uint8)
        else:  # (the HTTP layer holds a body to its Content-Length)
            raise _HttpError(
                "the request body is longer than its Content-Length", 400, "INVALID_ARGUMENT"
            )
        self.size = end

    def body(self) -> Body:
        """The body: bytes, or a read-only view of the buffer (bytes are read-only: so
        are the input arrays made from it)."""
        if self._buffer is None:
            return self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
        self._buffer.flags.writeable = False
        return memoryview(self._buffer[: self.size])


_JOIN_BELOW = 1 << 20  # bytes: a body this short is joined


@dataclass(frozen=True, slots=True)
class _Deferred:
    """A REST request's decoding, to run (``materialize``) later (``Prepared``)."""

    seconds: float
    materialize: Callable[[], dict]


async def _cancel_on_disconnect(work, receive):
    """Await ``work``; a client that disconnects meanwhile cancels it (_Disconnected).
    Its exception, if any, propagates as itself."""
    outcome: list = []

    async def run():
        try:
            outcome.append((True, await work))
        except Exception as e:
            outcome.append((False, e))
        nursery.cancel_scope.cancel()

    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        nursery.start_soon(watch)
    if not outcome:
        raise _Disconnected
    ok, value = outcome.pop()  # (the list, in run's frame, would hold the exception)
    if ok:
        return value
    try:
        raise value
    finally:  # (a cycle through the traceback kept the request, body and all, until
        del value  # a garbage collection)


def _count(text: str) -> int | None:
    """A decimal count as HTTP writes one (ASCII digits, nothing else), None otherwise;
    past 19 digits, 2**63 (more than any body: Python refuses to convert a string of
    thousands of digits)."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        return None
    return int(text) if len(text) <= 19 else 1 << 63


_INFLATE_SLICE = 1 << 16  # compressed bytes given to the inflater at a time (see _inflate)
_MAX_MEMBERS = 1000  # of a gzip body: a client sends one


def _inflate(body: Body, encoding: str, limit: int) -> bytes:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise _HttpError(
            f"request body encoded with {encoding!r}; rsrv accepts gzip and deflate "
            "(or no Content-Encoding)",
            415,
            "UNIMPLEMENTED",
        )
    # gzip: its header; deflate: the zlib format (what tritonclient sends) or raw deflate
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    if encoding == "deflate" and body[:1] and body[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS
    parts: list[bytes] = []
    size = 0
    view = memoryview(body)
    at = 0  # where the member being inflated starts
    for member in range(_MAX_MEMBERS):  # gzip: one after another (RFC 1952 §2.2)
        inflater = zlib.decompressobj(wbits)
        # The first member (usually the only one) at once; the others in slices, so that
        # what follows one (its unused_data, a copy) is a slice's rest, not the whole
        # rest of the body each time: many tiny members took quadratic time.
        while not inflater.eof and at < len(view):
            piece = view[at:] if not member else view[at : at + _INFLATE_SLICE]
            try:
                part = inflater.decompress(piece, limit + 1 - size)
            except zlib.error as e:
                raise InvalidArgument(
                    f"cannot decompress the {encoding} request body: {e}"
                ) from None
            size += len(part)
            parts.append(part)
            if size > limit:  # (what it left unread, unconsumed_tail, too: limit + 1 made)
                raise _BodyTooLarge(
                    f"request body of more than {limit} (decompressed) bytes is larger than "
                    f"the maximum {limit} (endpoints.max_message_bytes)"
                )
            at += len(piece) - len(inflater.unused_data)
        if not inflater.eof:
            raise InvalidArgument(f"cannot decompress the {encoding} request body: it is truncated")
        if at == len(view):
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if encoding != "gzip" or view[at : at + 2] != b"\x1f\x8b":
            raise InvalidArgument(
                f"the {encoding} request body has {len(view) - at} bytes after its compressed data"
            )
    raise InvalidArgument(f"the gzip request body has more than {_MAX_MEMBERS} members")


def _json_length(call: Call) -> int:
    """The bytes of ``call``'s JSON header: its body before the binary data, when
    ``Inference-Header-Content-Length`` is a length within it, else all of it."""
    header = call.headers.get("inference-header-content-length")
    size = None if header is None else _count(header)
    return len(call.body) if size is None else min(size, len(call.body))


def _parse_infer(call: Call):
    """The inference request of ``call``'s body and the binary data after its JSON
    header (``Inference-Header-Content-Length``); InvalidArgument when malformed."""
    body, binary = call.body, _EMPTY
    header = call.headers.get("inference-header-content-length")
    if header is not None:
        size = _count(header)
        if size is None or size > len(body):
            shown = header if len(header) <= 40 else header[:40] + "..."
            raise InvalidArgument(
                f"invalid Inference-Header-Content-Length {shown!r}: the JSON header "
                f"must be a length between 0 and the body's {len(body)} bytes"
            )
        view = memoryview(body)
        body, binary = view[:size], view[size:]
    return parse_rest_request(body), binary


def _accepted(accept: str) -> str | None:
    """gzip or deflate, if ``Accept-Encoding`` names one (gzip first), else None."""
    offered = {}
    for item in accept.lower().split(","):
        name, _, params = item.strip().partition(";")
        q = 1.0
        if params.strip().startswith("q="):
            try:
                q = float(params.strip()[2:])
            except ValueError:
                q = 0.0
        offered[name.strip()] = q
    for name in ("gzip", "deflate"):
        if offered.get(name, 0.0) > 0 and math.isfinite(offered[name]):
            return name
    return None


def _compress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        compressor = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        return compressor.compress(body) + compressor.flush()
    return zlib.compress(body)


async def _compressed(reply: Reply, accept: str | None, limiter: trio.CapacityLimiter) -> Reply:
    """``reply``, compressed as ``accept`` asks when it names gzip or deflate: in a
    worker thread (``limiter``) above COMPRESS_ON_LOOP bytes, never holding the loop
    for long. Only inference answers are (as Triton does): clients such as aiohttp ask
    for gzip on every request but inflate only what tritonclient does."""
    encoding = _accepted(accept) if accept and reply.body else None
    if encoding is None:
        return reply
    if len(reply.body) <= COMPRESS_ON_LOOP:
        body = _compress(reply.body, encoding)
    else:
        body = await threads.run_sync(_compress, reply.body, encoding, limiter=limiter)
    headers = [*reply.headers, (b"content-encoding", encoding.encode())]
    return Reply(reply.status, body, reply.content_type, headers)


async def _send(send, reply: Reply, *, head: bool = False) -> None:
    """Answer ``reply``; ``head``: its headers alone (a HEAD request)."""
    headers = [
        (b"content-type", reply.content_type.encode()),
        *reply.headers,
        (b"content-length", str(len(reply.body)).encode()),
    ]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else reply.body})
