"""Load one bundle directory into a validated :class:`Bundle`, without compiling it.

Everything that can be checked from files is checked here, so a broken bundle fails with
a message naming its file and field: the manifest, the module files for each compiled
batch size, each module's entry signature against inputs + weights, the weights header and
its ``argument_order``, and the ``model.py`` hooks against the manifest's tensor names.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import sys
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

from rsrv.bundle._dsl import Hook
from rsrv.bundle._manifest import (
    MANIFEST_NAMES,
    Manifest,
    Signature,
    Tensor,
    decode_manifest,
    resolve_manifest,
)
from rsrv.bundle._safetensors import WeightsFile, read_weights_header
from rsrv.bundle._stablehlo import ArgType, ModuleSignature, read_module, read_signature
from rsrv.errors import BundleError

UNBATCHED = 0  # module key of a model without a batch axis
_MODULE_RE = re.compile(r"model(?:\.b([1-9][0-9]*))?\.mlir")  # (no b01 beside b1)
_MODULE_LIKE = re.compile(r"model\.b.*\.mlir")  # (b01, b0, bx: refused, not ignored)
_IDENT = re.compile(r"\W")
_import_counter = itertools.count()


def defines_bundle(name: str) -> bool:
    """Whether a file of this name defines a bundle besides its manifest: a module
    (``model.mlir``, ``model.b<N>.mlir``), ``weights.safetensors`` or ``model.py``."""
    return name in ("weights.safetensors", "model.py") or _MODULE_RE.fullmatch(name) is not None


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Hooks:
    """A bundle's model.py hooks; the module they come from is in ``sys.modules`` (under a
    name of its own per load) for as long as they are alive."""

    preprocess: Hook | None = None
    postprocess: Hook | None = None
    meta: Hook | None = None


@dataclass(frozen=True, slots=True)
class Bundle:
    """A validated bundle. ``modules`` maps each batch size (0 = unbatched) to its file,
    ``module_signatures`` to that module's entry signature (read once, at validation)."""

    name: str
    path: Path
    manifest_path: Path
    manifest: Manifest
    signature: Signature
    modules: dict[int, Path]
    weights: WeightsFile | None
    hooks: Hooks
    module_signatures: dict[int, ModuleSignature]

    @property
    def kind(self) -> str:
        return self.signature.kind

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Compiled batch sizes, ascending; empty for an unbatched model or a meta."""
        return tuple(sorted(n for n in self.modules if n != UNBATCHED))

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes if self.weights else 0


def regular_file(file: Path) -> bool:
    """Whether ``file`` is a regular file (symbolic links followed): True; False when
    nothing is there. BundleError for anything else in its place, which would otherwise
    be taken for no file at all (a dangling or looping symbolic link, a directory) or
    hang its reader (a FIFO)."""
    if file.is_file():
        return True
    if not os.path.lexists(file):
        return False
    if file.is_symlink():
        what = "a symbolic link that does not lead to a file"
    else:
        what = "a directory" if file.is_dir() else "not a regular file"
    raise BundleError(f"{file}: {what}")


def find_manifest(path: Path) -> Path | None:
    found = [path / n for n in MANIFEST_NAMES if regular_file(path / n)]
    if len(found) > 1:
        raise BundleError(f"{path}: more than one manifest ({', '.join(p.name for p in found)})")
    return found[0] if found else None


def load_bundle(path: Path, name: str | None = None) -> Bundle:
    """Validate the bundle at ``path``. ``name`` is the model name: by default the
    directory's name (a version directory ``<repo>/<model>/<N>`` passes its model's)."""
    path = Path(path)
    name = path.name if name is None else name
    manifest_path = find_manifest(path)
    if manifest_path is None:
        raise BundleError(f"{path}: no manifest ({' or '.join(MANIFEST_NAMES)})")
    manifest = decode_manifest(manifest_path)
    sig = resolve_manifest(manifest, manifest_path, name)

    model_py = path / "model.py"
    has_py = regular_file(model_py)
    for field, given in (
        ("client_inputs", manifest.client_inputs),
        ("client_outputs", manifest.client_outputs),
    ):
        if given is not None and sig.kind == "model" and not has_py:
            raise BundleError(
                f"{manifest_path}: {field}: only valid when model.py transforms "
                f"I/O, and {name} has no model.py"
            )
    if sig.kind == "meta" and not has_py:
        raise BundleError(
            f"{manifest_path}: kind: a meta bundle needs a model.py declaring "
            f"@rsrv.meta, and {name} has no model.py"
        )
    if sig.kind == "meta":
        stray = sorted(
            f.name
            for f in path.iterdir()
            if f.name == "weights.safetensors" or _MODULE_RE.fullmatch(f.name)
        )
        if stray:
            raise BundleError(
                f"{path / stray[0]}: a meta bundle has no modules and no weights file "
                "(it calls other models); remove it"
            )
        hooks = _load_hooks(model_py, sig, name) if has_py else Hooks()
        return Bundle(name, path, manifest_path, manifest, sig, {}, None, hooks, {})

    weights_path = path / "weights.safetensors"
    if not regular_file(weights_path):
        raise BundleError(f"{weights_path}: missing (every model bundle has a weights file)")
    try:
        weights = read_weights_header(weights_path)
    except (ValueError, KeyError, OSError) as e:
        raise BundleError(f"{weights_path}: {e}") from None

    modules = _discover_modules(path, sig, manifest_path)
    checked, signatures = {}, {}
    for size, file in modules.items():
        size, signatures[size] = _check_module(file, size, sig, weights)
        checked[size] = file
    sig = _with_module_extents(sig, manifest, signatures, path)
    if has_py:
        hooks = _load_hooks(model_py, sig, name)
        sig = _passthrough_narrowed(sig, hooks)
    else:
        hooks = Hooks()
    return Bundle(name, path, manifest_path, manifest, sig, checked, weights, hooks, signatures)


def _passthrough_narrowed(sig: Signature, hooks: Hooks) -> Signature:
    """``sig`` with each client tensor that passes through model.py unchanged given the
    fixed extents of the executable tensor it is, where it declares a variable one: a
    request is then checked at decoding against what the module takes."""

    def narrowed(tensors, others, made) -> tuple[Tensor, ...]:
        out = []
        for t in tensors:
            other = others.get(t.name)
            if other is not None and t.name not in made:
                shape = tuple(
                    e if d == -1 else d for d, e in zip(t.shape, other.shape, strict=True)
                )
                t = replace(t, shape=shape)
            out.append(t)
        return tuple(out)

    made_in = hooks.preprocess.outputs if hooks.preprocess else ()
    made_out = hooks.postprocess.outputs if hooks.postprocess else ()
    return replace(
        sig,
        client_inputs=narrowed(
            sig.client_inputs, {t.name: t for t in sig.executable_inputs}, made_in
        ),
        client_outputs=narrowed(
            sig.client_outputs, {t.name: t for t in sig.executable_outputs}, made_out
        ),
    )


def _with_module_extents(
    sig: Signature, manifest: Manifest, signatures: dict[int, ModuleSignature], path: Path
) -> Signature:
    """``sig`` with each variable (-1) extent of an executable tensor replaced by the
    static extent its modules declare (a module takes one shape: a request of any other
    extent is refused at decoding, not failed by the runtime). Client lists that default
    to the executable ones follow. BundleError when two modules disagree."""

    def resolve(tensors: tuple[Tensor, ...], args_of) -> tuple[Tensor, ...]:
        out = []
        for i, t in enumerate(tensors):
            shape = list(t.shape)
            for axis, d in enumerate(t.shape):
                if d != -1 or axis == t.batch_axis:
                    continue
                extents = sorted({args_of(m)[i].shape[axis] for m in signatures.values()})
                if len(extents) > 1:
                    raise BundleError(
                        f"{path}: {t.name!r} axis {axis} ({t.letters[axis]!r}: -1) is "
                        f"{' in one module, '.join(map(str, extents))} in another: a "
                        "variable extent must be the same in every module"
                    )
                shape[axis] = extents[0]  # (-1 still when the module's extent is dynamic)
            out.append(replace(t, shape=tuple(shape)))
        return tuple(out)

    n_in = len(sig.executable_inputs)
    inputs = resolve(sig.executable_inputs, lambda m: m.inputs[:n_in])
    outputs = resolve(sig.executable_outputs, lambda m: m.outputs)
    return replace(
        sig,
        executable_inputs=inputs,
        executable_outputs=outputs,
        client_inputs=sig.client_inputs if manifest.client_inputs else inputs,
        client_outputs=sig.client_outputs if manifest.client_outputs else outputs,
    )


def _discover_modules(path: Path, sig: Signature, manifest_path: Path) -> dict[int, Path]:
    present: dict[int | None, Path] = {}
    for file in path.iterdir():
        m = _MODULE_RE.fullmatch(file.name)
        if m:
            regular_file(file)  # (raises for anything else)
            present[int(m.group(1)) if m.group(1) else None] = file
        elif _MODULE_LIKE.fullmatch(file.name):
            raise BundleError(
                f"{file}: not a module name: model.b<N>.mlir takes a batch size N from 1, "
                "without leading zeros"
            )
    declared = sig.compiled_batch_sizes
    if not declared:
        extra = sorted(k for k in present if k is not None)
        if extra:
            raise BundleError(
                f"{path / f'model.b{extra[0]}.mlir'}: batch size {extra[0]} is "
                f"not in {manifest_path.name} batching.compiled_batch_sizes"
            )
        if None not in present:
            raise BundleError(
                f"{path}: no module (expected model.mlir, or model.b<N>.mlir "
                "for each batching.compiled_batch_sizes entry)"
            )
        return {UNBATCHED: present[None]}  # a batched model.mlir is re-keyed by its batch size
    if None in present:
        raise BundleError(
            f"{present[None]}: ambiguous next to batching.compiled_batch_sizes "
            f"{list(declared)}; use only model.b<N>.mlir files"
        )
    for n in declared:
        if n not in present:
            raise BundleError(
                f"{path / f'model.b{n}.mlir'}: missing (declared by "
                f"{manifest_path.name} batching.compiled_batch_sizes)"
            )
    for n in sorted(k for k in present if k not in declared):
        raise BundleError(
            f"{present[n]}: batch size {n} is not in {manifest_path.name} "
            "batching.compiled_batch_sizes"
        )
    return {n: present[n] for n in declared}


def _check_module(
    file: Path, size: int, sig: Signature, weights: WeightsFile
) -> tuple[int, ModuleSignature]:
    """Check the module's entry signature; return its batch size key and the signature."""
    try:
        msig = read_signature(read_module(file))
    except (ValueError, OSError) as e:
        raise BundleError(f"{file}: {e}") from None
    inputs, outputs = sig.executable_inputs, sig.executable_outputs
    expected = len(inputs) + len(weights.weights)
    if len(msig.inputs) != expected:
        raise BundleError(
            f"{file}: main takes {len(msig.inputs)} arguments, expected {expected} "
            f"({len(inputs)} executable_inputs + {len(weights.weights)} weights in argument_order)"
        )
    if size == UNBATCHED and sig.batched:
        # A single model.mlir of a batched model: its batch size is the compiled extent.
        first, shape = inputs[0], msig.inputs[0].shape
        size = shape[first.batch_axis] if len(shape) > first.batch_axis else -1
        if size < 1:
            raise BundleError(f"{file}: argument 0 ({first.name!r}) has no static batch extent")
    for i, (arg, t) in enumerate(zip(msig.inputs, inputs, strict=False)):
        _match(file, f"argument {i} ({t.name!r})", arg, t.dtype, _expect(t, size))
    for j, (arg, w) in enumerate(zip(msig.inputs[len(inputs) :], weights.weights, strict=True)):
        _match(file, f"argument {len(inputs) + j} (weight {w.name!r})", arg, w.dtype, w.shape)
    if len(msig.outputs) != len(outputs):
        raise BundleError(
            f"{file}: main returns {len(msig.outputs)} results, expected "
            f"{len(outputs)} (executable_outputs)"
        )
    for k, (arg, t) in enumerate(zip(msig.outputs, outputs, strict=True)):
        _match(file, f"result {k} ({t.name!r})", arg, t.dtype, _expect(t, size))
    return size, msig


