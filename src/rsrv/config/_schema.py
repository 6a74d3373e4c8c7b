"""The node file's schema, and the resolved per-worker configuration.

Every class here is a frozen ``msgspec.Struct`` that rejects unknown
fields, so a typo in a node file is an error rather than a silently
ignored key. Ranges are ``msgspec.Meta`` constraints, so they are enforced
on decode *and* appear in :func:`node_json_schema`.

Two layers:

* :class:`NodeConfig` is the node file as written: values are kept as
  given (relative paths stay relative, ``~`` stays unexpanded, derived
  ports stay ``None``).
* :class:`WorkerConfig` is what one worker process runs with, produced by
  :func:`rsrv.config.resolve_worker`: flat, merged, absolute, no
  ``None`` left where a concrete value can be derived.
"""

from __future__ import annotations

import functools
import operator
import types
import typing
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from rsrv.versions import VersionPolicy


def _doc(text: str) -> Meta:
    return Meta(description=text)


Port = Annotated[int, Meta(ge=1, le=65535)]
#: A host name or address: not empty, no white space.
HOST_PATTERN = r"^\S+$"
Host = Annotated[str, Meta(min_length=1, pattern=HOST_PATTERN)]
#: A path: not empty (an empty one would silently mean the working directory).
PathText = Annotated[str, Meta(min_length=1)]
#: A device in a ``gpus`` list, as text: an ordinal (``3``, ``cuda:3``) or a UUID.
DEVICE_ORDINAL, DEVICE_UUID = r"(?:cuda:)?(\d+)", r"(?:GPU|MIG)-[0-9A-Za-z/.-]+"
# (the JSON Schema says what the loader checks, which names the item at fault itself)
_Device = (
    Annotated[int, Meta(extra_json_schema={"minimum": 0})]
    | Annotated[
        str,
        Meta(extra_json_schema={"pattern": rf"^\s*(?:{DEVICE_ORDINAL}|{DEVICE_UUID})\s*$"}),
    ]
)

