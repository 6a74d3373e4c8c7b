"""PyTorch adapter: ``torch.export`` -> torchax -> JAX -> bundle (see specs/export.md).

The module (in eval mode) is exported with ``torch.export.export`` once per compiled
batch size, on example tensors of that size; torchax turns each exported program into a
JAX function of ``(weights, inputs)``. The weights are the program's parameters, buffers
and lifted constants, named by their state-dict keys (``fc.weight``, ``bn.running_mean``),
in the order the decomposed program takes them. A program that mutates buffers (BatchNorm in
training mode) is refused.

torchax is an optional dependency (``pip install 'rsrv[torch]'``), and its releases track
particular torch releases: :func:`torch_unavailable_reason` says why the path cannot run
here (naming the versions known to work), and every entry point raises
:class:`ExportError` with that reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from rsrv.export._errors import ExportError
from rsrv.export._program import Input, Program, compiled_sizes, export_program

# What the torch extra installs (pyproject.toml) and what was seen to work (specs/export.md
# §7). torchax 0.0.13 and older do not import with torch >= 2.13, which removed the
# named-tensor overloads they register; nightlies before 0.0.14.dev20260912 do not import
# with torch 2.14, which removed aten.qr.
TORCHAX_REQUIREMENT = "torchax>=0.0.14.dev20260912"
TORCH_REQUIREMENT = "torch>=2.13,<2.15"
WORKING = "torch 2.13.0 or 2.14.1 with torchax 0.0.14.dev20260912 or 0.0.14.dev20261026"
INSTALL = (
    "install a CPU build of torch first (PyPI's default is the CUDA one, ~5 GB), then "
    f"a working pair with pip install -e '.[torch]' ({TORCH_REQUIREMENT}, "
    f"{TORCHAX_REQUIREMENT}); known to work: {WORKING} (specs/export.md §8)"
)

_status: tuple[Any, str | None] | None = None  # (torchax.export module or None, reason)


def torch_unavailable_reason() -> str | None:
    """None when torch and torchax import and work together; otherwise why not."""
    return _load()[1]


def _load() -> tuple[Any, str | None]:
    global _status
    if _status is None:
        _status = _import_torchax()
    return _status


def _import_torchax() -> tuple[Any, str | None]:
    try:
        import torch
    except ImportError as e:
        return None, f"torch is not installed ({e}); {INSTALL}"
    try:
        version = metadata.version("torchax")
    except metadata.PackageNotFoundError:
        return None, f"torchax is not installed; {INSTALL}"
    try:
        import torchax
        import torchax.export as torchax_export

        torchax.default_env()  # registers the aten -> jax lowerings the interpreter uses
    except Exception as e:  # noqa: BLE001 - any import failure is an incompatibility
        return None, (
            f"torchax {version} does not work with torch {torch.__version__}: "
            f"{type(e).__name__}: {e}; {INSTALL}"
        )
    return torchax_export, None


@contextmanager
def _without_pytree_deprecations() -> Iterator[None]:
    """Hide one FutureWarning of torch's own that the user cannot act on.

    ``ExportedProgram.run_decompositions`` (run twice per program, see :func:`_to_jax`)
    deep-copies the module call graph, and every copied ``LeafSpec`` warns that
    ``isinstance(treespec, LeafSpec)`` is deprecated: six identical warnings for an export
    at three batch sizes (torch 2.13, 2.14). Only that message is ignored, and only while
    the program is exported and converted.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
            category=FutureWarning,
        )
        yield