def _expect(t: Tensor, size: int) -> tuple[int, ...]:
    """The manifest's shape at batch ``size``; -1 (variable) matches any extent."""
    return tuple(size if i == t.batch_axis else d for i, d in enumerate(t.shape))


def _match(file: Path, what: str, arg: ArgType, dtype, shape: tuple[int, ...]) -> None:
    if arg.dtype is not dtype:
        raise BundleError(f"{file}: {what} has dtype {arg.dtype.value}, expected {dtype.value}")
    ok = len(arg.shape) == len(shape) and all(
        e in (-1, a) for a, e in zip(arg.shape, shape, strict=True)
    )
    if not ok:
        raise BundleError(
            f"{file}: {what} has shape {list(arg.shape)}, expected "
            f"{['?' if e == -1 else e for e in shape]}"
        )


def _load_hooks(model_py: Path, sig: Signature, name: str) -> Hooks:
    module_name = f"rsrv_bundle_{_IDENT.sub('_', name)}_{next(_import_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, model_py)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        # Compile the source ourselves: the loader would write __pycache__ into the bundle.
        code = compile(model_py.read_bytes(), str(model_py), "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except BaseException as e:  # noqa: BLE001 - any failure in user code is a bundle error
        sys.modules.pop(module_name, None)
        raise BundleError(f"{model_py}: failed to import: {type(e).__name__}: {e}") from None

    found: dict[str, Hook] = {}
    for value in vars(module).values():
        if isinstance(value, Hook):
            if value.kind in found and found[value.kind] is not value:
                _forget_module(module_name)
                raise BundleError(f"{model_py}: declares more than one @rsrv.{value.kind} hook")
            found[value.kind] = value
    hooks = Hooks(**found)
    # The module goes with its load's hooks (a retired version, a load that fails after
    # this): each reload kept the last one's globals, a large table 80 MB each.
    weakref.finalize(hooks, _forget_module, module_name)
    _check_hooks(model_py, hooks, sig)
    return hooks


def _forget_module(name: str) -> None:
    """Out of sys.modules, and its globals dropped at once: its functions and their
    globals refer to each other, which only a full garbage collection would undo (a
    serving worker seldom runs one, and never over what start-up built: gc.freeze)."""
    module = sys.modules.pop(name, None)
    if module is not None:
        module.__dict__.clear()


def _check_hooks(model_py: Path, hooks: Hooks, sig: Signature) -> None:
    def names(ts: tuple[Tensor, ...]) -> dict[str, Tensor]:
        return {t.name: t for t in ts}

    def unknown(hook: Hook, arg: str, listed: tuple[str, ...], allowed: dict, what: str):
        for n in listed:
            if n not in allowed:
                raise BundleError(
                    f"{model_py}: @rsrv.{hook.kind} {hook.fn.__name__!r} {arg} "
                    f"names {n!r}, which is not one of the {what} "
                    f"({', '.join(allowed) or 'none'})"
                )

    client_in, client_out = names(sig.client_inputs), names(sig.client_outputs)
    if sig.kind == "meta":
        if hooks.meta is None:
            raise BundleError(f"{model_py}: a meta bundle must declare an @rsrv.meta hook")
        if hooks.preprocess or hooks.postprocess:
            raise BundleError(f"{model_py}: a meta bundle declares only @rsrv.meta")
        unknown(hooks.meta, "inputs", hooks.meta.inputs, client_in, "client_inputs")
        unknown(hooks.meta, "outputs", hooks.meta.outputs, client_out, "client_outputs")
        missing = [n for n in client_out if n not in hooks.meta.outputs]
        if missing:
            raise BundleError(
                f"{model_py}: @rsrv.meta does not produce client output(s) {', '.join(missing)}"
            )
        return
    if hooks.meta:
        raise BundleError(f"{model_py}: @rsrv.meta is only valid in a meta bundle (kind: meta)")
    exec_in, exec_out = names(sig.executable_inputs), names(sig.executable_outputs)
    made: tuple[str, ...] = ()
    if hooks.preprocess:
        unknown(hooks.preprocess, "inputs", hooks.preprocess.inputs, client_in, "client_inputs")
        unknown(hooks.preprocess, "outputs", hooks.preprocess.outputs, exec_in, "executable_inputs")
        made = hooks.preprocess.outputs
    _check_passthrough(model_py, "executable input", exec_in, made, client_in, "preprocess")
    made = ()
    if hooks.postprocess:
        unknown(
            hooks.postprocess, "inputs", hooks.postprocess.inputs, exec_out, "executable_outputs"
        )
        unknown(
            hooks.postprocess, "outputs", hooks.postprocess.outputs, client_out, "client_outputs"
        )
        made = hooks.postprocess.outputs
    _check_passthrough(model_py, "client output", client_out, made, exec_out, "postprocess")


def _check_passthrough(
    model_py: Path,
    what: str,
    needed: dict[str, Tensor],
    made: tuple[str, ...],
    source: dict[str, Tensor],
    hook: str,
) -> None:
    """Tensors a hook does not produce pass through by name, with the same dtype."""
    for name, t in needed.items():
        if name in made:
            continue
        src = source.get(name)
        if src is None:
            raise BundleError(
                f"{model_py}: {what} {name!r} is neither produced by @rsrv.{hook} "
                "nor passed through under the same name"
            )
        if src.dtype is not t.dtype:
            raise BundleError(
                f"{model_py}: {what} {name!r} passes through unchanged but its "
                f"dtype differs ({src.dtype.value} vs {t.dtype.value})"
            )
        fits = src.batch_axis == t.batch_axis and src.rank == t.rank
        fits = fits and all(-1 in (d, e) or d == e for e, d in zip(src.shape, t.shape, strict=True))
        if not fits:  # (the same batch axis, and no two fixed extents that differ)
            raise BundleError(
                f"{model_py}: {what} {name!r} passes through unchanged but its shape "
                f"differs ({src.describe()} vs {t.describe()}): give it the same batch "
                "axis and the extents the other fixes"
            )
