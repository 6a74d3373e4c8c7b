"""The export back end: a :class:`Program` to a bundle (see specs/export.md).

The function is traced once per batch size as ``main(inputs..., weights...)``: every
parameter leaf becomes an explicit weight argument (never a baked-in constant), named by
its tree path, and written to ``weights.safetensors`` with that order under
``argument_order``. Modules are written as StableHLO portable artifacts with debug
locations stripped, and traced under an explicit ``jax_enable_x64`` setting, so the same
inputs always produce byte-identical files whatever the process-wide setting is.

Two gates guard what is written. The arity gate refuses, before anything is written, a
traced program whose entry takes more or fewer arguments than inputs + weights. The
parity gate runs the staged bundle with rsrv's own runtime and compares it with the source
framework; only a bundle that passes replaces ``out_dir``.

This is the export back end: every framework adapter (JAX in ``_jax``, Flax, Equinox,
PyTorch) builds a :class:`Program` and calls :func:`export_program`.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

import jax
import msgspec
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path

from rsrv.bundle import (
    BATCH_LETTER,
    FORMAT_VERSION,
    Batching,
    Manifest,
    TensorSpec,
    load_bundle,
    read_signature,
    resolve_manifest,
)
from rsrv.dtypes import TOKENS, DType
from rsrv.errors import BundleError
from rsrv.export._errors import ExportError
from rsrv.export._parity import Parity
from rsrv.export._parity import check as parity_check
from rsrv.export._provenance import collect_provenance
from rsrv.export._writer import check_replaceable, write_bundle

__all__ = ["Input", "Output", "Program", "compiled_sizes", "export_program", "flatten_weights"]

log = logging.getLogger("rsrv.export")
_AUTO_LETTERS = "abcdefghijklmopqrstuvwxyz"  # every lowercase letter but the batch letter n


@dataclass(frozen=True, slots=True)
class Input:
    """An executable input. ``shape`` holds ints and at most one ``"n"`` (the batch axis)."""

    name: str
    dtype: Any
    shape: tuple[int | str, ...]
    letters: str | None = None

    @property
    def batch_axis(self) -> int | None:
        """The axis of ``"n"``, or None for an input without a batch axis."""
        return self.shape.index(BATCH_LETTER) if BATCH_LETTER in self.shape else None

    def concrete(self, n: int) -> tuple[int, ...]:
        """The shape with ``n`` rows on the batch axis."""
        return tuple(n if d == BATCH_LETTER else int(d) for d in self.shape)


def check_inputs(inputs: Sequence[Input]) -> None:
    """Raise :class:`ExportError` unless every input has a unique name, a dtype a bundle
    holds (a numpy dtype) and a shape of positive ints with at most one ``"n"``."""
    names = [i.name for i in inputs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ExportError(f"input names are not unique: {', '.join(dup)}")
    for i in inputs:
        if not isinstance(i.name, str) or not i.name:
            raise ExportError(f"input name {i.name!r}: expected a non-empty string")
        try:
            DType.from_numpy(np.dtype(i.dtype))
        except (TypeError, ValueError):
            hint = ""
            if isinstance(i.dtype, str) and i.dtype in TOKENS:
                hint = f" (for the manifest's {i.dtype!r} pass np.{DType(i.dtype).numpy})"
            raise ExportError(
                f"input {i.name!r}: dtype {i.dtype!r} is not a numpy dtype a bundle holds{hint}"
            ) from None
        shape = tuple(i.shape) if isinstance(i.shape, (tuple, list)) else None
        good = shape is not None and all(
            d == BATCH_LETTER or (isinstance(d, int) and not isinstance(d, bool) and d >= 1)
            for d in shape
        )
        if not good or shape.count(BATCH_LETTER) > 1:
            raise ExportError(
                f"input {i.name!r}: shape {i.shape!r}: expected a tuple of positive ints "
                f"with at most one {BATCH_LETTER!r} (the batch axis)"
            )


def compiled_sizes(inputs: Sequence[Input], batch_sizes: Sequence[int]) -> list[int]:
    """The distinct batch sizes to compile, ascending; ``[0]`` when no input has a batch
    axis. ExportError unless they are positive integers (before anything is traced)."""
    if not any(i.batch_axis is not None for i in inputs):
        return [0]
    sizes = sorted(set(batch_sizes))
    if not sizes or not all(isinstance(s, int) and s >= 1 for s in sizes):
        raise ExportError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    return sizes


def flatten_weights(tree: Any, **kwargs: Any) -> tuple[list[str], list[Any], Any]:
    """The leaves of a parameter tree, named by their paths (``layers.0.w``), and its
    treedef. ``kwargs`` go to ``tree_flatten_with_path`` (e.g. ``is_leaf``)."""
    paths_leaves, treedef = tree_flatten_with_path(tree, **kwargs)
    names = [keystr(p, simple=True, separator=".") for p, _ in paths_leaves]
    return names, [leaf for _, leaf in paths_leaves], treedef


@dataclass(frozen=True, slots=True)
class Output:
    """An executable output; dtype and shape come from tracing. ``batch_axis`` None = none,
    else the index of the batch axis in the output's shape, counted from 0 (ExportError
    for a negative one: the output's rank is known only once traced)."""

    name: str
    batch_axis: int | None = 0
    letters: str | None = None

    def __post_init__(self) -> None:
        axis = self.batch_axis
        index = isinstance(axis, Integral) and not isinstance(axis, bool)
        if axis is not None and not (index and axis >= 0):
            raise ExportError(
                f"output {self.name!r}: batch_axis {axis!r} must be None or an axis index "
                "counted from 0"
            )


