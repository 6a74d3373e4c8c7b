"""Echo servers: ModelInfer answered with a canned response, no codec, scheduler or model.

    python benchmarks/echo_server.py [--transport purerpc|rsrv] PORT

``--transport purerpc`` (the default): the **stock purerpc echo**. rsrv's generated
servicer (`rsrv.protocol.generated.inference`) on unmodified purerpc under trio (anyio):
each ModelInfer is parsed, and a response with the right output (``logits``, FP32,
``[n, 10]``, zeros) for an ``[n, 256]`` input is built and serialized (the output bytes
prebuilt per ``n``). The one change from ``purerpc.Server`` is that it binds 127.0.0.1
only. rsrv no longer serves on purerpc's transport, so this is a reference point, not
rsrv's ceiling.

``--transport rsrv``: the **rsrv-transport echo**, the ceiling of rsrv's own transport.
``rsrv.transport.GrpcServer`` (what ``rsrv serve`` listens with, default limits) with a
Method table whose ModelInfer handler returns one prebuilt serialized response (``logits``
FP32 ``[1, 10]``, zeros) without parsing the request: the transport's work and nothing
else. Answers only 1-row requests correctly.

Both implement ServerLive and ServerReady too, for the readiness probe. Prints
``READY PORT`` once listening; serves until killed.
"""

from __future__ import annotations

import argparse
from contextlib import AsyncExitStack

from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

SERVICE = "/inference.GRPCInferenceService/"
OUTPUT, CLASSES = "logits", 10


def response(n: int, body: bytes, model: str = "classifier", id: str = ""):
    """The ModelInferResponse of an ``[n, 256]`` request: ``logits`` FP32 ``[n, 10]``."""
    return pb.ModelInferResponse(
        model_name=model,
        model_version="1",
        id=id,
        outputs=[
            pb.ModelInferResponse.InferOutputTensor(
                name=OUTPUT, datatype="FP32", shape=[n, CLASSES]
            )
        ],
        raw_output_contents=[body],
    )


# -- stock purerpc --------------------------------------------------------------------------


async def serve_purerpc(port: int) -> None:
    import anyio
    import purerpc
    from purerpc.server import ConnectionHandler

    from rsrv.protocol.generated.inference.grpc_service_grpc import (
        GRPCInferenceServiceServicer,
    )

    class Echo(GRPCInferenceServiceServicer):
        def __init__(self):
            self._canned: dict[int, bytes] = {}

        async def ServerLive(self, message):  # for the bench's readiness probe
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, message):
            return pb.ServerReadyResponse(ready=True)

        async def ModelInfer(self, message):
            n = message.inputs[0].shape[0] if message.inputs and message.inputs[0].shape else 1
            body = self._canned.get(n)
            if body is None:
                body = self._canned[n] = bytes(4 * CLASSES * n)
            return response(n, body, message.model_name, message.id)

    class LoopbackServer(purerpc.Server):
        async def serve_async(self, *, task_status=anyio.TASK_STATUS_IGNORED):
            # purerpc.Server.serve_async, except for the bind address (it binds every
            # interface)
            async with AsyncExitStack() as stack:
                listener = await anyio.create_tcp_listener(
                    local_host="127.0.0.1", local_port=self.port
                )
                self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
                services = {
                    name: await stack.enter_async_context(service)
                    for name, service in self.services.items()
                }
                task_status.started(self.port)
                await listener.serve(ConnectionHandler(services, self))

    server = LoopbackServer(port)
    server.add_service(Echo().service)
    async with anyio.create_task_group() as tg:
        bound = await tg.start(server.serve_async)
        print(f"READY {bound}", flush=True)


# -- rsrv's transport -----------------------------------------------------------------------


async def serve_rsrv(port: int) -> None:
    import trio

    from rsrv.transport import GrpcServer, Method

    def canned(message) -> Method:
        """A unary method that ignores its request and answers ``message``'s bytes."""
        answer = message.SerializeToString()

        async def handler(request, call):
            return answer

        name = type(message).__name__.removesuffix("Response")
        return Method(SERVICE + name, handler, decode=_same, encode=_same)

    methods = [
        canned(response(1, bytes(4 * CLASSES))),  # ModelInfer
        canned(pb.ServerLiveResponse(live=True)),
        canned(pb.ServerReadyResponse(ready=True)),
    ]
    server = GrpcServer(methods, "127.0.0.1", port)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(server.serve)
        print(f"READY {bound}", flush=True)


def _same(payload):
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=["purerpc", "rsrv"], default="purerpc")
    parser.add_argument("port", type=int, nargs="?", default=0)
    args = parser.parse_args()
    if args.transport == "rsrv":
        import trio

        trio.run(serve_rsrv, args.port)
    else:
        import anyio

        anyio.run(serve_purerpc, args.port, backend="trio")


if __name__ == "__main__":
    main()
