"""The PJRT runtime: backend set-up, compilation with a persistent cache, execution."""

from rsrv.runtime.backend import configure, device
from rsrv.runtime.compiler import Compiler, CompileResult
from rsrv.runtime.model import CompiledModel, compile_bundle, weights_to_device

__all__ = [
    "CompileResult", "CompiledModel", "Compiler", "compile_bundle", "configure", "device",
    "weights_to_device",
]  # fmt: skip