@dataclass(frozen=True, slots=True)
class Program:
    """What an adapter hands :func:`export_program`.

    ``call(weights, state, *inputs)`` is traced; ``weights`` is the list of arrays named by
    ``weight_names``, in argument order. ``state`` is non-weight state the call may read
    (RNG keys and counters): leaves the program does not use are dropped; leaves it uses
    are lifted into extra entry arguments, which the arity gate then refuses, naming them
    with ``state_hint``. ``reference(*inputs)`` runs the source framework on numpy inputs
    (the parity gate's expectation). ``framework`` and ``packages`` go into provenance.
    """

    call: Callable[..., Any]
    weight_names: Sequence[str]
    weights: Sequence[Any]
    reference: Callable[..., Any]
    framework: str = "jax"
    packages: tuple[str, ...] = ()
    state_names: Sequence[str] = ()
    state: Sequence[Any] = ()
    state_hint: str = ""


def export_program(
    program: Program,
    *,
    inputs: Sequence[Input],
    outputs: Sequence[Output | str],
    batch_sizes: Sequence[int],
    out_dir: str | Path,
    description: str = "",
    client_inputs: Sequence[TensorSpec] | None = None,
    client_outputs: Sequence[TensorSpec] | None = None,
    model_py: str | None = None,
    provenance: Mapping[str, Any] | None = None,
    x64: bool | None = None,
    parity: bool | Parity = True,
) -> Path:
    """Trace, gate and write ``program`` (the shared back end of every adapter).

    ``inputs`` are the executable inputs, ``outputs`` names (or :class:`Output`) of the
    executable outputs, ``batch_sizes`` the sizes to compile (ignored when no input has
    a batch axis), ``out_dir`` the bundle directory. ``description`` goes into the
    manifest; ``client_inputs`` / ``client_outputs`` and ``model_py`` add a model.py
    stage. ``provenance`` replaces the automatic record when given (pass
    ``collect_provenance(...)`` plus your own keys to extend it). ``x64`` traces with
    ``jax_enable_x64`` on or off; None: on exactly when an input or weight is 64-bit.
    ``parity`` (default on) checks the written bundle against ``program.reference``
    before it replaces ``out_dir``. Raises :class:`ExportError`, writing nothing, when
    a gate refuses.
    """
    out_dir = Path(out_dir)
    check_replaceable(out_dir)  # (before the work: again before the bundle is swapped in)
    inputs = list(inputs)
    check_inputs(inputs)
    outputs = [o if isinstance(o, Output) else Output(o) for o in outputs]
    names = list(program.weight_names)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ExportError(f"weight names are not unique: {', '.join(dup)}")
    if "__metadata__" in names:  # (safetensors' own key)
        raise ExportError("a weight cannot be named '__metadata__' (safetensors' metadata)")
    weights = [_weight_array(name, w) for name, w in zip(names, program.weights, strict=True)]
    x64 = _x64_setting(x64, inputs, names, weights)
    sizes = compiled_sizes(inputs, batch_sizes)
    batched = sizes != [0]
    record = (
        _readable_provenance(provenance)
        if provenance is not None
        else collect_provenance(program.framework, program.packages, jax_enable_x64=x64)
    )

    with jax.enable_x64(x64):
        modules, out_avals = _trace(program, inputs, outputs, weights, sizes)

    exec_inputs = [_input_spec(i) for i in inputs]
    exec_outputs = _output_specs(outputs, out_avals, batched)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        description=description,
        executable_inputs=exec_inputs,
        executable_outputs=exec_outputs,
        client_inputs=list(client_inputs) if client_inputs is not None else None,
        client_outputs=list(client_outputs) if client_outputs is not None else None,
        batching=Batching(compiled_batch_sizes=sizes if batched else []),
        provenance=record,
    )
    try:  # (what the loader will refuse, refused before anything is written)
        resolve_manifest(manifest, out_dir / "manifest.yaml", out_dir.name)
    except BundleError as e:
        raise ExportError(f"the bundle's manifest would not load: {e}") from None
    _check_every_size(outputs, out_avals, batched, exec_outputs)

    settings = (parity if isinstance(parity, Parity) else Parity()) if parity else None

    def reference(*xs):
        with jax.enable_x64(x64):
            result = as_outputs(program.reference(*xs), outputs)
        return [np.asarray(r) for r in result]

    def verify(staging: Path) -> None:
        """What a worker's loader checks (model.py, client tensors: with or without the
        parity gate), then the gate."""
        try:
            bundle = load_bundle(staging, out_dir.name)
        except BundleError as e:
            message = str(e).replace(str(staging), str(out_dir))
            raise ExportError(f"the written bundle would not load: {message}") from None
        if settings is not None:
            report = parity_check(
                bundle,
                inputs=inputs,
                outputs=outputs,
                sizes=sizes,
                reference=reference,
                settings=settings,
            )
            log.info("%s: %s", out_dir.name, report.summary())

    return write_bundle(out_dir, manifest, modules, names, weights, model_py, verify)


