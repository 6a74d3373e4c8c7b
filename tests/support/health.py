"""grpcio's own health client (``grpcio-health-checking``) against a real server: what
Kubernetes' gRPC probes and ``grpc_health_probe`` send, so the tests see what they see.

:func:`check` is one ``Check`` (its status name, or the gRPC status code name when the
call fails); :class:`Watch` holds one ``Watch`` stream open in a thread and records every
status it receives, in order.
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support.waiting import wait_until

__all__ = ["Watch", "check", "status_name"]


def status_name(response: health_pb2.HealthCheckResponse) -> str:
    """``"SERVING"``, ``"NOT_SERVING"``, ``"SERVICE_UNKNOWN"`` or ``"UNKNOWN"``."""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def check(address: str, service: str = "", timeout: float = 5.0, **kwargs) -> str:
    """One Check of ``service`` at ``address`` (host:port) on a fresh channel, as a probe
    makes it: the status name when it answers, else the failed call's code name
    (``"NOT_FOUND"``, ``"UNAVAILABLE"``, ...). ``kwargs``: e.g. ``metadata=``."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, **kwargs
            )
        except grpc.RpcError as e:
            return e.code().name
        return status_name(response)


class Watch:
    """A Watch of ``service`` at ``address``, read in a background thread.

    ``statuses``: every status received, in order; ``ended``: the stream's end, as the
    gRPC code name (``"UNAVAILABLE"`` when the server went away, ``"CANCELLED"`` after
    :meth:`close`), None while it is open, and ``ended_message`` its details. Use it as
    a context manager.
    """

    def __init__(self, address: str, service: str = ""):
        self.statuses: list[str] = []
        self.ended: str | None = None
        self.ended_message = ""
        self._channel = grpc.insecure_channel(address)
        stub = health_pb2_grpc.HealthStub(self._channel)
        self._call = stub.Watch(health_pb2.HealthCheckRequest(service=service))
        self._thread = threading.Thread(target=self._read, name="health-watch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.statuses.append(status_name(response))
            self.ended = "OK"
        except grpc.RpcError as e:
            self.ended_message = e.details()
            self.ended = e.code().name

    def wait_for(self, status: str, timeout: float = 20.0) -> None:
        """Until the latest status received is ``status``."""
        wait_until(
            lambda: self.statuses and self.statuses[-1] == status,
            timeout,
            f"Watch to report {status} (so far {self.statuses}, ended {self.ended})",
            interval=0.02,
        )

    def wait_ended(self, timeout: float = 20.0) -> str:
        wait_until(lambda: self.ended is not None, timeout, "the Watch stream to end")
        return self.ended

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(10)
        self._channel.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
