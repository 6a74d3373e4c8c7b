"""A compiled model: one PJRT executable per compiled batch size, run as
``main(inputs..., weights...)``.

:class:`CompiledModel` holds no device weights itself; the caller passes them to
:meth:`CompiledModel.run`, so weight residency stays the weight cache's business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

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
        args = put_inputs(inputs)
        args.extend(weights)
        results = exe.execute_sharded(args).disassemble_into_single_device_arrays()
        return [np.asarray(r[0]) for r in results]


def _batched_put() -> Callable[[Sequence[np.ndarray]], list[jax.Array]] | None:
    """jax's own low-level placement (what ``jax.device_put`` ends in), or None.

    ``jax.device_put`` spends about 25 µs per array in Python dispatch before it gets
    there, more than a small model's whole execution; this calls
    ``xla_client.batched_device_put`` directly, one array at a time, the host memory
    shared where the backend can (CPU). It is jax's private API, so it is checked once
    against ``jax.device_put`` and not used when it is missing or disagrees.
    """
    try:
        from jax._src import core
        from jax._src.lib import xla_client
    except ImportError:
        return None
    dev = device()
    sharding = SingleDeviceSharding(dev)
    avals: dict[tuple, Any] = {}

    def put(arrays: Sequence[np.ndarray]) -> list[jax.Array]:
        out = []
        for x in arrays:
            key = (x.shape, x.dtype)
            aval = avals.get(key)
            if aval is None:
                aval = avals[key] = core.ShapedArray(x.shape, x.dtype)
            out.append(xla_client.batched_device_put(aval, sharding, [x], [dev], True))
        return out

    probe = np.arange(6, dtype=np.float32).reshape(2, 3)
    try:
        (placed,) = put([probe])
        good = placed.sharding == sharding and np.array_equal(np.asarray(placed), probe)
    except Exception:  # noqa: BLE001 - any failure means: use the public API
        good = False
    return put if good else None


def _public_put(arrays: Sequence[np.ndarray]) -> list[jax.Array]:
    dev = device()
    return [jax.device_put(x, dev) for x in arrays]


def put_inputs(arrays: Sequence[np.ndarray]) -> list[jax.Array]:
    """Host arrays onto the execution device, in order (see :func:`_batched_put`)."""
    global _put
    if _put is None:
        _put = _batched_put() or _public_put
    return _put(arrays)


_put: Callable[[Sequence[np.ndarray]], list[jax.Array]] | None = None


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
