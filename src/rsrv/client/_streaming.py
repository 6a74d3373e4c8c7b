"""Streaming inference (ModelStreamInfer): requests sent on one stream, answers
received as they come and matched to their requests by id."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import trio
from google.protobuf.message import DecodeError
from purerpc.grpclib.status import StatusCode

from rsrv.client._errors import InferenceServerError
from rsrv.client._tensors import InferResult, ShmInput, ShmOutput, build_request
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.transport import CallEnded, MessageTooLarge, StreamingCall

__all__ = ["InferStream"]

_ids = itertools.count(1)


class InferStream:
    """One ModelStreamInfer stream (from ``InferenceClient.stream()``).

    :meth:`infer` sends a request and returns its own answer (other answers are not
    consumed); :meth:`send` only sends, and :meth:`receive` (or ``async for``) returns
    the answers no :meth:`infer` is waiting for, in arrival order. A request without
    an id gets a unique one (``rsrv-<n>``, none in use on the stream), since answers
    are matched by id: a request (:meth:`infer` or :meth:`send`) with the id of an
    :meth:`infer` still waiting, or of a cancelled one whose answer is still to come, and
    an :meth:`infer` with the id of a :meth:`send` whose answer is still to come, is a
    ValueError, and is not sent. A
    failed request raises :class:`InferenceServerError` (code UNKNOWN: a stream's error
    answer carries only the server's text; ``request_id`` says which); one larger than
    ``max_send_message_bytes`` fails RESOURCE_EXHAUSTED without being sent, and the
    stream goes on. The answer of an :meth:`infer` that was cancelled (its timeout,
    say) is dropped when it comes, never returned by :meth:`receive`; one cancelled
    while its request was still going out (a large request waiting on flow control)
    ends the stream, CANCELLED, since the rest of a message cut there cannot follow
    (a request that had not started going out is simply not sent). :meth:`end`
    half-closes: answers keep coming, and ``async for`` ends once the server has ended
    the stream. Once the stream has ended, waiting calls raise InferenceServerError
    with its status (UNAVAILABLE when it ended OK before their answers). Several tasks
    may send and wait at once.
    """

    def __init__(self, call: StreamingCall):
        self._call = call
        self._send_lock = trio.StrictFIFOLock()
        self._waiting: dict[str, list] = {}  # id -> [event, answer]
        self._abandoned: set[str] = set()  # ids of cancelled infers: their answers go
        self._sent: collections.Counter[str] = collections.Counter()  # send()s unanswered
        self._unclaimed_in, self._unclaimed = trio.open_memory_channel(math.inf)
        self._ended: InferenceServerError | None = None

    async def send(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray | ShmInput],
        outputs: Sequence[str | ShmOutput] | None = None,
        *,
        version: str = "",
        request_id: str = "",
        parameters: Mapping[str, bool | int | float | str] | None = None,
    ) -> str:
        """Send one request (as ``InferenceClient.infer`` takes it); returns its id.
        ValueError for an id whose answer could not be told apart (see the class)."""
        request_id = request_id or self._new_id()
        self._check_unambiguous(request_id)
        self._sent[request_id] += 1
        try:
            await self._send_request(model, inputs, outputs, version, request_id, parameters)
        except BaseException:
            self._answered(request_id)  # (not sent: no answer comes)
            raise
        return request_id

    def _new_id(self) -> str:
        while True:  # (skipping ids the caller gave that look like ours)
            request_id = f"rsrv-{next(_ids)}"
            if not (
                request_id in self._waiting
                or request_id in self._abandoned
                or request_id in self._sent
            ):
                return request_id

    def _answered(self, request_id: str) -> None:
        """A send()'s answer came (or it was not sent)."""
        self._sent[request_id] -= 1
        if self._sent[request_id] <= 0:
            del self._sent[request_id]

    async def _send_request(
        self, model, inputs, outputs, version: str, request_id: str, parameters
    ) -> None:
        request = build_request(
            model,
            inputs,
            outputs,
            version=version,
            request_id=request_id,
            parameters=parameters,
        )
        await self._send(request.SerializeToString())

    def _check_unambiguous(self, request_id: str) -> None:
        if request_id in self._waiting:
            raise ValueError(
                f"request id {request_id!r} is already waiting for its answer on this "
                "stream (answers are matched by id)"
            )
        if request_id in self._abandoned:
            raise ValueError(
                f"request id {request_id!r}: the answer of a cancelled infer of that id is "
                "still to come on this stream (answers are matched by id); use another id"
            )

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray | ShmInput],
        outputs: Sequence[str | ShmOutput] | None = None,
        *,
        version: str = "",
        request_id: str = "",
        parameters: Mapping[str, bool | int | float | str] | None = None,
    ) -> InferResult:
        """Send one request and wait for its answer (same arguments as :meth:`send`)."""
        request_id = request_id or self._new_id()
        self._check_unambiguous(request_id)
        if request_id in self._sent:
            raise ValueError(
                f"request id {request_id!r}: the answer of a request sent with that id is "
                "still to come on this stream (answers are matched by id); use another id"
            )
        slot = self._waiting[request_id] = [trio.Event(), None]
        sent = False
        try:
            await self._send_request(model, inputs, outputs, version, request_id, parameters)
            sent = True
            await slot[0].wait()
        except trio.Cancelled:
            if sent and slot[1] is None and self._ended is None:  # its answer may yet come
                self._abandoned.add(request_id)
            raise
        finally:
            del self._waiting[request_id]
        if slot[1] is None:  # the stream ended first
            error = self._ended
            raise InferenceServerError(
                error.code,
                error.message,
                reached_server=error.reached_server,
                request_id=request_id,
            )
        return _result(slot[1])

    async def receive(self) -> InferResult:
        """The next answer no :meth:`infer` claimed; raises InferenceServerError for a
        failed request, or once the stream has ended (with the stream's status,
        UNAVAILABLE when that was OK)."""
        try:
            answer = await self._unclaimed.receive()
        except trio.EndOfChannel:
            raise self._ended from None
        return _result(answer)

    async def end(self) -> None:
        """Half-close the stream: no more requests (sending raises
        InferenceServerError); the answers still to come keep coming."""
        async with self._send_lock:
            await self._call.end()

    def __aiter__(self):
        return self

    async def __anext__(self) -> InferResult:
        try:
            answer = await self._unclaimed.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        return _result(answer)

    async def _send(self, payload: bytes) -> None:
        async with self._send_lock:
            try:
                await self._call.send(payload)
            except CallEnded:
                raise self._stream_error() from None
            except MessageTooLarge as e:  # (not sent; the stream goes on)
                raise InferenceServerError(
                    StatusCode.RESOURCE_EXHAUSTED, str(e), reached_server=False
                ) from None

    def _stream_error(self) -> InferenceServerError:
        call = self._call
        if call.done:
            if call.status is StatusCode.OK:  # ended cleanly, yet something waits on it
                code, message = StatusCode.UNAVAILABLE, "the stream has ended (OK)"
            else:
                code, message = call.status, call.message or "the stream has ended"
            return InferenceServerError(code, message, reached_server=call.reached_server)
        return InferenceServerError(StatusCode.CANCELLED, "the stream was half-closed")

    async def _read(self) -> None:
        """Deliver every answer to its waiter, or to the unclaimed queue."""
        async with self._unclaimed_in:
            async for message in self._call:
                try:
                    answer = pb.ModelStreamInferResponse.FromString(message)
                except DecodeError as e:  # the stream ends, saying why
                    self._call.cancel(
                        StatusCode.INTERNAL, f"cannot parse an answer of the stream: {e}"
                    )
                    break
                request_id = answer.infer_response.id
                slot = self._waiting.get(request_id)
                if request_id in self._abandoned:
                    self._abandoned.discard(request_id)  # its infer was cancelled
                elif slot is not None and slot[1] is None:
                    slot[1] = answer
                    slot[0].set()
                else:
                    if request_id in self._sent:
                        self._answered(request_id)
                    self._unclaimed_in.send_nowait(answer)
            self._ended = self._stream_error()
            self._abandoned.clear()
            self._sent.clear()
            for slot in self._waiting.values():
                slot[0].set()


def _result(answer: Any) -> InferResult:
    if answer.error_message:
        raise InferenceServerError(
            StatusCode.UNKNOWN, answer.error_message, request_id=answer.infer_response.id
        )
    return InferResult(answer.infer_response)
