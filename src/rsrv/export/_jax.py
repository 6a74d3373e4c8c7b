"""The JAX adapter: a plain function of a parameter pytree and its inputs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import tree_unflatten

from rsrv.export._program import Program, export_program, flatten_weights, number_as_weight


def export_jax(fn: Callable[..., Any], params: Any, **options: Any) -> Path:
    """Trace ``fn(params, *inputs)`` at each batch size and write the bundle.

    ``fn`` returns one array, a tuple/list of arrays, or a mapping from output names to
    arrays. Each leaf of ``params`` becomes a weight named by its tree path
    (``layers.0.w``). ``options`` are :func:`export_program`'s keywords (``inputs``,
    ``outputs``, ``batch_sizes``, ``out_dir`` required; ``description``,
    ``client_inputs``, ``client_outputs``, ``model_py``, ``provenance``, ``x64``,
    ``parity``). Raises :class:`ExportError`, writing nothing, when a gate refuses.
    """
    names, leaves, treedef = flatten_weights(params)

    def call(ws, _state, *xs):
        return fn(tree_unflatten(treedef, ws), *xs)

    source = jax.jit(fn)  # the source's own path: jax.jit with params as arguments

    def reference(*xs):  # (the leaves as the weights are: a Python number typed)
        typed = tree_unflatten(treedef, [number_as_weight(leaf) for leaf in leaves])
        return source(jax.tree.map(jnp.asarray, typed), *map(jnp.asarray, xs))

    return export_program(Program(call, names, leaves, reference), **options)
