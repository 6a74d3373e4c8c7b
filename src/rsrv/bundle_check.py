"""``rsrv bundle check``: validate bundles, compile every module, print a summary."""

from __future__ import annotations

import sys
from pathlib import Path

from rsrv.bundle import Bundle, discover, find_manifest, load_bundle, model_versions
from rsrv.errors import BundleError
from rsrv.runtime import Compiler, compile_bundle, configure


def check_main(dirs: list[Path], out=sys.stdout) -> int:
    """Check each bundle (a directory with a manifest, each version of a model directory,
    or each of those in a repository)."""
    configure("cpu")
    compiler = Compiler()
    paths = _expand(dirs)
    failures = 0
    for path, name in paths:
        label = f"{name} version {path.name}" if isinstance(name, str) else path.name
        try:
            if isinstance(name, BundleError):
                raise name
            bundle = load_bundle(path, name)
            seconds = compile_bundle(bundle, compiler).compile_seconds if bundle.modules else 0.0
        except BundleError as e:
            failures += 1
            print(f"FAIL {label}\n  {e}\n", file=out)
            continue
        except Exception as e:  # a module that validates but does not compile
            failures += 1
            print(f"FAIL {label}\n  {path}: compilation failed: {e}\n", file=out)
            continue
        print(summary(bundle, seconds), file=out)
    print(f"{len(paths) - failures} ok, {failures} failed", file=out)
    return 1 if failures else 0


def summary(bundle: Bundle, compile_seconds: float) -> str:
    sig = bundle.signature
    lines = [f"OK   {bundle.name} ({bundle.kind})  {bundle.path}"]
    if bundle.manifest.description:
        lines.append(f"  {bundle.manifest.description}")
    lines.append(f"  inputs:  {', '.join(t.describe() for t in sig.client_inputs)}")
    lines.append(f"  outputs: {', '.join(t.describe() for t in sig.client_outputs)}")
    if bundle.kind == "meta":
        lines.append(f"  calls:   {', '.join(sig.calls) or '(none)'}")
    else:
        sizes = ", ".join(map(str, bundle.batch_sizes)) or "unbatched"
        lines.append(f"  batch sizes: {sizes}  (compiled in {compile_seconds:.2f} s)")
        n = len(bundle.weights.weights) if bundle.weights else 0
        lines.append(f"  weights: {n} tensors, {_bytes(bundle.weight_bytes)}")
    hooks = [
        f"{k} {h.fn.__name__}"
        for k in ("preprocess", "postprocess", "meta")
        if (h := getattr(bundle.hooks, k))
    ]
    if hooks:
        lines.append(f"  model.py: {', '.join(hooks)}")
    return "\n".join(lines) + "\n"


def _expand(dirs: list[Path]) -> list[tuple[Path, str | None | BundleError]]:
    """(bundle directory, its model's name or None for the directory's own, or the
    error of a model directory whose layout is wrong)."""
    out: list[tuple[Path, str | None | BundleError]] = []
    for d in dirs:
        if not d.exists():  # (a typo in a CI job's path must not pass as nothing to check)
            out.append((d, BundleError(f"{d}: no such file or directory")))
            continue
        try:
            is_bundle = find_manifest(d) is not None
        except BundleError:
            is_bundle = True
        if is_bundle or not d.is_dir():
            out.append((d, None))
            continue
        versions = _versions(d)
        if versions:  # a model directory of versions
            out.extend(versions)
            continue
        found = [entry for model in discover(d) for entry in _versions(model) or [(model, None)]]
        out.extend(found or [(d, BundleError(f"{d}: no bundle, model or repository here"))])
    return out


def _versions(model: Path) -> list[tuple[Path, str | None | BundleError]]:
    try:
        versions = model_versions(model)
    except BundleError as e:
        return [(model, e)]
    if list(versions.values()) == [model]:  # a bundle directly in it
        return [(model, None)]
    return [(path, model.name) for path in versions.values()]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
