from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetSchedulingStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulingPolicy(_message.Message):
    __slots__ = ("rebalance_compute_seconds", "first_rebalance_compute_seconds", "hysteresis", "ema_halflife_compute_seconds", "default_replicas", "routing_policy", "routing_fill_mode", "routing_fill_factor", "compaction_mode", "compaction_interval", "forbid_memory_oversubscription", "work_basis", "generation", "routing_fill_hold_seconds")
    REBALANCE_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_REBALANCE_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HYSTERESIS_FIELD_NUMBER: _ClassVar[int]
    EMA_HALFLIFE_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FILL_MODE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FILL_FACTOR_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_MODE_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    FORBID_MEMORY_OVERSUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    WORK_BASIS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FILL_HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rebalance_compute_seconds: float
    first_rebalance_compute_seconds: float
    hysteresis: float
    ema_halflife_compute_seconds: float
    default_replicas: int
    routing_policy: str
    routing_fill_mode: str
    routing_fill_factor: float
    compaction_mode: str
    compaction_interval: int
    forbid_memory_oversubscription: bool
    work_basis: str
    generation: int
    routing_fill_hold_seconds: float
    def __init__(self, rebalance_compute_seconds: _Optional[float] = ..., first_rebalance_compute_seconds: _Optional[float] = ..., hysteresis: _Optional[float] = ..., ema_halflife_compute_seconds: _Optional[float] = ..., default_replicas: _Optional[int] = ..., routing_policy: _Optional[str] = ..., routing_fill_mode: _Optional[str] = ..., routing_fill_factor: _Optional[float] = ..., compaction_mode: _Optional[str] = ..., compaction_interval: _Optional[int] = ..., forbid_memory_oversubscription: _Optional[bool] = ..., work_basis: _Optional[str] = ..., generation: _Optional[int] = ..., routing_fill_hold_seconds: _Optional[float] = ...) -> None: ...

