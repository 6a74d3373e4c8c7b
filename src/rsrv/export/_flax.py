"""Flax adapters: NNX modules and Linen modules with their variables (see specs/export.md).

NNX: the module is split into its graph definition and its state. Every ``nnx.Variable``
leaf except RNG state becomes a weight named by its path (``layers.0.kernel``,
``bn.mean``): ``nnx.Param`` leaves, ``nnx.BatchStat`` running statistics and any other
array variable the forward pass reads. RNG state (``nnx.RngKey`` / ``nnx.RngCount``, what
``nnx.Rngs`` and ``nnx.Dropout`` hold) is never a weight: when the forward pass does not
use it, it is dropped; when it does (dropout or sampling in training mode), it is lifted
into extra entry arguments and the arity gate refuses the export, naming it.

Linen: ``module.apply(variables, *inputs, **apply_kwargs)`` is exported with every leaf of
``variables`` as a weight named by its path including the collection
(``params.Dense_0.kernel``, ``batch_stats.BatchNorm_0.mean``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import tree_unflatten

from rsrv.export._errors import ExportError
from rsrv.export._program import Program, export_program, flatten_weights

RNG_HINT = (
    "the forward pass draws random numbers from nnx RNG state (dropout or sampling "
    "in training mode?); export the module in eval mode (eval=True, the default, "
    "calls module.eval() on a copy), or make the randomness an input"
)


def nnx_program(module: Any, *, eval: bool = True) -> Program:  # noqa: A002 - nnx's own name
    """The :class:`Program` of an NNX module called as ``module(*inputs)``."""
    from flax import nnx

    if not isinstance(module, nnx.Module):
        raise ExportError(f"export_flax_nnx needs a flax.nnx.Module, got {type(module).__name__}")
    model = nnx.clone(module)
    if eval:
        model.eval()
    graphdef, rng_state, state = nnx.split(model, nnx.RngState, ...)
    weight_names, _, weights, weights_def = _leaves(state, nnx)
    rng_names, rng_kinds, rng_leaves, rng_def = _leaves(rng_state, nnx)

    def call(ws, rng, *xs):
        m = nnx.merge(graphdef, tree_unflatten(weights_def, ws), tree_unflatten(rng_def, rng))
        return m(*xs)

    source = nnx.jit(lambda m, *xs: m(*xs))

    def reference(*xs):
        return source(nnx.clone(model), *map(jnp.asarray, xs))

    return Program(
        call,
        weight_names,
        weights,
        reference,
        framework="flax.nnx",
        packages=("flax",),
        state_names=[f"{n} (nnx.{k})" for n, k in zip(rng_names, rng_kinds, strict=True)],
        state=rng_leaves,
        state_hint=RNG_HINT,
    )


def export_flax_nnx(
    module: Any,
    *,
    out_dir: str | Path,
    eval: bool = True,  # noqa: A002
    **options: Any,
) -> Path:
    """Export an ``nnx.Module`` called as ``module(*inputs)``.

    ``eval`` (default True) exports a copy put in evaluation mode with ``.eval()``
    (Dropout deterministic, BatchNorm on running averages); the module itself is not
    changed. ``options`` are :func:`export_program`'s keywords (inputs, outputs, batch_sizes,
    description, client_inputs, client_outputs, model_py, provenance, x64, parity).
    """
    return export_program(nnx_program(module, eval=eval), out_dir=out_dir, **options)


def linen_program(
    module: Any, variables: Mapping[str, Any], apply_kwargs: Mapping[str, Any] | None = None
) -> Program:
    """The :class:`Program` of ``module.apply(variables, *inputs, **apply_kwargs)``."""
    from flax import linen

    if not isinstance(module, linen.Module):
        raise ExportError(
            f"export_flax_linen needs a flax.linen.Module, got {type(module).__name__}"
        )
    kwargs = dict(apply_kwargs or {})
    for key in ("rngs", "mutable"):
        if key in kwargs:
            raise ExportError(
                f"apply_kwargs[{key!r}]: a served module neither draws random numbers nor "
                "mutates collections; pass the deterministic / eval flag of the module "
                "instead (e.g. apply_kwargs={'train': False})"
            )
    names, leaves, treedef = flatten_weights(variables)

    def apply(v, *xs):
        from flax.errors import FlaxError

        try:
            return module.apply(v, *xs, **kwargs)
        except FlaxError as e:
            raise ExportError(
                f"{type(module).__name__}.apply failed: {e}; a served module "
                "must run without RNG streams and without mutable collections "
                "(eval / deterministic mode)"
            ) from None

    def call(ws, _state, *xs):
        return apply(tree_unflatten(treedef, ws), *xs)

    source = jax.jit(apply)

    def reference(*xs):
        return source(jax.tree.map(jnp.asarray, variables), *map(jnp.asarray, xs))

    return Program(call, names, leaves, reference, framework="flax.linen", packages=("flax",))


def export_flax_linen(
    module: Any,
    variables: Mapping[str, Any],
    *,
    out_dir: str | Path,
    apply_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Path:
    """Export ``module.apply(variables, *inputs, **apply_kwargs)``.

    Put the module in inference mode through ``apply_kwargs`` (``{"train": False}``) or its
    attributes; RNG streams and mutable collections are refused. ``options`` are
    :func:`export_program`'s keywords.
    """
    return export_program(
        linen_program(module, variables, apply_kwargs), out_dir=out_dir, **options
    )


def _leaves(state: Any, nnx: Any) -> tuple[list[str], list[str], list[Any], Any]:
    """Names (the variables' paths), variable kinds, array leaves and treedef of an
    ``nnx.State``; each variable holds exactly one leaf, its value."""
    names, variables, _ = flatten_weights(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    leaves, treedef = jax.tree.flatten(state)
    if len(variables) != len(leaves):
        raise ExportError(
            f"cannot map the module's {len(leaves)} state leaves onto its "
            f"{len(variables)} variables (a variable holding a pytree?)"
        )
    return names, [type(v).__name__ for v in variables], leaves, treedef
