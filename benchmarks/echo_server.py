"""The transport ceiling: a bare purerpc server answering ModelInfer with a canned response.

    python benchmarks/echo_server.py PORT

Implements only ``inference.GRPCInferenceService/ModelInfer`` (and ServerLive/Ready for
the readiness probe) with rsrv's generated code (`rsrv.protocol.generated.inference`) on
unmodified purerpc under trio, as rsrv does, but with no codec, scheduler or model: the
response carries the right output (``logits``, FP32, ``[n, 10]``, zeros) for an
``[n, 256]`` input, prebuilt per ``n``. The one change from ``purerpc.Server`` is that it
binds 127.0.0.1 only. Prints ``READY PORT`` once listening; serves until killed.
"""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack

import anyio
import purerpc
from purerpc.server import ConnectionHandler

from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.inference.grpc_service_grpc import GRPCInferenceServiceServicer

OUTPUT, CLASSES = "logits", 10


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
        return pb.ModelInferResponse(
            model_name=message.model_name,
            model_version="1",
            id=message.id,
            outputs=[
                pb.ModelInferResponse.InferOutputTensor(
                    name=OUTPUT, datatype="FP32", shape=[n, CLASSES]
                )
            ],
            raw_output_contents=[body],
        )


class LoopbackServer(purerpc.Server):
    async def serve_async(self, *, task_status=anyio.TASK_STATUS_IGNORED):
        # purerpc.Server.serve_async, except for the bind address (it binds every interface)
        async with AsyncExitStack() as stack:
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            services = {
                name: await stack.enter_async_context(service)
                for name, service in self.services.items()
            }
            task_status.started(self.port)
            await listener.serve(ConnectionHandler(services, self))


async def main(port: int) -> None:
    server = LoopbackServer(port)
    server.add_service(Echo().service)
    async with anyio.create_task_group() as tg:
        bound = await tg.start(server.serve_async)
        print(f"READY {bound}", flush=True)


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 0, backend="trio")
