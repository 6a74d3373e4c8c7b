"""Export a JAX function and its parameter pytree to a bundle.

The function is traced once per batch size as ``main(inputs..., weights...)``: every
parameter leaf becomes an explicit weight argument (never a baked-in constant), named by
its tree path, and written to ``weights.safetensors`` with that order under
``argument_order``. Modules are written as StableHLO portable artifacts with debug
locations stripped, so the same inputs always produce byte-identical files.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import msgspec
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path, tree_unflatten

from rsrv.bundle.manifest import BATCH_LETTER, FORMAT_VERSION, Batching, Manifest, TensorSpec
from rsrv.dtypes import DType
from rsrv.runtime.stablehlo import read_signature
from rsrv.runtime.weights import ORDER_KEY

_AUTO_LETTERS = "abcdefghijklmopqrstuvwxyz"  # every lowercase letter but the batch letter n


class ExportError(ValueError):
    """The model cannot be exported as a servable bundle; nothing was written."""


@dataclass(frozen=True, slots=True)
class Input:
    """An executable input. ``shape`` holds ints and at most one ``"n"`` (the batch axis)."""

    name: str
    dtype: Any
    shape: tuple[int | str, ...]
    letters: str | None = None


@dataclass(frozen=True, slots=True)
class Output:
    """An executable output; dtype and shape come from tracing. ``batch_axis`` None = none."""

    name: str
    batch_axis: int | None = 0
    letters: str | None = None


def export_jax(
    fn: Callable[..., Any],
    params: Any,
    *,
    inputs: Sequence[Input],
    outputs: Sequence[Output | str],
    batch_sizes: Sequence[int],
    out_dir: str | Path,
    description: str = "",
    client_inputs: Sequence[TensorSpec] | None = None,
    client_outputs: Sequence[TensorSpec] | None = None,
    model_py: str | None = None,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Trace ``fn(params, *inputs)`` at each batch size and write the bundle to ``out_dir``.

    ``out_dir`` is replaced as a whole only after everything succeeded.
    Raises :class:`ExportError` (writing nothing) when the traced program's argument
    count is not inputs + weights, e.g. when state was lifted into extra arguments.
    """
    out_dir = Path(out_dir)
    outputs = [o if isinstance(o, Output) else Output(o) for o in outputs]
    paths_leaves, treedef = tree_flatten_with_path(params)
    weight_names = [keystr(p, simple=True, separator=".") for p, _ in paths_leaves]
    weights = [np.asarray(leaf) for _, leaf in paths_leaves]
    batched = any(BATCH_LETTER in i.shape for i in inputs)
    sizes = sorted(set(batch_sizes)) if batched else [0]

    def entry(*args):
        xs, ws = args[: len(inputs)], args[len(inputs):]
        result = fn(tree_unflatten(treedef, ws), *xs)
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    modules: dict[int, bytes] = {}
    out_avals = None
    for n in sizes:
        avals = [jax.ShapeDtypeStruct(_concrete(i.shape, n), np.dtype(i.dtype)) for i in inputs]
        avals += [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]
        exported = jax.export.export(jax.jit(entry, keep_unused=True))(*avals)
        module = _portable_bytes(exported.mlir_module())
        got = len(read_signature(module).inputs)
        if got != len(avals):
            raise ExportError(
                f"UNSERVABLE: the compiled entry takes {got} arguments but rsrv calls it with "
                f"{len(avals)} ({len(inputs)} inputs + {len(weights)} weights). The likely cause "
                "is state lifted into extra arguments (an RNG key, a mutable collection, an "
                "effect token); make it a parameter or an input, or close over nothing stateful."
            )
        if len(exported.out_avals) != len(outputs):
            raise ExportError(f"the function returns {len(exported.out_avals)} outputs, "
                              f"{len(outputs)} were named")
        modules[n] = module
        out_avals = exported.out_avals

    exec_inputs = [_input_spec(i) for i in inputs]
    exec_outputs = [_output_spec(o, a, sizes[-1], batched)
                    for o, a in zip(outputs, out_avals, strict=True)]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        description=description,
        executable_inputs=exec_inputs,
        executable_outputs=exec_outputs,
        client_inputs=list(client_inputs) if client_inputs is not None else None,
        client_outputs=list(client_outputs) if client_outputs is not None else None,
        batching=Batching(compiled_batch_sizes=sizes if batched else []),
        provenance=provenance or {},
    )
    return _write(out_dir, manifest, modules, weight_names, weights, model_py)


