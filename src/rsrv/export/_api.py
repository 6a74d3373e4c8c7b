"""One entry point for every framework, and the ``rsrv export`` command over it.

``export_model(model, params, ...)`` picks the adapter from the model's type. ``rsrv
export --module pkg.mod:factory`` calls ``factory()``, which returns an :class:`ExportSpec`
(or a dict with its fields), and passes it to ``export_model``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from rsrv.bundle import is_model_name
from rsrv.export._errors import ExportError
from rsrv.export._jax import export_jax
from rsrv.export._parity import Parity
from rsrv.export._program import Input, Output, export_program


@dataclass
class ExportSpec:
    """What an ``rsrv export`` factory returns.

    ``model`` is a JAX function (called ``model(params, *inputs)``), an ``nnx.Module``, a
    Linen module (``params`` = its variables), an ``equinox.Module`` or a
    ``torch.nn.Module``. ``options`` are further keywords of the adapter (description,
    client_inputs, client_outputs, model_py, provenance, x64, parity, apply_kwargs, vmap,
    eval, ...).
    """

    model: Any
    inputs: Sequence[Input]
    outputs: Sequence[Output | str]
    params: Any = None
    batch_sizes: Sequence[int] | None = None
    name: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


def framework_of(model: Any) -> str:
    """``flax.nnx``, ``flax.linen``, ``equinox``, ``torch`` or ``jax`` (a plain function).

    Only frameworks already imported are considered: a model of one cannot exist without it.
    """
    nnx, linen = sys.modules.get("flax.nnx"), sys.modules.get("flax.linen")
    eqx, torch = sys.modules.get("equinox"), sys.modules.get("torch")
    if nnx is not None and isinstance(model, nnx.Module):
        return "flax.nnx"
    if linen is not None and isinstance(model, linen.Module):
        return "flax.linen"
    if eqx is not None and isinstance(model, eqx.Module):
        return "equinox"
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch"
    if callable(model):
        return "jax"
    raise ExportError(
        f"cannot export a {type(model).__name__}: expected a JAX function, a Flax "
        "NNX or Linen module, an Equinox module or a torch.nn.Module"
    )


def export_model(model: Any, params: Any = None, *, out_dir: str | Path, **options: Any) -> Path:
    """Export ``model`` with the adapter for its framework (see :func:`framework_of`).

    ``params`` is the parameter pytree of a JAX function or the variables of a Linen
    module; NNX, Equinox and torch modules carry their own. ``options`` are the adapter's
    keywords: inputs, outputs, batch_sizes and export_program's others.
    """
    kind = framework_of(model)
    adapter = _adapter(kind)
    if kind == "jax":
        return adapter(model, {} if params is None else params, out_dir=out_dir, **options)
    if kind == "flax.linen":
        if params is None:
            raise ExportError(
                "a Linen module needs its variables: export_model(module, variables, ...)"
            )
        return adapter(model, params, out_dir=out_dir, **options)
    if params is not None:
        raise ExportError(f"a {kind} module carries its own parameters; pass params=None")
    return adapter(model, out_dir=out_dir, **options)


def _adapter(kind: str) -> Callable[..., Path]:
    """The export function for a :func:`framework_of` kind."""
    if kind == "jax":
        return export_jax
    if kind == "flax.linen":
        from rsrv.export._flax import export_flax_linen

        return export_flax_linen
    if kind == "flax.nnx":
        from rsrv.export._flax import export_flax_nnx

        return export_flax_nnx
    if kind == "equinox":
        from rsrv.export._equinox import export_equinox

        return export_equinox
    from rsrv.export._torch import export_torch

    return export_torch


def _option_names(adapter: Callable[..., Path]) -> set[str]:
    """The keywords ``ExportSpec.options`` may hold for ``adapter``: its own and
    export_program's, less those the spec sets itself."""
    names = {
        p.name
        for fn in (adapter, export_program)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    return names - {"out_dir", "inputs", "outputs", "batch_sizes"}


def export_spec(
    spec: ExportSpec | Mapping[str, Any],
    out_dir: str | Path,
    *,
    batch_sizes: Sequence[int] | None = None,
    **overrides: Any,
) -> Path:
    """Export what a factory returned into ``out_dir`` (the bundle directory)."""
    if isinstance(spec, Mapping):
        known = {f.name for f in fields(ExportSpec)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ExportError(
                f"the factory's dict has unknown key(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        missing = [
            f.name
            for f in fields(ExportSpec)
            if f.default is MISSING and f.default_factory is MISSING and f.name not in spec
        ]
        if missing:
            raise ExportError(f"the factory's dict has no {', '.join(missing)}")
        spec = ExportSpec(**spec)
    elif not isinstance(spec, ExportSpec):
        raise ExportError(
            f"the factory must return an ExportSpec or a dict, got {type(spec).__name__}"
        )
    sizes = batch_sizes if batch_sizes is not None else spec.batch_sizes
    if sizes is None:
        sizes = [1]  # unbatched models ignore it; batched ones need --batch-sizes
        if any("n" in i.shape for i in spec.inputs):
            raise ExportError("no batch sizes: pass --batch-sizes or set ExportSpec.batch_sizes")
    kind = framework_of(spec.model)
    known = _option_names(_adapter(kind))
    unknown = sorted(set(spec.options) - known)
    if unknown:
        raise ExportError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for a {kind} model "
            f"(known: {', '.join(sorted(known))})"
        )
    options = {**spec.options, **overrides}
    return export_model(
        spec.model,
        spec.params,
        inputs=spec.inputs,
        outputs=spec.outputs,
        batch_sizes=list(sizes),
        out_dir=out_dir,
        **options,
    )


def load_factory(target: str):
    """``pkg.mod:factory`` or ``path/to/file.py:factory`` -> the callable."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ExportError(f"--module {target!r}: expected MODULE:FACTORY, e.g. models.mlp:make")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name).resolve()
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or not path.is_file():
            raise ExportError(f"--module {target!r}: no file {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # like `python -m`: the project's modules
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ExportError(f"--module {target!r}: {module_name} has no callable {attr!r}")
    return factory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--module",
        required=True,
        metavar="MODULE:FACTORY",
        help="factory returning an ExportSpec (or a dict with its fields); "
        "MODULE is a dotted module name or a path to a .py file",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="REPO",
        help="model repository: the bundle is written to REPO/NAME",
    )
    parser.add_argument(
        "--batch-sizes",
        metavar="N,N,...",
        help="compiled batch sizes, e.g. 1,4,8 (default: the spec's)",
    )
    parser.add_argument(
        "--name", help="model name (default: the spec's name, else the factory's name)"
    )
    parser.add_argument(
        "--no-parity", action="store_true", help="skip the parity gate (not recommended)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="keep the parity gate's executables in this compilation cache "
        "(a node's cache_dir), so a worker using it need not compile",
    )
    parser.add_argument(
        "--x64",
        choices=("auto", "on", "off"),
        default="auto",
        help="trace with jax_enable_x64 on/off (auto: on iff an input or weight is 64-bit)",
    )


def export_main(args: argparse.Namespace) -> int:
    """``rsrv export``: returns the exit status (0 ok, 1 refused by a gate, 2 bad usage)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("rsrv.export")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        try:
            sizes = (
                [int(s) for s in args.batch_sizes.split(",") if s.strip()]
                if args.batch_sizes
                else None
            )
        except ValueError:
            print(
                f"rsrv export: --batch-sizes {args.batch_sizes!r}: expected integers "
                "separated by commas",
                file=sys.stderr,
            )
            return 2
        if args.no_parity and args.cache_dir is not None:
            print(
                "rsrv export: --cache-dir keeps the parity gate's executables, and "
                "--no-parity skips the gate: give one of them",
                file=sys.stderr,
            )
            return 2
        try:
            factory = load_factory(args.module)
        except (ExportError, ImportError) as e:
            print(f"rsrv export: {e}", file=sys.stderr)
            return 2
        spec = factory()
        name = (
            args.name
            or (spec.get("name") if isinstance(spec, Mapping) else getattr(spec, "name", None))
            or factory.__name__
        )
        if not isinstance(name, str) or not _is_bundle_name(name):
            print(
                f"rsrv export: model name {name!r} cannot name a bundle of {args.out}: "
                "it must be one path component, not starting with '.' (a repository "
                "scan passes over hidden entries)",
                file=sys.stderr,
            )
            return 2
        overrides: dict[str, Any] = {}
        if args.no_parity:
            overrides["parity"] = False
        elif args.cache_dir is not None:
            overrides["parity"] = Parity(cache_dir=args.cache_dir)
        if args.x64 != "auto":
            overrides["x64"] = args.x64 == "on"
        try:
            out = export_spec(spec, args.out / name, batch_sizes=sizes, **overrides)
        except ExportError as e:
            print(f"rsrv export: {name}: {e}", file=sys.stderr)
            return 1
        print(f"wrote {out}")
        return 0
    finally:
        log.removeHandler(handler)


def _is_bundle_name(name: str) -> bool:
    """Whether ``REPO/name`` is a model directory a repository scan finds."""
    return (
        bool(name)
        and not name.startswith(".")
        and "/" not in name
        and os.sep not in name
        and "\0" not in name
        and is_model_name(name)
    )
