"""The PJRT runtime: backend set-up, compilation with a persistent cache, execution, and
the device weights of every model (host staging, the weight cache under a byte budget,
the weight manager that moves weights on and off the device, the staging route, and the
allocator statistics the budget and the scratch measurement read)."""

from rsrv.runtime._allocator import AllocatorStats, allocator_limit, measured_scratch
from rsrv.runtime._backend import (
    DeviceInfo,
    DeviceUnavailable,
    configure,
    device,
    open_device,
    platform,
)
from rsrv.runtime._compiler import Compiler, CompileResult
from rsrv.runtime._model import CompiledModel, compile_bundle, weights_to_device, zero_inputs
from rsrv.runtime._staging import (
    ALIGN,
    HostWeights,
    Staging,
    free,
    pin,
    place,
    stage,
    staging_route,
    to_device,
)
from rsrv.runtime._weight_cache import CacheCounters, Resident, WeightCache
from rsrv.runtime._weight_manager import FileReplaced, Placement, WeightManager, weight_budget

__all__ = [
    "ALIGN", "AllocatorStats", "CacheCounters", "CompileResult", "CompiledModel", "Compiler",
    "DeviceInfo", "DeviceUnavailable", "FileReplaced", "HostWeights", "Placement", "Resident",
    "Staging", "WeightCache", "WeightManager", "allocator_limit", "compile_bundle", "configure",
    "device", "free", "measured_scratch", "open_device", "pin", "place", "platform", "stage",
    "staging_route", "to_device", "weight_budget", "weights_to_device", "zero_inputs",
]  # fmt: skip
