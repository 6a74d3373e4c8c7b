"""A compiled model: one PJRT executable per compiled batch size, run as
``main(inputs..., weights...)``.

:class:`CompiledModel` holds no device weights itself; the caller passes them to
:meth:`CompiledModel.run`, so weight residency stays the weight cache's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

from rsrv.bundle import read_module
from rsrv.errors import Internal
from rsrv.runtime._backend import device
from rsrv.runtime._compiler import Compiler
from rsrv.runtime._staging import stage, to_device

if TYPE_CHECKING:  # the bundle package imports the runtime's file readers
    from rsrv.bundle import Bundle


@dataclass(slots=True)
class CompiledModel:
    bundle: Bundle
    executables: dict[int, object]  # batch size (0 = unbatched) -> LoadedExecutable
    compile_seconds: float
    cache_hits: int

    @property
    def name(self) -> str:
        return self.bundle.name

    def run(
        self, size: int, inputs: Sequence[np.ndarray], weights: Sequence[jax.Array]
    ) -> list[np.ndarray]:
        """Execute the module for batch ``size``; blocks until results are on the host.

        ``inputs`` must already have the compiled shapes and dtypes (the scheduler pads
        and the codec validates); ``weights`` are device arrays in argument order.
        """
        exe = self.executables.get(size)
        if exe is None:
            raise Internal(
                f"model {self.name!r} has no executable for batch size {size} "
                f"(compiled: {sorted(self.executables)})"
            )
        dev = device()
        args = [jax.device_put(x, dev) for x in inputs]
        args.extend(weights)
        results = exe.execute_sharded(args).disassemble_into_single_device_arrays()
        return [np.asarray(r[0]) for r in results]


def compile_bundle(bundle: Bundle, compiler: Compiler) -> CompiledModel:
    """Compile every module of ``bundle`` (blocking; call it from a worker thread)."""
    executables, seconds, hits = {}, 0.0, 0
    for size, path in bundle.modules.items():
        result = compiler.compile(read_module(path))
        executables[size] = result.executable
        seconds += result.seconds
        hits += result.cached
    return CompiledModel(bundle, executables, seconds, hits)


def zero_inputs(model: CompiledModel, size: int) -> list[np.ndarray]:
    """Zero-filled executable inputs for batch ``size`` (warm-up and cost seeding)."""
    n_inputs = len(model.bundle.signature.executable_inputs)
    return [
        np.zeros(a.shape, a.dtype.numpy)
        for a in model.bundle.module_signatures[size].inputs[:n_inputs]
    ]


def weights_to_device(bundle: Bundle) -> list[jax.Array]:
    """Read the bundle's weights and copy them to the device (blocking)."""
    if bundle.weights is None:
        return []
    return to_device(stage(bundle.weights), device())
