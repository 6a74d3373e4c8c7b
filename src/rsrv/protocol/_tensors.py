"""The wire-neutral core of input decoding: every check an input goes through, whichever
wire it came on (gRPC protobuf in ``_decode``, REST JSON and binary in ``_rest_codec``).

A wire adapter walks the request's inputs and, for each, calls :func:`plan_input`
(names, datatype, rank, fixed axes, negative dims, size from the shape alone), then
checks the data source it found (:func:`check_data_size` for bytes in the request,
:func:`check_shm_input` for a shared-memory region, its own count check for typed
values), then :func:`check_inputs`; only once every input has passed does it call
:func:`materialize`, so nothing sized by the request is allocated for a request that
fails. Every failure is InvalidArgument naming the tensor, except the shared-memory
statuses of ``_parameters`` (NotFound, FailedPrecondition).

Decoded arrays are read-only: bytes in the request are zero-copy ``np.frombuffer``
views; shared-memory inputs are copied out of the region first (the client may reuse it
as soon as the response arrives); typed values are converted. BYTES inputs are object
arrays of ``bytes``. The codec assumes a little-endian host (as Triton and tritonclient
do).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rsrv.bundle import Tensor, rows_mismatch
from rsrv.dtypes import DType
from rsrv.errors import InvalidArgument, RsrvError
from rsrv.protocol._bytes import deserialize_bytes
from rsrv.protocol._parameters import ShmTarget, check_region, registry, with_context
from rsrv.protocol._shm import SharedMemoryRegistry

__all__ = [
    "BYTES_ELEMENT_SECONDS",
    "COPY_BYTE_SECONDS",
    "DEFAULT_MAX_TENSOR_BYTES",
    "TYPED_VALUE_SECONDS",
    "Decoding",
    "InputPlan",
    "check_data_size",
    "check_inputs",
    "check_shm_input",
    "materialize",
    "narrow",
    "plan_input",
]

DEFAULT_MAX_TENSOR_BYTES = 2**31 - 1
"""Largest tensor (elements x itemsize; 4 bytes per BYTES element at least) accepted."""


@dataclass(slots=True)
class InputPlan:
    """One validated input and where its data is: ``raw`` (bytes of the request), ``shm``
    (a region), or ``values`` (typed values, converted by the wire's own function);
    ``field`` names the typed source for messages."""

    spec: Tensor
    what: str
    shape: tuple[int, ...]
    count: int
    raw: Any = None  # bytes-like
    shm: ShmTarget | None = None
    values: Any = None
    field: str | None = None


#: Rough costs of the codec, measured on a 2-core VM: a BYTES element parsed or built
#: (~0.3 us), a typed value converted (~30 ns), a byte copied (~5 GB/s). Numeric bytes in
#: a request are not copied.
BYTES_ELEMENT_SECONDS = 3e-7
TYPED_VALUE_SECONDS = 3e-8
COPY_BYTE_SECONDS = 2e-10


@dataclass(slots=True)
class Decoding:
    """A request's inputs, every check passed, not yet materialized: ``seconds`` is
    roughly how long :meth:`materialize` takes (numeric bytes in the request are not
    copied and cost nothing), so that a caller may run it in a worker thread."""

    plans: list[InputPlan]
    shm: SharedMemoryRegistry | None
    typed: Callable[[InputPlan], np.ndarray]

    @property
    def seconds(self) -> float:
        total = 0.0
        for plan in self.plans:  # (numeric bytes in the request, the usual: nothing)
            if plan.spec.dtype is DType.BYTES:
                total += plan.count * BYTES_ELEMENT_SECONDS
            elif plan.field is not None:
                total += plan.count * TYPED_VALUE_SECONDS
            if plan.shm is not None:
                total += plan.shm.byte_size * COPY_BYTE_SECONDS
        return total

    def materialize(self) -> dict[str, np.ndarray]:
        """``{name: read-only array}`` in request order (thread-safe)."""
        return {plan.spec.name: materialize(plan, self.shm, self.typed) for plan in self.plans}


def _names(specs: Sequence[Tensor]) -> str:
    return "[" + ", ".join(f"'{s.name}'" for s in specs) + "]"


def _check_shape(spec: Tensor, shape: tuple[int, ...], what: str) -> None:
    """(Of a shape whose rank is the spec's.)"""
    for axis, (got, want) in enumerate(zip(shape, spec.shape, strict=True)):
        if got < 0:
            raise InvalidArgument(
                f"{what}: negative dimension {got} on axis {axis} of shape {list(shape)}"
            )
        if axis == spec.batch_axis:
            if got == 0:
                raise InvalidArgument(
                    f"{what}: the batch axis (axis {axis}) has 0 rows in shape "
                    f"{list(shape)}; a request needs at least one"
                )
        elif want >= 0 and got != want:
            raise InvalidArgument(
                f"{what}: axis {axis} has extent {got} but the model expects {want} "
                f"(shape {list(shape)} vs {spec.describe()})"
            )


def plan_input(
    model: str,
    name: str,
    datatype: str,
    shape: Sequence[int],
    by_name: Mapping[str, Tensor],
    seen: set[str],
    max_tensor_bytes: int,
    check_rows: Callable[[int], None] | None = None,
) -> InputPlan:
    """Check one input's header against the model's client-facing specs (``by_name``):
    declared, not repeated (``seen`` is updated), datatype, shape, its rows on the batch
    axis (``check_rows``, when given), and size from the shape alone (above
    ``max_tensor_bytes``: refused before anything is allocated)."""
    what = f"input tensor '{name}' for model '{model}'"
    spec = by_name.get(name)
    if spec is None:
        raise InvalidArgument(
            f"unexpected {what}: the model's inputs are {_names(list(by_name.values()))}"
        )
    if name in seen:
        raise InvalidArgument(f"{what} appears more than once in the request")
    seen.add(name)
    if datatype != spec.dtype.kserve:
        raise InvalidArgument(
            f"{what}: got datatype {datatype or '(empty)'}, expected {spec.dtype.kserve}"
        )
    rank = len(shape)
    if rank != spec.rank:  # (before anything walks a shape of any length: 20M dims)
        shown = list(shape) if rank <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...]"
        raise InvalidArgument(
            f"{what}: rank {rank} (shape {shown}) does not match the model's "
            f"rank {spec.rank} ({spec.describe()})"
        )
    shape = tuple(shape)
    _check_shape(spec, shape, what)
    count = math.prod(shape)
    # A zero dimension leaves no data, but the other dimensions still shape an array
    # that numpy must be able to address: they count against the limit too.
    extent = count or math.prod(max(d, 1) for d in shape)
    least = extent * (spec.dtype.itemsize or 4)  # BYTES: a 4-byte prefix per element
    if least > max_tensor_bytes:
        elements = f"{count} elements"
        if not count:
            elements = f"0 elements, but its other dimensions span {extent}"
        raise InvalidArgument(
            f"{what}: shape {list(shape)} has {elements} ({least} bytes"
            f"{' at least' if spec.dtype is DType.BYTES else ''}), above the limit of "
            f"{max_tensor_bytes} bytes per tensor"
        )
    if check_rows is not None and spec.batch_axis is not None:
        check_rows(shape[spec.batch_axis])
    return InputPlan(spec, what, shape, count)


def check_data_size(plan: InputPlan, nbytes: int, source: str, limit: int) -> None:
    """``nbytes`` of data from ``source`` must fit the shape exactly (BYTES: at least a
    4-byte prefix per element, at most ``limit``)."""
    spec = plan.spec
    if spec.dtype is DType.BYTES:
        if nbytes < 4 * plan.count:
            raise InvalidArgument(
                f"{plan.what}: {source} holds {nbytes} bytes, too few for {plan.count} "
                f"BYTES elements (each needs a 4-byte length prefix)"
            )
        if nbytes > limit:
            raise InvalidArgument(
                f"{plan.what}: {source} holds {nbytes} bytes, above the limit of {limit} "
                "bytes per tensor"
            )
        return
    expected = plan.count * spec.dtype.itemsize
    if nbytes != expected:
        raise InvalidArgument(
            f"{plan.what}: {source} holds {nbytes} bytes but shape {list(plan.shape)} of "
            f"{spec.dtype.kserve} needs {plan.count} x {spec.dtype.itemsize} = {expected}"
        )


def check_shm_input(
    plan: InputPlan,
    target: ShmTarget,
    shm: SharedMemoryRegistry | None,
    limit: int,
    *,
    other_data: str | None = None,
) -> None:
    """An input in shared memory: no other data (``other_data`` names what the request
    also carries), its byte size fits the tensor, the region is registered and the
    window lies within it."""
    if other_data is not None:
        raise InvalidArgument(
            f"{plan.what}: {other_data} must not be set when the input is in shared "
            f"memory region '{target.region}'"
        )
    check_data_size(
        plan, target.byte_size, f"shared_memory_byte_size of region '{target.region}'", limit
    )
    plan.shm = check_region(shm, target, plan.what)


def check_inputs(model: str, specs: Sequence[Tensor], plans: Sequence[InputPlan]) -> None:
    """InvalidArgument unless ``plans`` (each input planned, once) hold every input
    of ``specs`` and agree on the request's rows: one extent along their batch axes
    (Triton's words first; the batch axis is the spec's)."""
    seen = {plan.spec.name for plan in plans}
    missing = [s.name for s in specs if s.name not in seen]
    if missing:
        raise InvalidArgument(
            f"model '{model}' expects input tensor(s) "
            f"{', '.join(repr(m) for m in missing)}, missing from the request"
        )
    mismatch = rows_mismatch(model, ((plan.spec, plan.shape) for plan in plans))
    if mismatch is not None:
        raise InvalidArgument(mismatch)


def materialize(
    plan: InputPlan,
    shm: SharedMemoryRegistry | None,
    typed: Callable[[InputPlan], np.ndarray],
) -> np.ndarray:
    """The input's read-only array; ``typed`` converts typed values (the wire's own)."""
    if plan.shm is not None:
        target = plan.shm
        found = registry(shm, target, plan.what)
        try:
            data = found.read(target.registered, target.offset, target.byte_size)
        except RsrvError as e:  # e.g. unregistered since validation
            raise with_context(e, plan.what) from None
        array = _from_buffer(plan, data)
    elif plan.raw is not None:
        array = _from_buffer(plan, plan.raw)
    elif plan.field is None:  # no elements, no data
        array = np.empty(0, dtype=plan.spec.dtype.numpy)
    else:
        array = typed(plan)
    array = array.reshape(plan.shape)
    array.flags.writeable = False
    return array


def _from_buffer(plan: InputPlan, data) -> np.ndarray:
    spec = plan.spec
    if spec.dtype is DType.BYTES:
        return deserialize_bytes(data, plan.count, plan.what)
    if spec.dtype is DType.BOOL and plan.count:
        if np.frombuffer(data, dtype=np.uint8).max() > 1:
            raise InvalidArgument(f"{plan.what}: BOOL bytes must be 0 or 1")
    return np.frombuffer(data, dtype=spec.dtype.numpy)


def narrow(array: np.ndarray, plan: InputPlan, source: str) -> np.ndarray:
    """``array`` (typed values widened to a wire type) as the input's dtype; values
    outside its range are InvalidArgument naming ``source``."""
    spec = plan.spec
    target = spec.dtype.numpy
    if array.dtype == target:
        return array
    if array.dtype.kind in "iu" and target.kind in "iu":
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise InvalidArgument(
                f"{plan.what}: {source} holds values outside the "
                f"{spec.dtype.kserve} range [{info.min}, {info.max}]"
            )
    return array.astype(target)