#: Fair-share weights a model may have. Bounded so that a model's virtual time stays
#: finite and comparable: a weight of inf would starve every other model, and a
#: subnormal one would push the virtual clock to inf, breaking fair sharing for good.
MIN_WEIGHT = 1e-3
MAX_WEIGHT = 1e3
Backend = Literal["cpu", "cuda"]
Residency = Literal["unpinned", "system", "device"]
WeightStaging = Literal["auto", "pageable", "pinned"]
Discipline = Literal["fair", "fifo", "edf"]
ControlMode = Literal["dynamic", "static", "explicit"]
LogLevel = Literal["debug", "info", "warning", "error"]
#: Triton's protocol groups of RPCs, and ``control`` for rsrv's control service.
Protocol = Literal[
    "health",
    "metadata",
    "inference",
    "model-config",
    "model-repository",
    "statistics",
    "shared-memory",
    "trace",
    "logging",
    "control",
    "gateway-control",
]
LogFormat = Literal["text", "json"]


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Common options: immutable, keyword-only, unknown keys rejected."""


# --- sections of the `global` block (each may be overridden per worker) ---


class RuntimeConfig(_Strict):
    """How the worker drives its accelerator."""

    backend: Annotated[Backend, _doc("PJRT backend the worker compiles and runs on.")] = "cpu"
    mem_fraction: Annotated[
        float, Meta(gt=0, le=1), _doc("Fraction of device memory the runtime may use.")
    ] = 0.9
    preallocate: Annotated[
        bool, _doc("Reserve the memory fraction at startup instead of growing on demand.")
    ] = True
    allow_cpu_fallback: Annotated[
        bool, _doc("Fall back to the CPU backend when the requested backend is unavailable.")
    ] = False
    weight_cache_fraction: Annotated[
        float,
        Meta(ge=0, le=1),
        _doc(
            "Share of the device allocator's limit for evictable weights; 0 disables "
            "the on-demand weight cache (every model stays resident)."
        ),
    ] = 1.0
    weight_cache_wiggle_fraction: Annotated[
        float,
        Meta(ge=0, lt=1),
        _doc(
            "Share of the device allocator's limit kept free of weights (with the largest "
            "measured scratch) for activations."
        ),
    ] = 0.1
    weight_cache_bytes: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _doc("Explicit weight cache budget in bytes; overrides weight_cache_fraction."),
    ] = None
    weight_staging: Annotated[
        WeightStaging,
        _doc(
            "Where system-floor weights are staged in host memory: pinned (page-locked "
            "pinned_host memory; every device load is a copy into device memory), "
            "pageable (an aligned host buffer; the CPU device adopts it without a copy), "
            "or auto: pageable on the cpu backend, pinned on an accelerator."
        ),
    ] = "auto"
    inline_execution_seconds: Annotated[
        float,
        Meta(ge=0, le=0.01),
        _doc(
            "An execution measured shorter than this runs on the event loop's thread "
            "(saving two thread hand-offs); longer ones run in the device thread; 0: "
            "always the device thread."
        ),
    ] = 0.0005


class ModelSchedConfig(_Strict):
    """Scheduling policy for one model, keyed by model name."""

    weight: Annotated[
        float,
        Meta(ge=MIN_WEIGHT, le=MAX_WEIGHT),
        _doc("Fair-share weight (0.001 to 1000); a model gets service in proportion."),
    ] = 1.0
    residency: Annotated[
        Residency | None,
        _doc("Where the weights live between requests; null lets the scheduler decide."),
    ] = None
    max_batch_size: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc("Cap on requests merged into one execution; null uses the bundle's limit."),
    ] = None
    latency_budget_seconds: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        _doc("Target latency per request, the deadline under edf; null means none."),
    ] = None
    max_queue_delay_seconds: Annotated[
        Annotated[float, Meta(ge=0, le=1)] | None,
        _doc(
            "Longest a batch smaller than the largest one it can run waits for more "
            "requests (Triton's max_queue_delay_microseconds); null: the scheduler's."
        ),
    ] = None
    version_policy: Annotated[
        VersionPolicy | None,
        _doc(
            "Versions served: {latest: N}, {all: true} or {specific: [...]}; null: the "
            "policy of the newest version's manifest, else {latest: 1}."
        ),
    ] = None
    allow_file_overrides: Annotated[
        bool,
        _doc(
            "Let RepositoryModelLoad write its file: parameters into this model's "
            "directory in the repository (explicit mode); off: they are refused."
        ),
    ] = False


class SchedulerConfig(_Strict):
    """How requests from many models share one accelerator."""

    discipline: Annotated[Discipline, _doc("Queueing discipline across models.")] = "fair"
    ema_halflife_seconds: Annotated[
        float, Meta(gt=0), _doc("Half-life of the per-model usage average used by `fair`.")
    ] = 30.0
    cost_ema_alpha: Annotated[
        float, Meta(gt=0, le=1), _doc("Smoothing factor of the per-model execution cost estimate.")
    ] = 0.2
    max_queue_depth: Annotated[
        int, Meta(gt=0), _doc("Requests queued per model before new ones are rejected.")
    ] = 1024
    dispatch_timeout_seconds: Annotated[
        float, Meta(gt=0), _doc("Longest a request may wait in the queue before it fails.")
    ] = 30.0
    max_queue_delay_seconds: Annotated[
        float,
        Meta(ge=0, le=1),
        _doc(
            "Default max_queue_delay_seconds of every model: how long a batch smaller than "
            "the largest one it can run waits for more requests; 0: dispatch at once."
        ),
    ] = 0.0
    compaction_interval: Annotated[
        int,
        Meta(ge=0),
        _doc(
            "Compact weight memory (free every evictable model at once) after every N "
            "weight loads; 0: only on request (CompactMemory)."
        ),
    ] = 0
    meta_concurrency: Annotated[
        int,
        Meta(ge=1),
        _doc(
            "Meta-model requests the worker runs at once (more wait, bounded by their deadlines)."
        ),
    ] = 4
    models: Annotated[
        dict[str, ModelSchedConfig], _doc("Per-model policy, keyed by model name.")
    ] = {}


class RestrictedConfig(_Strict):
    """Protocols that need a header (an item of `endpoints.restricted`)."""

    protocols: Annotated[
        list[Protocol],
        Meta(min_length=1),
        _doc("Protocol groups whose RPCs need the header (Triton's names, and `control`)."),
    ]
    header: Annotated[
        str,
        Meta(min_length=1, pattern=r"^[0-9a-z_.-]+$"),
        _doc("Header (gRPC metadata key, lower case) that must carry the value."),
    ]
    value: Annotated[str | None, _doc("The value, written in the file.")] = None
    value_env: Annotated[str | None, _doc("Name of an environment variable holding the value.")] = (
        None
    )
    value_file: Annotated[
        str | None,
        _doc("File holding the value (trailing newline removed); relative to the node file."),
    ] = None


class EndpointsConfig(_Strict):
    """Where and how the worker listens."""

    host: Annotated[Host, _doc("Address the gRPC, REST and admin HTTP servers bind.")] = "127.0.0.1"
    port: Annotated[Port | None, _doc("gRPC port; null means base_port + worker index.")] = None
    metrics_port: Annotated[
        Port | None,
        _doc(
            "Admin HTTP (metrics, health) port; null means metrics_base_port + worker index "
            "when metrics_base_port is set, else no admin HTTP server."
        ),
    ] = None
    http_port: Annotated[
        Port | None,
        _doc(
            "KServe V2 REST (HTTP/JSON) port, Triton's is 8000; null means http_base_port + "
            "worker index when http_base_port is set, else no REST endpoint."
        ),
    ] = None
    max_concurrent_requests: Annotated[
        int,
        Meta(ge=0),
        _doc("In-flight requests per worker (gRPC and REST together); 0 means uncapped."),
    ] = 64
    max_message_bytes: Annotated[
        int,
        Meta(ge=1 << 20, le=(1 << 31) - 1),
        _doc("Largest gRPC message accepted or sent, in bytes."),
    ] = 1 << 28
    system_shared_memory: Annotated[
        bool, _doc("Accept system shared memory regions for tensor transfer.")
    ] = True
    shutdown_grace_seconds: Annotated[
        float, Meta(ge=0), _doc("How long in-flight requests may finish after a stop signal.")
    ] = 30.0
    max_connections: Annotated[
        int,
        Meta(ge=1),
        _doc(
            "Open client connections per port (gRPC, REST); one more closes the one"
            " waiting longest on its client."
        ),
    ] = 1000
    max_streams_per_connection: Annotated[
        int, Meta(ge=1), _doc("Calls open at once on one connection (HTTP/2 setting).")
    ] = 128
    max_requests_per_stream: Annotated[
        int,
        Meta(ge=1),
        _doc("Requests of one ModelStreamInfer stream in flight at once; more wait."),
    ] = 16
    receive_timeout_seconds: Annotated[
        float,
        Meta(gt=0),
        _doc("A request message must arrive whole within this of its first byte."),
    ] = 60.0
    idle_connection_seconds: Annotated[
        float,
        Meta(ge=0),
        _doc("A connection with no call open this long is closed (GOAWAY); 0: never."),
    ] = 600.0
    max_shm_regions: Annotated[
        int, Meta(ge=0), _doc("System shared memory regions registered at once.")
    ] = 256
    tls_cert_file: Annotated[
        str | None, _doc("PEM certificate chain: serve gRPC over TLS (with tls_key_file).")
    ] = None
    tls_key_file: Annotated[str | None, _doc("PEM private key of tls_cert_file.")] = None
    tls_client_ca_file: Annotated[
        str | None,
        _doc("PEM CA bundle: clients must present a certificate it signed (mutual TLS)."),
    ] = None
    restricted: Annotated[
        list[RestrictedConfig],
        _doc("Protocols that need a header; unlisted protocols stay open."),
    ] = []

    def tls_files(self) -> dict[str, str | None]:
        """The TLS settings, by their names in the node file."""
        keys = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
        return {f"endpoints.{key}": getattr(self, key) for key in keys}


class LoggingConfig(_Strict):
    """What the worker logs, and how."""

    level: Annotated[LogLevel, _doc("Least severe level that is logged.")] = "info"
    format: Annotated[LogFormat, _doc("`text` for people, `json` for one object per line.")] = (
        "text"
    )


class GlobalConfig(_Strict):
    """Settings shared by every worker on the node (the `global` key)."""

    cache_dir: Annotated[
        PathText, _doc("Compilation cache directory; `~` expanded, relative to the node file.")
    ] = "~/.cache/rsrv"
    cache_max_bytes: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc(
            "Most bytes of compiled executables kept in `cache_dir`; the least recently "
            "used go first. Null: no limit."
        ),
    ] = None
    model_control_mode: Annotated[
        ControlMode,
        _doc(
            "dynamic: follow the repository; static: load once at startup; "
            "explicit: load only on request."
        ),
    ] = "dynamic"
    model_poll_seconds: Annotated[
        float, Meta(gt=0), _doc("Repository poll interval in dynamic mode.")
    ] = 15.0
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    endpoints: EndpointsConfig = msgspec.field(default_factory=EndpointsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)


# --- per-worker overrides: the same sections, every field optional ---


def _substitute(tp: Any, table: dict[type, type]) -> Any:
    """`tp` with every struct type in `table` replaced by its partial twin."""
    if isinstance(tp, type) and tp in table:
        return table[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return Annotated[(_substitute(args[0], table), *tp.__metadata__)]
    if origin in (dict, list):
        return origin[tuple(_substitute(a, table) for a in args)]
    if args and origin in (Union, types.UnionType):
        return functools.reduce(operator.or_, (_substitute(a, table) for a in args))
    return tp


def _partial(cls: type[msgspec.Struct], table: dict[type, type]) -> type[msgspec.Struct]:
    # Generated rather than written out so that an override block can never
    # drift from the section it overrides. UNSET fields are dropped by
    # msgspec.to_builtins, which leaves exactly the keys the file gave.
    fields = [
        (f.name, _substitute(f.type, table) | msgspec.UnsetType, msgspec.UNSET)
        for f in msgspec.structs.fields(cls)
    ]
    name = cls.__name__.removesuffix("Config") + "Override"
    partial = msgspec.defstruct(
        name,
        fields,
        bases=(_Strict,),
        module=__name__,
        namespace={
            "__doc__": f"Any subset of {cls.__name__}, merged over `global` for one worker."
        },
    )
    table[cls] = partial
    return partial


_partials: dict[type, type] = {}
ModelSchedOverride = _partial(ModelSchedConfig, _partials)
RuntimeOverride = _partial(RuntimeConfig, _partials)
SchedulerOverride = _partial(SchedulerConfig, _partials)
EndpointsOverride = _partial(EndpointsConfig, _partials)
LoggingOverride = _partial(LoggingConfig, _partials)

#: Sections a worker may override, and so also those env variables may target.
SECTIONS: dict[str, type[msgspec.Struct]] = {
    "runtime": RuntimeConfig,
    "scheduler": SchedulerConfig,
    "endpoints": EndpointsConfig,
    "logging": LoggingConfig,
}


class SupervisorConfig(_Strict):
    """How `rsrv node` keeps its child processes running (specs/node.md)."""

    max_restarts: Annotated[
        int,
        Meta(ge=0),
        _doc(
            "Restarts of one child in a row (each after less than stable_seconds of "
            "uptime) before the node gives up and exits non-zero; 0: never restart."
        ),
    ] = 5
    backoff_seconds: Annotated[
        float, Meta(gt=0), _doc("Wait before the first restart; doubled for each next one.")
    ] = 1.0
    max_backoff_seconds: Annotated[float, Meta(gt=0), _doc("Longest wait between restarts.")] = 30.0
    stable_seconds: Annotated[
        float, Meta(gt=0), _doc("A child up this long has its restart count reset.")
    ] = 60.0
    kill_after_seconds: Annotated[
        float,
        Meta(ge=0),
        _doc(
            "After SIGTERM, how long beyond its own shutdown_grace_seconds a child may "
            "take before SIGKILL."
        ),
    ] = 5.0
    startup_timeout_seconds: Annotated[
        float,
        Meta(ge=0),
        _doc(
            "A worker not serving this long after it started is stopped (as on SIGTERM, "
            "then SIGKILL) and counts as a crash; 0: no limit (a large repository on a "
            "cold compile cache can take long). Not the gateway."
        ),
    ] = 0.0


class WorkerEntry(_Strict):
    """One worker process on the node (an item of `workers`)."""

    name: Annotated[str, Meta(min_length=1), _doc("Unique worker name.")]
    host: Annotated[Host | None, _doc("Shorthand for endpoints.host.")] = None
    port: Annotated[Port | None, _doc("Shorthand for endpoints.port.")] = None
    gpu: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _doc(
            "Index into the node's device list (gpus); null: the worker's own index. "
            "With gpus auto or a count it is the device ordinal."
        ),
    ] = None
    runtime: RuntimeOverride | None = None  # type: ignore[valid-type]
    scheduler: SchedulerOverride | None = None  # type: ignore[valid-type]
    endpoints: EndpointsOverride | None = None  # type: ignore[valid-type]
    logging: LoggingOverride | None = None  # type: ignore[valid-type]


class NodeGatewayConfig(_Strict):
    """The gateway `rsrv node` runs in front of two or more workers (specs/node.md)."""

    enabled: Annotated[
        bool,
        _doc(
            "Run a gateway in front of two or more workers; off where another gateway "
            "(e.g. a cluster's) fronts the workers."
        ),
    ] = True

    file: Annotated[
        str | None,
        _doc(
            "A gateway file for its other settings (scheduling, limits); its listen and "
            "endpoints are the node's. Relative to the node file."
        ),
    ] = None
    metrics_port: Annotated[
        Port | None, _doc("The gateway's admin HTTP port (/metrics); null: none.")
    ] = None


class NodeConfig(_Strict):
    """A node file: every worker process of one machine."""

    model_repo: Annotated[
        PathText, _doc("Model repository directory; relative to the node file.")
    ] = "bundles"
    port: Annotated[
        Port,
        _doc(
            "The node's public gRPC port: the gateway's when the node has two or more "
            "workers, the only worker's when it has one."
        ),
    ] = 8001
    metrics_port: Annotated[
        Port, _doc("The node's admin HTTP port under `rsrv node` (/healthz, /readyz, /metrics).")
    ] = 8002
    base_port: Annotated[
        Port | None,
        _doc(
            "gRPC port of worker 0; worker i gets base_port + i. Null: `port` for a "
            "one-worker node, `port` + 100 for a larger one."
        ),
    ] = None
    metrics_base_port: Annotated[
        Port | None, _doc("Admin HTTP port of worker 0; null disables derived admin ports.")
    ] = None
    http_base_port: Annotated[
        Port | None,
        _doc(
            "KServe V2 REST port of worker 0; worker i gets http_base_port + i. Null "
            "disables derived REST ports."
        ),
    ] = None
    gpus: Annotated[
        Literal["auto"] | Annotated[int, Meta(ge=0)] | list[_Device],
        _doc(
            "Devices the node uses (backend cuda): auto (detected: INFERENCE_SERVER_GPUS, "
            "CUDA_VISIBLE_DEVICES, nvidia-smi, /dev/nvidia*), a count (the first n of the "
            "supervisor's CUDA_VISIBLE_DEVICES, else ordinals 0..n-1), "
            'or a list of ordinals (`3`, `"cuda:3"`) or UUIDs (`"GPU-..."`); worker i '
            "gets the i-th unless its `gpu` says otherwise."
        ),
    ] = "auto"
    cpu_workers: Annotated[
        int,
        Meta(ge=1),
        _doc("Workers of a cpu node without a `workers` list (worker0, worker1, ...)."),
    ] = 1
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    gateway: NodeGatewayConfig = msgspec.field(default_factory=NodeGatewayConfig)
    global_: GlobalConfig = msgspec.field(default_factory=GlobalConfig, name="global")
    workers: Annotated[
        list[WorkerEntry],
        _doc(
            "Worker processes; empty: one per device (cuda), or cpu_workers (cpu), named "
            "worker0, worker1, ..."
        ),
    ] = []
    models: Annotated[
        dict[str, list[str]],
        _doc("Pin map: model name -> workers that keep its weights resident on the device."),
    ] = {}


class WorkerConfig(_Strict):
    """Everything one worker runs with, fully resolved.

    Guarantees: `model_repo` and `cache_dir` are absolute; `endpoints.port`
    is a concrete port; `endpoints.metrics_port` is a concrete port or
    ``None`` meaning "no admin HTTP server" (`endpoints.http_port` likewise for the
    REST endpoint); the pin map has been folded
    into `scheduler.models`; environment overrides have been applied and
    are listed, as ``NAME=value``, in `overrides`.
    """

    name: str
    index: int
    model_repo: str
    cache_dir: str
    cache_max_bytes: int | None
    model_control_mode: ControlMode
    model_poll_seconds: float
    runtime: RuntimeConfig
    scheduler: SchedulerConfig
    endpoints: EndpointsConfig
    logging: LoggingConfig
    gpu: str | None = None  # the device (ordinal or UUID, as CUDA_VISIBLE_DEVICES takes it)
    workers: int = 1  # workers in the node
    overrides: tuple[str, ...] = ()


def node_json_schema() -> dict[str, Any]:
    """JSON Schema of the node file, constraints and descriptions included."""
    return msgspec.json.schema(NodeConfig)