def torch_program(module: Any, inputs: list[Input], sizes: list[int]) -> Program:
    """The :class:`Program` of ``module(*inputs)``, exported at each batch size.
    Raises ExportError with :func:`torch_unavailable_reason`'s reason first."""
    torchax_export, reason = _load()
    if reason is not None:
        raise ExportError(reason)
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"export_torch needs a torch.nn.Module, got {type(module).__name__}")
    was_training = module.training
    module.eval()
    try:
        functions, names, weights = {}, None, None
        for n in sizes:
            example = tuple(
                torch.from_numpy(np.zeros(i.concrete(n), np.dtype(i.dtype))) for i in inputs
            )
            try:
                with _without_pytree_deprecations():
                    program = torch.export.export(module, example)
            except Exception as e:  # noqa: BLE001 - torch.export's many failure types
                raise ExportError(
                    f"torch.export failed at batch size {n}: {type(e).__name__}: {e}"
                ) from None
            mutated = dict(program.graph_signature.buffers_to_mutate)
            if mutated:
                raise ExportError(
                    f"the program mutates buffer(s) {', '.join(sorted(mutated.values()))} "
                    "(BatchNorm in training mode?); a served module must not change state"
                )
            keys, states, fn = _to_jax(torchax_export, program, len(example))
            if names is None:
                names, weights = keys, [_numpy(s) for s in states]
            elif keys != names:
                raise ExportError(
                    f"the program's weights at batch size {n} differ from those "
                    f"at batch size {sizes[0]}"
                )
            functions[n] = fn
    finally:
        module.train(was_training)
    axis = next((k for k, i in enumerate(inputs) if i.batch_axis is not None), None)

    def call(ws, _state, *xs):
        n = xs[axis].shape[inputs[axis].batch_axis] if axis is not None else 0
        return tuple(functions[n](list(ws), xs))

    def reference(*xs):
        with torch.no_grad():
            was = module.training
            module.eval()
            try:
                result = module(*(torch.from_numpy(np.ascontiguousarray(x)) for x in xs))
            finally:
                module.train(was)
        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, dict):
            return {k: v.detach().cpu().numpy() for k, v in result.items()}
        return [r.detach().cpu().numpy() for r in result]

    return Program(
        call, names, weights, reference, framework="torch", packages=("torch", "torchax")
    )


def _to_jax(torchax_export: Any, program: Any, n_inputs: int) -> tuple[list[str], list, Any]:
    """The weights' names and values and a JAX function ``fn(weights, inputs)`` of a program.

    What torchax's ``exported_program_to_jax`` does (torch's default decompositions, then
    torchax's, then its ``JaxInterpreter`` on the graph), except that the weights are taken
    in the order of the decomposed program's own signature. torchax lists parameters,
    buffers, then lifted constants, but the decompositions move lifted constants (tensors
    held as plain attributes) before the buffers, so its order would feed a constant where
    a buffer is expected (torch 2.13/2.14, torchax 0.0.14 nightlies).
    """
    from torch.export.graph_signature import InputKind
    from torchax import decompositions

    with _without_pytree_deprecations():
        program = program.run_decompositions().run_decompositions(decompositions.DECOMPOSITIONS)
    signature = program.graph_signature
    specs = signature.input_specs
    state = {**program.state_dict, **program.constants}
    weights = [s for s in specs if s.kind != InputKind.USER_INPUT]
    users = [s for s in specs if s.kind == InputKind.USER_INPUT]
    unknown = [s.arg.name for s in weights if s.target not in state]
    if unknown or len(users) != n_inputs or weights != specs[: len(weights)]:
        raise ExportError(
            "cannot map the exported program's arguments to weights and inputs: "
            + ", ".join(f"{s.kind.name.lower()} {s.arg.name}" for s in specs)
        )
    mutations = len(signature.buffers_to_mutate)
    graph = program.graph_module

    def fn(ws, xs):
        outputs = torchax_export.JaxInterpreter(graph).run(*ws, *xs, enable_io_processing=False)
        return outputs[mutations:]

    return [s.target for s in weights], [state[s.target] for s in weights], fn


def export_torch(
    module: Any, *, inputs, outputs, batch_sizes, out_dir: str | Path, **options: Any
) -> Path:
    """Export a ``torch.nn.Module`` called as ``module(*inputs)`` (run in eval mode).

    The example tensors ``torch.export`` traces with are built from ``inputs`` at each
    compiled batch size. ``options`` are :func:`export_program`'s keywords (description, ...,
    x64, parity). Raises :class:`ExportError` when torchax cannot run with this torch.
    """
    inputs = list(inputs)
    program = torch_program(module, inputs, compiled_sizes(inputs, batch_sizes))
    return export_program(
        program, inputs=inputs, outputs=outputs, batch_sizes=batch_sizes, out_dir=out_dir, **options
    )


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)