def _trace(
    program: Program,
    inputs: list[Input],
    outputs: list[Output],
    weights: list[np.ndarray],
    sizes: list[int],
):
    n_in, n_w = len(inputs), len(weights)
    state = list(program.state)

    def avals_for(n):
        xs = [jax.ShapeDtypeStruct(i.concrete(n), np.dtype(i.dtype)) for i in inputs]
        return xs, [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]

    lifted = _used_state(program, state, *avals_for(sizes[0])) if state else []

    def entry(*args):
        xs, ws, used = args[:n_in], args[n_in : n_in + n_w], args[n_in + n_w :]
        st = list(state)
        for k, value in zip(lifted, used, strict=True):
            st[k] = value
        return as_outputs(program.call(list(ws), st, *xs), outputs)

    modules: dict[int, bytes] = {}
    out_avals: dict[int, Sequence[Any]] = {}
    for n in sizes:
        xs, ws = avals_for(n)
        extra = [jax.ShapeDtypeStruct(np.shape(state[k]), state[k].dtype) for k in lifted]
        exported = jax.export.export(jax.jit(entry, keep_unused=True))(*xs, *ws, *extra)
        if len(exported.out_avals) != len(outputs):
            raise ExportError(
                f"the function returns {len(exported.out_avals)} outputs, {len(outputs)} were named"
            )
        for o, aval in zip(outputs, exported.out_avals, strict=True):
            try:
                DType.from_numpy(np.dtype(aval.dtype))
            except ValueError:
                raise ExportError(
                    f"output {o.name!r} has dtype {aval.dtype}, which a bundle cannot hold"
                ) from None
        text = _portable_text(exported.mlir_module())
        got = len(read_signature(text).inputs)
        if got != n_in + n_w:
            message = (
                f"UNSERVABLE: the compiled entry takes {got} arguments but rsrv calls it with "
                f"{n_in + n_w} ({n_in} inputs + {n_w} weights). The likely cause "
                "is state lifted into extra arguments (an RNG key, a mutable collection, an "
                "effect token); make it a parameter or an input, or close over nothing stateful."
            )
            if lifted:
                message += (
                    f" Lifted here: {', '.join(program.state_names[k] for k in lifted)}"
                    f"{': ' + program.state_hint if program.state_hint else ''}."
                )
            raise ExportError(message)
        modules[n] = _portable_bytes(text)
        out_avals[n] = exported.out_avals
    return modules, out_avals


def _readable_provenance(provenance: Mapping[str, Any]) -> dict[str, Any]:
    """``provenance`` as given, once known to be writable to the manifest and readable
    from it (ExportError before any tracing otherwise: a numpy scalar, an object, a
    key that is not a string)."""
    record = dict(provenance)
    try:
        msgspec.yaml.decode(msgspec.yaml.encode(record), type=dict[str, Any])
    except (TypeError, msgspec.MsgspecError) as e:
        raise ExportError(
            f"provenance cannot be written to the manifest: {e}; give it strings, "
            "Python numbers, booleans, None, lists and mappings with string keys"
        ) from None
    return record