def _concrete(shape: tuple[int | str, ...], n: int) -> tuple[int, ...]:
    return tuple(n if d == BATCH_LETTER else int(d) for d in shape)


def _letters(given: str | None, rank: int, batch_axis: int | None) -> str:
    if given is not None:
        if len(given) != rank:
            raise ExportError(f"letters {given!r} name {len(given)} axes, the tensor has {rank}")
        return given
    auto = iter(_AUTO_LETTERS)
    return "".join(BATCH_LETTER if i == batch_axis else next(auto) for i in range(rank))


def _input_spec(i: Input) -> TensorSpec:
    axis = i.shape.index(BATCH_LETTER) if BATCH_LETTER in i.shape else None
    letters = _letters(i.letters, len(i.shape), axis)
    dims = {ch: int(d) for ch, d in zip(letters, i.shape, strict=True) if ch != BATCH_LETTER}
    return TensorSpec(name=i.name, dtype=DType.from_numpy(np.dtype(i.dtype)).value,
                      shape=letters, dims=dims)


def _output_spec(o: Output, aval, n: int, batched: bool) -> TensorSpec:
    axis = o.batch_axis if batched else None
    if axis is not None and (axis >= len(aval.shape) or aval.shape[axis] != n):
        raise ExportError(f"output {o.name!r} has shape {list(aval.shape)}: axis {axis} is not "
                          f"the batch axis (expected extent {n})")
    letters = _letters(o.letters, len(aval.shape), axis)
    dims = {ch: int(d) for ch, d in zip(letters, aval.shape, strict=True) if ch != BATCH_LETTER}
    return TensorSpec(name=o.name, dtype=DType.from_numpy(np.dtype(aval.dtype)).value,
                      shape=letters, dims=dims)


def _portable_bytes(module_text: str) -> bytes:
    """Serialize as a StableHLO portable artifact without source locations (reproducible)."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import stablehlo

    with jax_mlir.make_ir_context():
        module = ir.Module.parse(module_text)
        text = io.StringIO()
        module.operation.print(file=text, enable_debug_info=False)
    target = stablehlo.get_version_from_compatibility_requirement(
        stablehlo.StablehloCompatibilityRequirement.WEEK_12)
    return stablehlo.serialize_portable_artifact_str(text.getvalue(), target)


def _write(out_dir: Path, manifest: Manifest, modules: dict[int, bytes],
           weight_names: list[str], weights: list[np.ndarray], model_py: str | None) -> Path:
    from safetensors.numpy import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        doc = {k: v for k, v in msgspec.to_builtins(manifest).items() if v not in (None, {}, [])}
        (staging / "manifest.yaml").write_bytes(msgspec.yaml.encode(doc))
        for n, data in modules.items():
            (staging / ("model.mlir" if n == 0 else f"model.b{n}.mlir")).write_bytes(data)
        tensors = {name: np.asarray(w, order="C")  # keeps 0-d weights 0-d
                   for name, w in zip(weight_names, weights, strict=True)}
        save_file(tensors, str(staging / "weights.safetensors"),
                  metadata={ORDER_KEY: json.dumps(weight_names)})
        if model_py is not None:
            (staging / "model.py").write_text(model_py)
        staging.chmod(0o755)  # mkdtemp creates 0700; a bundle is meant to be shared
        for file in staging.iterdir():
            file.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
