"""The parity gate: run the written bundle with rsrv's own runtime, compare with the source.

The bundle is loaded from its staging directory exactly as a worker loads it
(``load_bundle``, ``Compiler``, ``compile_bundle``, weights staged into one aligned host
buffer and copied to the device), every compiled batch size is run on seeded random
inputs, and each output is compared with what the source framework computes for the same
inputs. Float outputs must satisfy ``|got - want| <= atol + rtol * |want|`` elementwise
(the tolerances by the output's dtype unless given); integer and bool outputs must be
equal. Batched models are also checked row by row across batch sizes (the inputs of a
smaller size are the first rows of the largest one) and, at each size, with the first
row alone and the last row alone (the other rows zero, as the server pads) and with the
rows in reverse order, since the server pads and coalesces requests (a request's rows
may sit anywhere in a batch, beside any other request's) and so needs every row
computed independently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rsrv.bundle import Bundle
from rsrv.export._errors import ExportError

log = logging.getLogger("rsrv.export")


@dataclass(frozen=True, slots=True)
class Parity:
    """Settings of the parity gate (``parity=True`` means ``Parity()``).

    ``rtol`` and ``atol``, when given, apply to every float output; None (the default):
    by each output's dtype (``TOLERANCES``: f16 and bf16 round much more coarsely than
    f32, and the same rows at two batch sizes may differ in their last bit).
    ``int_range`` is the half-open range of integer inputs other than u8 (which covers
    0..255) and bool; ``make_inputs(n)``, when given, returns the executable inputs for
    batch size ``n`` (0 for an unbatched model) instead of the seeded random draw; they
    must have the inputs' dtypes and shapes.
    ``cache_dir``, when given, is a compilation cache directory (a node's ``cache_dir``):
    the gate's executables are stored there, so a worker using it loads them instead of
    compiling the bundle again.
    """

    rtol: float | None = None
    atol: float | None = None
    seed: int = 0
    int_range: tuple[int, int] = (0, 8)
    make_inputs: Callable[[int], Sequence[np.ndarray]] | None = None
    cache_dir: str | Path | None = None


#: (rtol, atol) of a float output by its dtype when Parity gives none; any other: f32's.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (2e-3, 1e-3),
    "bfloat16": (1.6e-2, 1e-2),
    "float32": (1e-4, 1e-5),
}


def tolerance(settings: Parity, dtype: np.dtype) -> tuple[float, float]:
    """The (rtol, atol) an output of ``dtype`` is compared with."""
    rtol, atol = TOLERANCES.get(np.dtype(dtype).name, TOLERANCES["float32"])
    return (
        rtol if settings.rtol is None else settings.rtol,
        atol if settings.atol is None else settings.atol,
    )


@dataclass(frozen=True, slots=True)
class OutputError:
    output: str
    batch_size: int
    max_abs: float
    max_rel: float
    rtol: float
    atol: float


@dataclass(frozen=True, slots=True)
class ParityReport:
    errors: tuple[OutputError, ...]

    @property
    def max_abs(self) -> float:
        return max((e.max_abs for e in self.errors), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((e.max_rel for e in self.errors), default=0.0)

    def summary(self) -> str:
        sizes = sorted({e.batch_size for e in self.errors})
        where = "unbatched" if sizes == [0] else "batch sizes " + ", ".join(map(str, sizes))
        tolerances = {}  # (the same order as the outputs)
        for e in self.errors:
            tolerances.setdefault(f"rtol {e.rtol:g}, atol {e.atol:g}", []).append(e.output)
        if len(tolerances) == 1:
            (shown,) = tolerances
        else:
            shown = "; ".join(
                f"{t} for {', '.join(dict.fromkeys(names))}" for t, names in tolerances.items()
            )
        return (
            f"parity ok at {where}: max abs err {self.max_abs:.3g}, max rel err "
            f"{self.max_rel:.3g} ({shown})"
        )


def draw_inputs(inputs, n: int, settings: Parity) -> list[np.ndarray]:
    """Seeded executable inputs for batch size ``n`` (0 = unbatched): floats standard
    normal, u8 0..255, bool 0/1, other integers in ``settings.int_range``; or
    ``settings.make_inputs(n)``'s, refused (ExportError) unless of the inputs' dtypes
    and shapes."""
    if settings.make_inputs is not None:
        made = [np.asarray(x) for x in settings.make_inputs(n)]
        if len(made) != len(inputs):
            raise ExportError(
                f"Parity.make_inputs({n}) returned {len(made)} arrays for {len(inputs)} inputs"
            )
        for spec, x in zip(inputs, made, strict=True):
            want = np.dtype(spec.dtype), tuple(spec.concrete(n))
            if (x.dtype, x.shape) != want:
                raise ExportError(
                    f"Parity.make_inputs({n}) returned {x.dtype}{list(x.shape)} for input "
                    f"{spec.name!r}, which is {want[0]}{list(want[1])}"
                )
        return made
    rng = np.random.default_rng(settings.seed)
    low, high = settings.int_range
    arrays = []
    for spec in inputs:
        shape = spec.concrete(n)
        dtype = np.dtype(spec.dtype)
        if dtype == np.bool_:
            arrays.append(rng.integers(0, 2, shape).astype(np.bool_))
        elif dtype == np.uint8:
            arrays.append(rng.integers(0, 256, shape).astype(np.uint8))
        elif dtype.kind in "iu":
            arrays.append(rng.integers(low, high, shape).astype(dtype))
        else:
            arrays.append(rng.standard_normal(shape).astype(dtype))
    return arrays


def check(
    bundle: Bundle,
    *,
    inputs,
    outputs,
    sizes: Sequence[int],
    reference: Callable[..., list[np.ndarray]],
    settings: Parity,
) -> ParityReport:
    """Run ``bundle`` (loaded from its staging directory) at every size in ``sizes``
    (0 = unbatched) and compare with ``reference(*inputs)``; raise :class:`ExportError`
    on a mismatch."""
    from rsrv.runtime import Compiler, compile_bundle, free, weights_to_device

    model = compile_bundle(bundle, Compiler(settings.cache_dir and Path(settings.cache_dir)))
    weights = weights_to_device(bundle)
    names = [o.name for o in outputs]
    in_axes = [i.batch_axis for i in inputs]
    batched = any(a is not None for a in in_axes)
    axes = [o.batch_axis if batched else None for o in outputs]
    errors: list[OutputError] = []
    try:
        largest = max(sizes)
        if settings.make_inputs is None:  # one draw; smaller sizes take its first rows
            full = draw_inputs(inputs, largest, settings)
            want_full = reference(*full)
        for n in sorted(sizes, reverse=True):
            if settings.make_inputs is not None:
                xs = draw_inputs(inputs, n, settings)
                want, against, hint = reference(*xs), "the source framework", ""
            else:
                xs = [_head(x, a, n) for x, a in zip(full, in_axes, strict=True)]
                want = [
                    _head(w, axes[k] if k < len(axes) else None, n) for k, w in enumerate(want_full)
                ]
                against, hint = "the source framework", ""
                if n != largest:
                    against = f"the source framework (the same rows in a batch of {largest})"
                    hint = _DEPENDENT_ROWS
            got = model.run(n, xs, weights)
            if len(want) != len(got):
                raise ExportError(
                    f"PARITY: the source returns {len(want)} outputs, the bundle {len(got)}"
                )
            for name, g, w in zip(names, got, want, strict=True):
                errors.append(_compare(name, n, g, w, settings, against, hint))
            if batched and n > 1:
                for row in (0, n - 1):  # one row as served alone: the rest zero padding
                    alone = [_row_padded(x, a, row) for x, a in zip(xs, in_axes, strict=True)]
                    got = model.run(n, alone, weights)
                    against = f"the source framework (row {row} of the same batch of {n})"
                    for name, g, w, a in zip(names, got, want, axes, strict=True):
                        pair = _rows(g, a, [row]), _rows(w, a, [row])
                        errors.append(_compare(name, n, *pair, settings, against, _PADDED_ROWS))
                backwards = list(range(n - 1, -1, -1))  # the same rows in another order
                reversed_xs = [_rows(x, a, backwards) for x, a in zip(xs, in_axes, strict=True)]
                got = model.run(n, reversed_xs, weights)
                against = f"the source framework (the same batch of {n} in reverse order)"
                for name, g, w, a in zip(names, got, want, axes, strict=True):
                    pair = g, _rows(w, a, backwards)
                    errors.append(_compare(name, n, *pair, settings, against, _DEPENDENT_ROWS))
    finally:
        free([w for w in weights if isinstance(w, jax.Array)])
    return ParityReport(tuple(errors))


_DEPENDENT_ROWS = (
    " Rows are not computed independently of each other, which the server's batching "
    "requires (specs/bundle.md section 6): a batch-dependent op such as BatchNorm using "
    "batch statistics?"
)
_PADDED_ROWS = " The row ran alone, the other rows zero as the server pads them." + _DEPENDENT_ROWS


def _row_padded(x: np.ndarray, axis: int, row: int) -> np.ndarray:
    """``x`` with every row but ``row`` zero (a 1-row request among padding)."""
    out = np.zeros_like(x)
    kept = [slice(None)] * x.ndim
    kept[axis] = slice(row, row + 1)
    out[tuple(kept)] = x[tuple(kept)]
    return out


def _head(x: Any, axis: int | None, n: int) -> np.ndarray:
    """The first ``n`` rows of ``x`` along ``axis`` (all of it when there is no axis)."""
    x = np.asarray(x)
    if axis is None or x.ndim <= axis or x.shape[axis] == n:
        return x
    return _rows(x, axis, list(range(n)))


def _rows(x: Any, axis: int | None, rows: list[int]) -> np.ndarray:
    """Rows ``rows`` of ``x`` along ``axis``, in that order (all of it when there is no
    axis)."""
    x = np.asarray(x)
    if axis is None or x.ndim <= axis:
        return x
    return np.take(x, rows, axis=axis)


def _compare(
    name: str, n: int, got: np.ndarray, want: Any, settings: Parity, against: str, hint: str = ""
) -> OutputError:
    want = np.asarray(want)
    where = "" if n == 0 else f" at batch size {n}"
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ExportError(
            f"PARITY: output {name!r}{where} is {got.dtype}{list(got.shape)} in "
            f"the bundle but {want.dtype}{list(want.shape)} in {against}. "
            "Nothing was written."
        )
    exact = got.dtype == np.bool_ or got.dtype.kind in "iu"
    rtol, atol = tolerance(settings, got.dtype)
    g, w = got.astype(np.float64), want.astype(np.float64)
    same = (g == w) | (np.isnan(g) & np.isnan(w))  # equal infinities, NaN against NaN
    with np.errstate(invalid="ignore", divide="ignore"):  # inf - inf, inf / inf
        diff = np.where(same, 0.0, np.abs(g - w))
        rel = diff / np.maximum(np.abs(w), np.finfo(np.float64).tiny)
    if exact:
        bad = got != want  # compared natively: float64 cannot hold every 64-bit integer
    else:  # a NaN or an infinity that is not matched exactly is a mismatch
        tol = atol + rtol * np.abs(w)
        bad = ~same & ~(np.isfinite(diff) & (diff <= tol))
    max_abs = float(np.nanmax(diff, initial=0.0))
    max_rel = float(np.nanmax(np.where(diff == 0, 0.0, rel), initial=0.0))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        rule = "exactly" if exact else f"within rtol {rtol:g}, atol {atol:g}"
        raise ExportError(
            f"PARITY: output {name!r}{where} differs from {against}: {int(bad.sum())} of "
            f"{bad.size} elements are not equal {rule}; max abs err {max_abs:.3g}, max rel "
            f"err {max_rel:.3g}; first at index {list(idx)}: bundle {got[idx].item()!r}, "
            f"expected {want[idx].item()!r}.{hint} Nothing was written."
        )
    return OutputError(name, n, max_abs, max_rel, rtol, atol)
