"""The KServe V2 REST endpoints other than ``/infer``: JSON in, the gRPC handler of the
same RPC (``InferenceService``), JSON out.

Each endpoint builds the request message its RPC takes and calls that RPC's handler, so
every check and message is the gRPC one; only the JSON shapes are the REST protocol's
(Triton's, where KServe leaves them open: specs/http.md §2). :data:`ROUTES` maps paths
to handlers and to their protocol group (for restricted protocols).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from rsrv.errors import InvalidArgument, RsrvError
from rsrv.protocol._infer_flow import off_loop
from rsrv.protocol._inference import InferenceService
from rsrv.protocol._rest_codec import JSON_PARSE_BYTE_SECONDS, json_error_text
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

__all__ = ["ROUTES", "Call", "Reply", "json_reply", "message_dict", "route"]

_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


#: A request body: bytes, or a read-only view of the bytes of one received in pieces.
Body = bytes | memoryview


@dataclass(slots=True)
class Call:
    """One REST request, its body read (and inflated) whole."""

    method: str
    path: str
    params: dict[str, str]
    headers: Mapping[str, str]
    body: Body = b""


@dataclass(slots=True)
class Reply:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def json_reply(value: Any, status: int = 200) -> Reply:
    return Reply(status, msgspec.json.encode(value))


def message_dict(message) -> dict:
    """A protobuf message as Triton's JSON: field names as in the proto, every field
    (defaults included), 64-bit integers as numbers (protobuf's JSON form has strings)."""
    out = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _numbers(message, out)
    return out


def _numbers(message, out: dict) -> None:
    for fd in message.DESCRIPTOR.fields:
        if fd.name not in out:
            continue
        value = getattr(message, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            inner = fd.message_type.fields_by_name["value"]
            if inner.message_type is not None:
                for key, sub in value.items():
                    _numbers(sub, out[fd.name][str(key)])
            elif inner.type in _INT64:
                out[fd.name] = {k: int(v) for k, v in out[fd.name].items()}
        elif fd.message_type is not None:
            if fd.is_repeated:
                for sub, sub_out in zip(value, out[fd.name], strict=True):
                    _numbers(sub, sub_out)
            else:
                _numbers(value, out[fd.name])
        elif fd.type in _INT64:
            if fd.is_repeated:
                out[fd.name] = [int(v) for v in out[fd.name]]
            else:
                out[fd.name] = int(out[fd.name])


async def _json_body(call: Call, what: str) -> dict:
    """The body as a JSON object ({} when empty), parsed in a worker thread when large;
    InvalidArgument otherwise."""
    if not call.body:
        return {}
    try:
        seconds = len(call.body) * JSON_PARSE_BYTE_SECONDS
        value = await off_loop(seconds, msgspec.json.decode, call.body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        if not bytes(call.body).strip():  # (only here: it copies the body)
            return {}
        # (a string not UTF-8; JSON nested past the decoder's depth)
        raise InvalidArgument(
            f"cannot parse the {what} request body as JSON: {json_error_text(e)}"
        ) from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"the {what} request body must be a JSON object")
    return value


def _load_request(model: str, params: dict) -> pb.RepositoryModelLoadRequest:
    """RepositoryModelLoad of ``model`` with the REST load's ``parameters`` (a ``file:``
    one's base64 decoded)."""
    request = pb.RepositoryModelLoadRequest(model_name=model)
    for key, value in params.items():
        slot = request.parameters[key]
        if key.startswith("file:") and isinstance(value, str):
            try:
                slot.bytes_param = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidArgument(
                    f"load parameter '{key}' must be base64 (the file's contents)"
                ) from None
        elif isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            slot.int64_param = value
        elif isinstance(value, str):
            slot.string_param = value
        else:
            raise InvalidArgument(
                f"load parameter '{key}' must be a string, an integer or a boolean"
            )
    return request


def _typed(value: Any, kind: type, key: str, what: str):
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgument(
            f"'{key}' of the {what} request must be a JSON {kind.__name__}, got {value!r}"
        )
    return value


class RestRoutes:
    """The handlers; each takes a :class:`Call` and returns a :class:`Reply`."""

    def __init__(self, service: InferenceService):
        self.grpc = service
        self.backend = service.backend

    # -- health and metadata --------------------------------------------------------------

    async def live(self, call: Call) -> Reply:
        return json_reply({"live": True})

    async def ready(self, call: Call) -> Reply:
        ready = self.backend.ready and not self.backend.admission.closed  # (draining)
        return json_reply({"ready": ready}, 200 if ready else 400)

    async def server_metadata(self, call: Call) -> Reply:
        got = await self.grpc.ServerMetadata(pb.ServerMetadataRequest(), None)
        extensions = [*got.extensions, "binary_tensor_data"]
        return json_reply({"name": got.name, "version": got.version, "extensions": extensions})

    async def model_ready(self, call: Call) -> Reply:
        request = pb.ModelReadyRequest(name=call.params["m"], version=call.params.get("v", ""))
        ready = (await self.grpc.ModelReady(request, None)).ready
        return json_reply({"name": request.name, "ready": ready}, 200 if ready else 400)

    async def model_metadata(self, call: Call) -> Reply:
        request = pb.ModelMetadataRequest(name=call.params["m"], version=call.params.get("v", ""))
        return json_reply(message_dict(await self.grpc.ModelMetadata(request, None)))

    async def model_config(self, call: Call) -> Reply:
        request = pb.ModelConfigRequest(name=call.params["m"], version=call.params.get("v", ""))
        return json_reply(message_dict((await self.grpc.ModelConfig(request, None)).config))

    async def stats(self, call: Call) -> Reply:
        request = pb.ModelStatisticsRequest(
            name=call.params.get("m", ""), version=call.params.get("v", "")
        )
        return json_reply(message_dict(await self.grpc.ModelStatistics(request, None)))

    # -- repository -----------------------------------------------------------------------

    async def index(self, call: Call) -> Reply:
        ready = _typed((await _json_body(call, "index")).get("ready"), bool, "ready", "index")
        response = await self.grpc.RepositoryIndex(
            pb.RepositoryIndexRequest(ready=bool(ready)), None
        )
        return json_reply([message_dict(m) for m in response.models])

    async def load(self, call: Call) -> Reply:
        """``{"parameters": {"config": "<json>", "file:<path>": "<base64>", ...}}``."""
        body = await _json_body(call, "load")
        params = _typed(body.get("parameters"), dict, "parameters", "load")
        seconds = len(call.body) * JSON_PARSE_BYTE_SECONDS  # (base64: as long as the body)
        request = await off_loop(seconds, _load_request, call.params["m"], params or {})
        await self.grpc.RepositoryModelLoad(request, None)
        return Reply(200)

    async def unload(self, call: Call) -> Reply:
        await _json_body(call, "unload")  # well formed; its parameters (unload_dependents) ignored
        request = pb.RepositoryModelUnloadRequest(model_name=call.params["m"])
        await self.grpc.RepositoryModelUnload(request, None)
        return Reply(200)

    # -- shared memory ------------------------------------------------------------------

    async def shm_status(self, call: Call) -> Reply:
        request = pb.SystemSharedMemoryStatusRequest(name=call.params.get("r", ""))
        response = await self.grpc.SystemSharedMemoryStatus(request, None)
        return json_reply([message_dict(r) for r in response.regions.values()])

    async def shm_register(self, call: Call) -> Reply:
        body = await _json_body(call, "register")
        what = "register"
        key = _typed(body.get("key"), str, "key", what)
        byte_size = _typed(body.get("byte_size"), int, "byte_size", what)
        offset = body.get("offset")
        offset = 0 if offset is None else _typed(offset, int, "offset", what)
        if key is None or byte_size is None:
            raise InvalidArgument("a register request needs 'key' and 'byte_size'")
        if byte_size < 0 or offset < 0 or byte_size >= 2**64 or offset >= 2**64:
            raise InvalidArgument(
                f"invalid shared memory window: offset {offset}, byte_size {byte_size}"
            )
        request = pb.SystemSharedMemoryRegisterRequest(
            name=call.params["r"], key=key, offset=offset, byte_size=byte_size
        )
        await self.grpc.SystemSharedMemoryRegister(request, None)
        return Reply(200)

    async def shm_unregister(self, call: Call) -> Reply:
        request = pb.SystemSharedMemoryUnregisterRequest(name=call.params.get("r", ""))
        await self.grpc.SystemSharedMemoryUnregister(request, None)
        return Reply(200)

    async def cuda_status(self, call: Call) -> Reply:
        request = pb.CudaSharedMemoryStatusRequest(name=call.params.get("r", ""))
        response = await self.grpc.CudaSharedMemoryStatus(request, None)
        return json_reply([message_dict(r) for r in response.regions.values()])

    async def cuda_register(self, call: Call) -> Reply:
        await self.grpc.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(), None)
        return Reply(200)  # not reached: refused

    async def cuda_unregister(self, call: Call) -> Reply:
        return Reply(200)

    # -- trace and log settings ---------------------------------------------------------

    async def trace(self, call: Call) -> Reply:
        """GET: the settings; POST ``{key: value | [values] | null}`` (null: default)."""
        request = pb.TraceSettingRequest(model_name=call.params.get("m", ""))
        if call.method == "POST":
            for key, value in (await _json_body(call, "trace setting")).items():
                values = [] if value is None else value if isinstance(value, list) else [value]
                request.settings[key].value.extend(str(v) for v in values)
        response = await self.grpc.TraceSetting(request, None)
        return json_reply(
            {
                key: list(setting.value) if key == "trace_level" else ",".join(setting.value)
                for key, setting in response.settings.items()
            }
        )

    async def logging(self, call: Call) -> Reply:
        """GET: the settings; POST ``{key: value}`` (booleans, an integer level, strings)."""
        if call.method == "POST":
            request = pb.LogSettingsRequest()
            for key, value in (await _json_body(call, "log settings")).items():
                slot = request.settings[key]
                if isinstance(value, bool):
                    slot.bool_param = value
                elif isinstance(value, int) and 0 <= value < 2**32:
                    slot.uint32_param = value
                elif isinstance(value, str):
                    slot.string_param = value
                else:
                    raise InvalidArgument(
                        f"log setting {key!r}: expected a boolean, an integer >= 0 or a string"
                    )
            await self.grpc.LogSettings(request, None)
        return json_reply(dict(self.backend.log_settings.values))


def _add(table, pattern: str, group: str, **methods: str) -> None:
    table.append((tuple(pattern.strip("/").split("/")), group, methods))


#: (path pattern, protocol group, {HTTP method: handler}); ``{m}`` a model name, ``{v}``
#: a version, ``{r}`` a shared-memory region. Literal patterns come first.
ROUTES: list[tuple[tuple[str, ...], str, dict[str, str]]] = []
_add(ROUTES, "v2", "metadata", GET="server_metadata")
_add(ROUTES, "v2/health/live", "health", GET="live")
_add(ROUTES, "v2/health/ready", "health", GET="ready")
_add(ROUTES, "v2/models/stats", "statistics", GET="stats")
for _prefix in ("v2/models/{m}", "v2/models/{m}/versions/{v}"):
    _add(ROUTES, _prefix, "metadata", GET="model_metadata")
    _add(ROUTES, _prefix + "/ready", "health", GET="model_ready")
    _add(ROUTES, _prefix + "/config", "model-config", GET="model_config")
    _add(ROUTES, _prefix + "/stats", "statistics", GET="stats")
    _add(ROUTES, _prefix + "/infer", "inference", POST="infer")
_add(ROUTES, "v2/repository/index", "model-repository", POST="index", GET="index")
_add(ROUTES, "v2/repository/models/{m}/load", "model-repository", POST="load")
_add(ROUTES, "v2/repository/models/{m}/unload", "model-repository", POST="unload")
for _kind, _prefix in (("shm", "systemsharedmemory"), ("cuda", "cudasharedmemory")):
    _add(ROUTES, f"v2/{_prefix}/status", "shared-memory", GET=f"{_kind}_status")
    _add(ROUTES, f"v2/{_prefix}/region/{{r}}/status", "shared-memory", GET=f"{_kind}_status")
    _add(ROUTES, f"v2/{_prefix}/region/{{r}}/register", "shared-memory", POST=f"{_kind}_register")
    _add(ROUTES, f"v2/{_prefix}/unregister", "shared-memory", POST=f"{_kind}_unregister")
    _add(
        ROUTES, f"v2/{_prefix}/region/{{r}}/unregister", "shared-memory", POST=f"{_kind}_unregister"
    )
_add(ROUTES, "v2/trace/setting", "trace", GET="trace", POST="trace")
_add(ROUTES, "v2/models/{m}/trace/setting", "trace", GET="trace", POST="trace")
_add(ROUTES, "v2/logging", "logging", GET="logging", POST="logging")


class NoRoute(RsrvError):
    """No endpoint at the path (404), or not with that method (405, ``allowed``)."""

    code = "UNIMPLEMENTED"

    def __init__(self, message: str, status: int, allowed: tuple[str, ...] = ()):
        super().__init__(message)
        self.http_status = status
        self.allowed = allowed


def route(method: str, path: str) -> tuple[str, str, dict[str, str]]:
    """(handler name, protocol group, path parameters) of a request; NoRoute if none."""
    parts = path.strip("/").split("/") if path.strip("/") else []
    for pattern, group, methods in ROUTES:
        if len(pattern) != len(parts):
            continue
        params: dict[str, str] = {}
        for want, got in zip(pattern, parts, strict=True):
            if want == "{v}" and not got:  # (not the default: Triton's route needs digits)
                break
            if want[0] == "{":
                params[want[1:-1]] = got
            elif want != got:
                break
        else:
            handler = methods.get(method)
            if handler is None and method == "HEAD":  # (GET's answer, without its body)
                handler = methods.get("GET")
            if handler is None:
                allowed = tuple(methods) + (("HEAD",) if "GET" in methods else ())
                raise NoRoute(
                    f"method {method} is not allowed on {path} (allowed: {', '.join(allowed)})",
                    405,
                    allowed,
                )
            return handler, group, params
    raise NoRoute(f"no KServe V2 endpoint at {path} (specs/http.md lists them)", 404)