def _used_state(program: Program, state: list, xs, ws) -> list[int]:
    """Indices of the ``state`` leaves the traced call reads (dead code eliminated)."""
    from jax._src.interpreters import partial_eval as pe

    def probe(xs, ws, st):
        return program.call(list(ws), list(st), *xs)

    st = [jax.ShapeDtypeStruct(np.shape(s), s.dtype) for s in state]
    closed = jax.make_jaxpr(probe)(xs, ws, st)
    n_out = len(closed.jaxpr.outvars)
    _, used = pe.dce_jaxpr(closed.jaxpr, [True] * n_out)
    offset = len(xs) + len(ws)
    return [k for k in range(len(state)) if used[offset + k]]


def as_outputs(result: Any, outputs: Sequence[Output]) -> tuple:
    """The function's result as one array per named output, in ``outputs`` order: one
    array, a tuple or list of them, or a mapping from exactly the output names.

    Raises ExportError for a mapping whose keys are not the names, and for an element
    that is not one array (a nested tuple or dict, None): jax would flatten it, and
    the outputs would be named by position in its flattening, not as the function meant.
    """
    if isinstance(result, Mapping):
        names = [o.name for o in outputs]
        missing = [n for n in names if n not in result]
        extra = [str(k) for k in result if k not in names]
        if missing or extra:
            raise ExportError(
                "the function returns a mapping whose keys are not the outputs named: "
                + "; ".join(
                    f"{what} {', '.join(map(repr, keys))}"
                    for what, keys in (("missing", missing), ("not named", extra))
                    if keys
                )
            )
        values = tuple(result[n] for n in names)
    else:
        values = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    for k, value in enumerate(values):
        leaves = jax.tree_util.tree_leaves(value)
        if len(leaves) != 1 or leaves[0] is not value:
            what = f"output {outputs[k].name!r}" if k < len(outputs) else f"result #{k}"
            raise ExportError(
                f"the function's {what} is a {type(value).__name__}, not an array: return one "
                "array per named output (a tuple, a list or a mapping of arrays)"
            )
    return values


_PYTHON_NUMBERS = {bool: np.bool_, int: np.int32, float: np.float32}


def number_as_weight(leaf: Any) -> Any:
    """A Python number as the weight it becomes (an array of jax's default dtype, no
    longer weakly typed); any other leaf as it is."""
    dtype = _PYTHON_NUMBERS.get(type(leaf))
    return leaf if dtype is None else np.asarray(leaf, dtype)


def _weight_array(name: str, leaf: Any) -> np.ndarray:
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise ExportError(
            f"weight {name!r} is a PRNG key ({dtype}): RNG state is not a weight "
            "and a bundle cannot store it; drop it from the parameters, or make "
            "the randomness an input"
        )
    try:
        # A Python number takes jax's default dtype (jax would trace it weakly typed; a
        # weight has a dtype): np.asarray would make a float float64, switching x64 on.
        array = np.asarray(number_as_weight(leaf))
    except (TypeError, ValueError, OverflowError) as e:
        raise ExportError(f"weight {name!r} is not an array: {type(leaf).__name__} ({e})") from None
    try:
        DType.from_numpy(array.dtype)
    except ValueError:
        raise ExportError(
            f"weight {name!r} has dtype {array.dtype}, which a bundle cannot hold "
            f"(a {type(leaf).__name__} leaf?)"
        ) from None
    return array


