from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Residency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_UNSPECIFIED: _ClassVar[Residency]
    RESIDENCY_UNPINNED: _ClassVar[Residency]
    RESIDENCY_SYSTEM: _ClassVar[Residency]
    RESIDENCY_DEVICE: _ClassVar[Residency]
RESIDENCY_UNSPECIFIED: Residency
RESIDENCY_UNPINNED: Residency
RESIDENCY_SYSTEM: Residency
RESIDENCY_DEVICE: Residency

class ModelControlStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelControlStatusResponse(_message.Message):
    __slots__ = ("discipline", "control_mode", "weight_cache_budget_bytes", "weight_cache_resident_bytes", "models", "weight_cache_loads", "weight_cache_evictions", "instance")
    DISCIPLINE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_MODE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CACHE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CACHE_RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CACHE_LOADS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    discipline: str
    control_mode: str
    weight_cache_budget_bytes: int
    weight_cache_resident_bytes: int
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    weight_cache_loads: int
    weight_cache_evictions: int
    instance: str
    def __init__(self, discipline: _Optional[str] = ..., control_mode: _Optional[str] = ..., weight_cache_budget_bytes: _Optional[int] = ..., weight_cache_resident_bytes: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., weight_cache_loads: _Optional[int] = ..., weight_cache_evictions: _Optional[int] = ..., instance: _Optional[str] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "residency", "device_resident", "host_resident", "weight_bytes", "weight", "queue_depth", "compute_seconds", "requests_served", "rows_served", "dispatches", "max_batch_size", "batch_input_name", "batch_axis", "kind", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    HOST_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    ROWS_SERVED_FIELD_NUMBER: _ClassVar[int]
    DISPATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_INPUT_NAME_FIELD_NUMBER: _ClassVar[int]
    BATCH_AXIS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    residency: Residency
    device_resident: bool
    host_resident: bool
    weight_bytes: int
    weight: float
    queue_depth: int
    compute_seconds: float
    requests_served: int
    rows_served: int
    dispatches: int
    max_batch_size: int
    batch_input_name: str
    batch_axis: int
    kind: str
    state: str
    def __init__(self, name: _Optional[str] = ..., residency: _Optional[_Union[Residency, str]] = ..., device_resident: _Optional[bool] = ..., host_resident: _Optional[bool] = ..., weight_bytes: _Optional[int] = ..., weight: _Optional[float] = ..., queue_depth: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., requests_served: _Optional[int] = ..., rows_served: _Optional[int] = ..., dispatches: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., batch_input_name: _Optional[str] = ..., batch_axis: _Optional[int] = ..., kind: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class SetModelResidencyRequest(_message.Message):
    __slots__ = ("name", "residency")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    name: str
    residency: Residency
    def __init__(self, name: _Optional[str] = ..., residency: _Optional[_Union[Residency, str]] = ...) -> None: ...

class SetModelResidencyResponse(_message.Message):
    __slots__ = ("residency",)
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    residency: Residency
    def __init__(self, residency: _Optional[_Union[Residency, str]] = ...) -> None: ...

class SetModelPolicyRequest(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class SetModelPolicyResponse(_message.Message):
    __slots__ = ("weight",)
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    weight: float
    def __init__(self, weight: _Optional[float] = ...) -> None: ...

class CompactMemoryRequest(_message.Message):
    __slots__ = ("reload_models",)
    RELOAD_MODELS_FIELD_NUMBER: _ClassVar[int]
    reload_models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reload_models: _Optional[_Iterable[str]] = ...) -> None: ...

class CompactMemoryResponse(_message.Message):
    __slots__ = ("reloaded_models", "resident_bytes_after")
    RELOADED_MODELS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_AFTER_FIELD_NUMBER: _ClassVar[int]
    reloaded_models: int
    resident_bytes_after: int
    def __init__(self, reloaded_models: _Optional[int] = ..., resident_bytes_after: _Optional[int] = ...) -> None: ...