class RepackStatus(_message.Message):
    __slots__ = ("last_repack_unix_seconds", "last_repack_wall_seconds", "last_repack_compute_seconds", "last_trigger", "last_models_placed", "last_models_moved", "repack_count", "compute_accumulated_seconds", "threshold_seconds", "first_traffic_repack_done", "operator_repacks_requested", "operator_repacks_completed")
    LAST_REPACK_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_REPACK_WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_REPACK_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_TRIGGER_FIELD_NUMBER: _ClassVar[int]
    LAST_MODELS_PLACED_FIELD_NUMBER: _ClassVar[int]
    LAST_MODELS_MOVED_FIELD_NUMBER: _ClassVar[int]
    REPACK_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_ACCUMULATED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TRAFFIC_REPACK_DONE_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_REPACKS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_REPACKS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    last_repack_unix_seconds: float
    last_repack_wall_seconds: float
    last_repack_compute_seconds: float
    last_trigger: str
    last_models_placed: int
    last_models_moved: int
    repack_count: int
    compute_accumulated_seconds: float
    threshold_seconds: float
    first_traffic_repack_done: bool
    operator_repacks_requested: int
    operator_repacks_completed: int
    def __init__(self, last_repack_unix_seconds: _Optional[float] = ..., last_repack_wall_seconds: _Optional[float] = ..., last_repack_compute_seconds: _Optional[float] = ..., last_trigger: _Optional[str] = ..., last_models_placed: _Optional[int] = ..., last_models_moved: _Optional[int] = ..., repack_count: _Optional[int] = ..., compute_accumulated_seconds: _Optional[float] = ..., threshold_seconds: _Optional[float] = ..., first_traffic_repack_done: _Optional[bool] = ..., operator_repacks_requested: _Optional[int] = ..., operator_repacks_completed: _Optional[int] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("worker", "weight", "outstanding", "routed")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    worker: str
    weight: float
    outstanding: float
    routed: int
    def __init__(self, worker: _Optional[str] = ..., weight: _Optional[float] = ..., outstanding: _Optional[float] = ..., routed: _Optional[int] = ...) -> None: ...

class ModelSchedulingStatus(_message.Message):
    __slots__ = ("name", "configured_replicas", "effective_replicas", "replicas", "utilization", "arrival_rate", "cost_seconds", "max_batch", "fill_mode", "fill_quantum", "weight_bytes", "placed", "drifted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_FIELD_NUMBER: _ClassVar[int]
    COST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    FILL_MODE_FIELD_NUMBER: _ClassVar[int]
    FILL_QUANTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    DRIFTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    configured_replicas: int
    effective_replicas: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    utilization: float
    arrival_rate: float
    cost_seconds: float
    max_batch: int
    fill_mode: str
    fill_quantum: int
    weight_bytes: int
    placed: bool
    drifted: bool
    def __init__(self, name: _Optional[str] = ..., configured_replicas: _Optional[int] = ..., effective_replicas: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., utilization: _Optional[float] = ..., arrival_rate: _Optional[float] = ..., cost_seconds: _Optional[float] = ..., max_batch: _Optional[int] = ..., fill_mode: _Optional[str] = ..., fill_quantum: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., placed: _Optional[bool] = ..., drifted: _Optional[bool] = ...) -> None: ...

class WorkerSchedulingStatus(_message.Message):
    __slots__ = ("worker", "ready", "models_placed", "inflight_load", "assigned_weight_bytes", "weight_budget_bytes", "oversubscribed")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MODELS_PLACED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_LOAD_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVERSUBSCRIBED_FIELD_NUMBER: _ClassVar[int]
    worker: str
    ready: bool
    models_placed: int
    inflight_load: float
    assigned_weight_bytes: int
    weight_budget_bytes: int
    oversubscribed: bool
    def __init__(self, worker: _Optional[str] = ..., ready: _Optional[bool] = ..., models_placed: _Optional[int] = ..., inflight_load: _Optional[float] = ..., assigned_weight_bytes: _Optional[int] = ..., weight_budget_bytes: _Optional[int] = ..., oversubscribed: _Optional[bool] = ...) -> None: ...

class SchedulingStatus(_message.Message):
    __slots__ = ("mode", "policy", "repack", "models", "workers", "warnings")
    MODE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REPACK_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    policy: SchedulingPolicy
    repack: RepackStatus
    models: _containers.RepeatedCompositeFieldContainer[ModelSchedulingStatus]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSchedulingStatus]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, mode: _Optional[str] = ..., policy: _Optional[_Union[SchedulingPolicy, _Mapping]] = ..., repack: _Optional[_Union[RepackStatus, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ModelSchedulingStatus, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerSchedulingStatus, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class SetSchedulingPolicyRequest(_message.Message):
    __slots__ = ("update_mask", "policy")
    UPDATE_MASK_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    update_mask: _containers.RepeatedScalarFieldContainer[str]
    policy: SchedulingPolicy
    def __init__(self, update_mask: _Optional[_Iterable[str]] = ..., policy: _Optional[_Union[SchedulingPolicy, _Mapping]] = ...) -> None: ...

class SetSchedulingPolicyResponse(_message.Message):
    __slots__ = ("applied", "warnings")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    applied: SchedulingPolicy
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, applied: _Optional[_Union[SchedulingPolicy, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class SetModelPlacementRequest(_message.Message):
    __slots__ = ("name", "replicas", "fill_mode", "fill_factor", "allow_unknown_model")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FILL_MODE_FIELD_NUMBER: _ClassVar[int]
    FILL_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ALLOW_UNKNOWN_MODEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    replicas: int
    fill_mode: str
    fill_factor: float
    allow_unknown_model: bool
    def __init__(self, name: _Optional[str] = ..., replicas: _Optional[int] = ..., fill_mode: _Optional[str] = ..., fill_factor: _Optional[float] = ..., allow_unknown_model: _Optional[bool] = ...) -> None: ...

class SetModelPlacementResponse(_message.Message):
    __slots__ = ("name", "configured_replicas", "effective_replicas", "fill_mode", "fill_quantum", "warnings")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FILL_MODE_FIELD_NUMBER: _ClassVar[int]
    FILL_QUANTUM_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    configured_replicas: int
    effective_replicas: int
    fill_mode: str
    fill_quantum: int
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., configured_replicas: _Optional[int] = ..., effective_replicas: _Optional[int] = ..., fill_mode: _Optional[str] = ..., fill_quantum: _Optional[int] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class RepackRequest(_message.Message):
    __slots__ = ("wait_seconds",)
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    wait_seconds: float
    def __init__(self, wait_seconds: _Optional[float] = ...) -> None: ...

class RepackResponse(_message.Message):
    __slots__ = ("sequence", "completed_sequence", "completed", "waited_seconds", "repack", "warnings")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPACK_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    completed_sequence: int
    completed: bool
    waited_seconds: float
    repack: RepackStatus
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequence: _Optional[int] = ..., completed_sequence: _Optional[int] = ..., completed: _Optional[bool] = ..., waited_seconds: _Optional[float] = ..., repack: _Optional[_Union[RepackStatus, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...
