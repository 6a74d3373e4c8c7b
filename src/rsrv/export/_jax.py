"""The JAX adapter: a plain function of a parameter pytree and its inputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import keystr, tree_flatten_with_path, tree_unflatten

from rsrv.bundle import TensorSpec
from rsrv.export._parity import Parity
from rsrv.export._program import Input, Output, Program, export_program


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
    provenance: Mapping[str, Any] | None = None,
    x64: bool | None = None,
    parity: bool | Parity = True,
) -> Path:
    """Trace ``fn(params, *inputs)`` at each batch size and write the bundle to ``out_dir``.

    ``fn`` returns one array, a tuple/list of arrays, or a mapping from output names to
    arrays. Each leaf of ``params`` becomes a weight named by its tree path
    (``layers.0.w``). ``provenance`` replaces the automatic record when given (pass
    ``collect_provenance(...)`` plus your own keys to extend it). ``x64`` traces with
    ``jax_enable_x64`` on or off; None: on exactly when an input or weight is 64-bit.
    ``parity`` (default on) checks the written bundle against ``fn`` before it replaces
    ``out_dir``. Raises :class:`ExportError`, writing nothing, when a gate refuses.
    """
    paths_leaves, treedef = tree_flatten_with_path(params)
    names = [keystr(p, simple=True, separator=".") for p, _ in paths_leaves]

    def call(ws, _state, *xs):
        return fn(tree_unflatten(treedef, ws), *xs)

    source = jax.jit(fn)  # the source's own path: jax.jit with params as arguments

    def reference(*xs):
        return source(jax.tree.map(jnp.asarray, params), *map(jnp.asarray, xs))

    program = Program(call, names, [leaf for _, leaf in paths_leaves], reference)
    return export_program(
        program,
        inputs=inputs,
        outputs=outputs,
        batch_sizes=batch_sizes,
        out_dir=out_dir,
        description=description,
        client_inputs=client_inputs,
        client_outputs=client_outputs,
        model_py=model_py,
        provenance=provenance,
        x64=x64,
        parity=parity,
    )
