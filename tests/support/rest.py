"""The KServe V2 REST endpoint of a running worker: a config serving it, tritonclient.http
clients, plain HTTP requests as curl would send them, and status assertions."""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype


def with_http(config, port: int = 0):
    """``config`` serving the REST endpoint on ``port`` too (0: a free one, chosen when
    it binds; the worker's ``http_port`` then says which)."""
    return msgspec.structs.replace(
        config, endpoints=msgspec.structs.replace(config.endpoints, http_port=port)
    )


def http_url(worker) -> str:
    """host:port of the worker's REST endpoint (what tritonclient.http takes)."""
    return f"127.0.0.1:{worker.http_port}"


def http_connect(worker, **kwargs) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(http_url(worker), **kwargs)


def http_input(
    name: str, array: np.ndarray, datatype: str | None = None, binary: bool = True
) -> httpclient.InferInput:
    tensor = httpclient.InferInput(
        name, list(array.shape), datatype or np_to_triton_dtype(array.dtype)
    )
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


@contextlib.contextmanager
def raises_http(status: int, *fragments: str) -> Iterator[pytest.ExceptionInfo]:
    """Expect a tritonclient.http InferenceServerException with HTTP status ``status``
    whose message contains every fragment."""
    with pytest.raises(InferenceServerException) as info:
        yield info
    assert info.value.status() == str(status), (info.value.status(), info.value.message())
    for fragment in fragments:
        assert fragment in info.value.message(), (fragment, info.value.message())


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)

    @property
    def error(self) -> str:
        return self.json()["error"]


def request(
    worker, method: str, path: str, body: bytes | dict | None = None, headers=None
) -> Answer:
    """One plain HTTP request (urllib, as curl sends it): a dict body goes as JSON."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    headers = dict(headers or {})
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(
        f"http://{http_url(worker)}{path}", data=body, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return Answer(response.status, _lower(response.headers), response.read())
    except urllib.error.HTTPError as e:
        return Answer(e.code, _lower(e.headers), e.read())


def _lower(headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def raw_exchange(worker, data: bytes, timeout: float = 30.0) -> bytes:
    """Send ``data`` as is on a new connection; everything the server sends until it
    closes the connection or goes quiet for a second."""
    with socket.create_connection(("127.0.0.1", worker.http_port), timeout=timeout) as sock:
        sock.sendall(data)
        sock.settimeout(1.0)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
    return received


def infer_body(inputs: list[dict], **fields) -> dict:
    return {"inputs": inputs, **fields}
