"""Equinox adapter (see specs/export.md).

``eqx.partition(model, eqx.is_array)`` splits the model: every array leaf is a weight named
by its path (``layers.0.weight``), the rest (activation functions, sizes, flags) is static
and closed over. Equinox layers take one example, not a batch, so by default the model is
mapped over the batch axis with ``jax.vmap``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import tree_unflatten

from rsrv.export._errors import ExportError
from rsrv.export._program import (
    Input,
    Output,
    Program,
    as_outputs,
    export_program,
    flatten_weights,
)


def equinox_program(
    model: Any,
    inputs: list[Input],
    outputs: list[Output | str],
    *,
    vmap: bool = True,
    inference: bool = True,
) -> Program:
    """The :class:`Program` of an Equinox model called as ``model(*inputs)``."""
    import equinox as eqx

    if not isinstance(model, eqx.Module):
        raise ExportError(f"export_equinox needs an equinox.Module, got {type(model).__name__}")
    paths, leaves, _ = flatten_weights(model, is_leaf=lambda x: isinstance(x, eqx.nn.StateIndex))
    stateful = [
        p for p, leaf in zip(paths, leaves, strict=True) if isinstance(leaf, eqx.nn.StateIndex)
    ]
    if stateful:
        raise ExportError(
            f"the model holds eqx.nn.StateIndex at {', '.join(stateful)} (a stateful layer "
            "such as BatchNorm, called as model(x, state)); export_equinox calls model(*inputs): "
            "export it with export_jax and a function that passes the eqx.nn.State"
        )
    if inference:
        model = eqx.nn.inference_mode(model)
    params, static = eqx.partition(model, eqx.is_array)
    names, leaves, treedef = flatten_weights(params)
    named = [o if isinstance(o, Output) else Output(o) for o in outputs]
    in_axes = tuple(i.batch_axis for i in inputs)
    out_axes = tuple(o.batch_axis for o in named)
    batched = vmap and any(a is not None for a in in_axes)

    def one(m, *xs):  # (a tuple in output order, whatever the model returns: vmap's axes)
        return as_outputs(m(*xs), named)

    def run(m, *xs):
        if not batched:
            return m(*xs)
        return jax.vmap(functools.partial(one, m), in_axes=in_axes, out_axes=out_axes)(*xs)

    def call(ws, _state, *xs):
        return run(eqx.combine(tree_unflatten(treedef, ws), static), *xs)

    source = eqx.filter_jit(run)

    def reference(*xs):
        return source(model, *map(jnp.asarray, xs))

    return Program(call, names, leaves, reference, framework="equinox", packages=("equinox",))


def export_equinox(
    model: Any,
    *,
    inputs,
    outputs,
    out_dir: str | Path,
    vmap: bool = True,
    inference: bool = True,
    **options: Any,
) -> Path:
    """Export an ``equinox.Module`` called as ``model(*inputs)``.

    ``vmap`` (default True) maps the model over each input's batch axis (Equinox layers take
    one example); pass False for a model that takes the whole batch. ``inference``
    (default True) exports ``eqx.nn.inference_mode(model)`` (Dropout off). ``options`` are
    :func:`export_program`'s keywords (batch_sizes, description, ..., x64, parity).
    """
    inputs, outputs = list(inputs), list(outputs)
    program = equinox_program(model, inputs, outputs, vmap=vmap, inference=inference)
    return export_program(program, inputs=inputs, outputs=outputs, out_dir=out_dir, **options)