def _is_64bit(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind in "fiu" and dtype.itemsize == 8


def _x64_setting(
    x64: bool | None, inputs: Sequence[Input], names: Sequence[str], weights: Sequence[np.ndarray]
) -> bool:
    wide = [f"input {i.name!r} ({np.dtype(i.dtype)})" for i in inputs if _is_64bit(i.dtype)]
    wide += [
        f"weight {n!r} ({w.dtype})"
        for n, w in zip(names, weights, strict=True)
        if _is_64bit(w.dtype)
    ]
    if x64 is None:
        return bool(wide)
    if not x64 and wide:
        raise ExportError(
            f"x64=False, but {', '.join(wide)} "
            f"{'is' if len(wide) == 1 else 'are'} 64-bit: tracing without "
            "jax_enable_x64 would narrow them; pass x64=True or cast them"
        )
    return bool(x64)


def _letters(given: str | None, rank: int, batch_axis: int | None) -> str:
    if given is not None:
        if len(given) != rank:
            raise ExportError(f"letters {given!r} name {len(given)} axes, the tensor has {rank}")
        batch = [i for i, ch in enumerate(given) if ch == BATCH_LETTER]
        if batch != ([] if batch_axis is None else [batch_axis]):
            where = "nowhere" if batch_axis is None else f"at axis {batch_axis} only"
            raise ExportError(
                f"letters {given!r}: the batch letter {BATCH_LETTER!r} belongs {where} "
                "(the tensor's batch axis)"
            )
        return given
    auto = iter(_AUTO_LETTERS)
    return "".join(BATCH_LETTER if i == batch_axis else next(auto) for i in range(rank))


def _input_spec(i: Input) -> TensorSpec:
    letters = _letters(i.letters, len(i.shape), i.batch_axis)
    dims = {ch: int(d) for ch, d in zip(letters, i.shape, strict=True) if ch != BATCH_LETTER}
    return TensorSpec(
        name=i.name, dtype=DType.from_numpy(np.dtype(i.dtype)).value, shape=letters, dims=dims
    )


def _output_specs(
    outputs: Sequence[Output], avals_by_size: Mapping[int, Sequence[Any]], batched: bool
) -> list[TensorSpec]:
    """The outputs' specs at the largest traced size."""
    n = max(avals_by_size)
    return [_output_spec(o, a, n, batched) for o, a in zip(outputs, avals_by_size[n], strict=True)]


def _check_every_size(
    outputs: Sequence[Output],
    avals_by_size: Mapping[int, Sequence[Any]],
    batched: bool,
    specs: Sequence[TensorSpec],
) -> None:
    """Raise :class:`ExportError` unless the outputs have ``specs`` (those of the largest
    size) at every traced size: only the batch axis may change with it."""
    largest = max(avals_by_size)
    for n, avals in sorted(avals_by_size.items(), reverse=True):
        for o, a, want in zip(outputs, avals, specs, strict=True):
            spec = _output_spec(o, a, n, batched)
            if spec != want:
                raise ExportError(
                    f"output {o.name!r} is {spec.dtype}{_shape(spec)} at batch size {n} "
                    f"but {want.dtype}{_shape(want)} at {largest}: only its batch axis may "
                    "change with the batch size"
                )


def _shape(spec: TensorSpec) -> list:
    return [BATCH_LETTER if ch == BATCH_LETTER else spec.dims[ch] for ch in spec.shape]


def _output_spec(o: Output, aval, n: int, batched: bool) -> TensorSpec:
    axis = o.batch_axis if batched else None
    if axis is not None and (axis >= len(aval.shape) or aval.shape[axis] != n):
        raise ExportError(
            f"output {o.name!r} has shape {list(aval.shape)}: axis {axis} is not "
            f"the batch axis (expected extent {n})"
        )
    letters = _letters(o.letters, len(aval.shape), axis)
    dims = {ch: int(d) for ch, d in zip(letters, aval.shape, strict=True) if ch != BATCH_LETTER}
    return TensorSpec(
        name=o.name, dtype=DType.from_numpy(np.dtype(aval.dtype)).value, shape=letters, dims=dims
    )


def _portable_text(module_text: str) -> str:
    """The module without source locations (file paths and line numbers vary by run)
    and without Shardy's ``sdy.*`` attributes. jax marks custom calls (LAPACK's, for
    ``jnp.linalg``) with sharding rules a portable artifact cannot hold; they guide
    partitioning across devices, and a bundle runs on one."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax.extend.mlir import ir

    def strip_sharding(op) -> object:
        attributes = op.attributes
        names = [attributes[i].name for i in range(len(attributes))]
        for name in names:
            if name.startswith("sdy."):
                del attributes[name]
        return ir.WalkResult.ADVANCE

    with jax_mlir.make_ir_context():
        module = ir.Module.parse(module_text)
        module.operation.walk(strip_sharding)
        text = io.StringIO()
        module.operation.print(file=text, enable_debug_info=False)
    return text.getvalue()


def _portable_bytes(module_text: str) -> bytes:
    """Serialize as a StableHLO portable artifact (versioned, reproducible bytecode)."""
    from jax.extend.mlir.dialects import stablehlo

    target = stablehlo.get_version_from_compatibility_requirement(
        stablehlo.StablehloCompatibilityRequirement.WEEK_12
    )
    try:
        return stablehlo.serialize_portable_artifact_str(module_text, target)
    except ValueError as e:
        raise ExportError(
            f"the traced module cannot be written as a StableHLO portable artifact: {e}"
        ) from None
