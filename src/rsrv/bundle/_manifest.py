"""The bundle manifest: one msgspec schema for ``manifest.yaml`` / ``manifest.toml``.

Parsing happens in two steps. msgspec checks structure and types (unknown fields are
rejected); :func:`resolve_manifest` then checks meaning (letters, dims, batching) and
turns every tensor spec into a resolved :class:`Tensor`. Every error is a
:class:`~rsrv.errors.BundleError` naming the file and the field path.

Shapes are row-major (numpy / KServe wire order); the letter ``n`` marks the batch axis.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from rsrv.dtypes import DType
from rsrv.errors import BundleError
from rsrv.versions import VersionPolicy

FORMAT_VERSION = "2.0"
BATCH_LETTER = "n"
MANIFEST_NAMES = ("manifest.yaml", "manifest.yml", "manifest.toml")


class TensorSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One tensor as written in the manifest."""

    name: str
    dtype: str
    shape: str = ""  # one letter per axis, row-major; "" is a scalar
    dims: dict[str, int] = {}


class Batching(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    compiled_batch_sizes: list[int] = []


class MetaSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    calls: list[str] = []


class Manifest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The manifest document (see specs/bundle.md)."""

    format_version: str | float
    kind: Literal["model", "meta"] = "model"
    description: str = ""
    executable_inputs: list[TensorSpec] = []
    executable_outputs: list[TensorSpec] = []
    client_inputs: list[TensorSpec] | None = None
    client_outputs: list[TensorSpec] | None = None
    batching: Batching = msgspec.field(default_factory=Batching)
    meta: MetaSpec | None = None
    version_policy: VersionPolicy | None = None
    provenance: dict[str, Any] = {}


@dataclass(frozen=True, slots=True)
class Tensor:
    """A validated tensor spec.

    ``shape`` is row-major with ``-1`` on the batch axis and on variable axes.
    """

    name: str
    dtype: DType
    letters: str
    shape: tuple[int, ...]
    batch_axis: int | None

    @property
    def rank(self) -> int:
        return len(self.shape)

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Same rank and every fixed extent equal (batch and variable axes take any)."""
        return len(shape) == self.rank and all(
            d < 0 or d == a for d, a in zip(self.shape, shape, strict=True)
        )

    def describe(self) -> str:
        dims = ",".join(
            "n" if i == self.batch_axis else ("?" if d < 0 else str(d))
            for i, d in enumerate(self.shape)
        )
        return f"{self.name}: {self.dtype.value}[{dims}]"


def rows_mismatch(model: str, inputs: Iterable[tuple[Tensor, Sequence[int]]]) -> str | None:
    """Triton's words when ``inputs`` (each spec with the shape it came with) disagree on
    their rows, the extents along their batch axes (a request has one row count; the
    shapes are known to have each spec's rank); None when they agree."""
    first: tuple[str, int] | None = None
    for spec, shape in inputs:
        if spec.batch_axis is None:
            continue
        rows = shape[spec.batch_axis]
        if first is None:
            first = spec.name, rows
        elif rows != first[1]:
            return (
                f"input '{spec.name}' batch size does not match other inputs for '{model}' "
                f"({rows} rows along its batch axis; '{first[0]}' has {first[1]})"
            )
    return None


@dataclass(frozen=True, slots=True)
class Signature:
    """The resolved tensors of a manifest. Client-facing lists default to executable ones."""

    kind: str
    executable_inputs: tuple[Tensor, ...]
    executable_outputs: tuple[Tensor, ...]
    client_inputs: tuple[Tensor, ...]
    client_outputs: tuple[Tensor, ...]
    compiled_batch_sizes: tuple[int, ...]
    calls: tuple[str, ...]

    @property
    def batched(self) -> bool:
        """True when requests can be coalesced: every executable tensor has a batch axis."""
        return bool(self.executable_inputs) and all(
            t.batch_axis is not None for t in self.executable_inputs
        )


def decode_manifest(path: Path) -> Manifest:
    """Read and structurally validate a manifest file."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".toml":
            return msgspec.toml.decode(raw, type=Manifest)
        return msgspec.yaml.decode(raw, type=Manifest)
    except msgspec.ValidationError as e:
        raise BundleError(f"{path}: {_msgspec_path(str(e))}") from None
    except (msgspec.DecodeError, OSError, ValueError) as e:  # (ValueError: not UTF-8)
        raise BundleError(f"{path}: cannot parse: {_one_line(str(e))}") from None
    except RecursionError:
        raise BundleError(f"{path}: cannot parse: nested too deeply") from None


def resolve_manifest(manifest: Manifest, path: Path, name: str | None = None) -> Signature:
    """Check the meaning of a structurally valid manifest; return its resolved tensors.
    ``name`` is the model's name (default: the manifest's directory name)."""

    def fail(field: str, message: str) -> BundleError:
        return BundleError(f"{path}: {field}: {message}")

    version = manifest.format_version
    if str(version) != FORMAT_VERSION:
        raise fail("format_version", f'unsupported version {version!r} (expected "2.0")')

    def section(field: str, specs: list[TensorSpec] | None, client: bool) -> tuple[Tensor, ...]:
        if specs is None:
            return ()
        seen: set[str] = set()
        out = []
        for i, spec in enumerate(specs):
            where = f"{field}[{i}]"
            if spec.name in seen:
                raise fail(f"{where}.name", f"duplicate tensor name {spec.name!r}")
            seen.add(spec.name)
            out.append(_resolve_tensor(spec, where, client, fail))
        return tuple(out)

    meta = manifest.kind == "meta"
    exec_in = section("executable_inputs", manifest.executable_inputs, client=False)
    exec_out = section("executable_outputs", manifest.executable_outputs, client=False)
    client_in = section("client_inputs", manifest.client_inputs, client=True)
    client_out = section("client_outputs", manifest.client_outputs, client=True)
    sizes = manifest.batching.compiled_batch_sizes

    if meta:
        if exec_in or exec_out or sizes:
            raise fail(
                "kind",
                "a meta bundle has no executable_inputs, executable_outputs "
                "or batching (it runs no module of its own)",
            )
        if not client_in or not client_out:
            raise fail("kind", "a meta bundle must declare client_inputs and client_outputs")
        if manifest.meta is None or not manifest.meta.calls:
            raise fail("meta", "a meta bundle must declare meta.calls (the models it calls)")
        calls = manifest.meta.calls
        dupes = sorted({c for c in calls if calls.count(c) > 1})
        if dupes:
            raise fail("meta.calls", f"duplicate model(s) {', '.join(dupes)}")
        own = path.parent.name if name is None else name
        if own in calls:
            raise fail("meta.calls", f"a meta model may not call itself ({own!r})")
    else:
        if manifest.meta is not None:
            raise fail("meta", "only a meta bundle (kind: meta) may declare meta.calls")
        if not exec_out:
            raise fail("executable_outputs", "a model must declare at least one output")
        calls = []
        batched = [t.batch_axis is not None for t in exec_in]
        if any(batched) and not all(batched):
            names = ", ".join(t.name for t in exec_in if t.batch_axis is None)
            raise fail(
                "executable_inputs",
                "mixes batched and unbatched inputs; every input "
                f"needs the batch letter 'n' or none does (unbatched: {names})",
            )
        if any(batched):
            unbatched = [t.name for t in exec_out if t.batch_axis is None]
            if unbatched:
                raise fail(
                    "executable_outputs",
                    "inputs are batched, so every output needs the "
                    f"batch letter 'n' (missing in: {', '.join(unbatched)})",
                )
        elif sizes:
            raise fail(
                "batching.compiled_batch_sizes",
                "no executable input has a batch axis "
                "'n', so the model cannot be compiled per batch size",
            )
        for i, n in enumerate(sizes):
            if n < 1:
                raise fail(f"batching.compiled_batch_sizes[{i}]", f"must be positive, got {n}")
        if len(set(sizes)) != len(sizes):
            raise fail("batching.compiled_batch_sizes", "duplicate batch sizes")

    return Signature(
        kind=manifest.kind,
        executable_inputs=exec_in,
        executable_outputs=exec_out,
        client_inputs=client_in or exec_in,
        client_outputs=client_out or exec_out,
        compiled_batch_sizes=tuple(sorted(sizes)),
        calls=tuple(calls),
    )


_LETTERS = frozenset(string.ascii_letters)


def _resolve_tensor(spec: TensorSpec, where: str, client: bool, fail) -> Tensor:
    try:
        dtype = DType.from_token(spec.dtype)
    except ValueError as e:
        raise fail(f"{where}.dtype", str(e)) from None
    if dtype is DType.BYTES and not client:
        raise fail(
            f"{where}.dtype",
            "'bytes' is only allowed on client_inputs/client_outputs "
            "(model.py converts it; a compiled module cannot take strings)",
        )
    letters = spec.shape
    for ch in letters:
        if ch not in _LETTERS:
            raise fail(f"{where}.shape", f"{letters!r}: {ch!r} is not an ASCII letter")
    repeated = sorted({ch for ch in letters if letters.count(ch) > 1})
    if repeated:
        raise fail(f"{where}.shape", f"{letters!r}: letter {repeated[0]!r} appears twice")
    if BATCH_LETTER in spec.dims:
        raise fail(
            f"{where}.dims",
            f"letter {BATCH_LETTER!r} is reserved for the batch axis and takes no size",
        )
    shape = []
    for ch in letters:
        if ch == BATCH_LETTER:
            shape.append(-1)
            continue
        if ch not in spec.dims:
            raise fail(f"{where}.dims", f"letter {ch!r} of shape {letters!r} has no size")
        size = spec.dims[ch]
        if size < 1 and size != -1:
            raise fail(f"{where}.dims.{ch}", f"size must be positive or -1 (variable), got {size}")
        shape.append(size)
    for key in spec.dims:
        if len(key) != 1:
            raise fail(f"{where}.dims.{key}", f"a key is one letter of shape {letters!r}")
        if key not in letters:
            raise fail(
                f"{where}.dims.{key}", f"letter {key!r} does not appear in shape {letters!r}"
            )
    axis = letters.find(BATCH_LETTER)
    return Tensor(spec.name, dtype, letters, tuple(shape), None if axis < 0 else axis)


_YAML_MARK = re.compile(r'\s*in "<[^>]*>", line (\d+), column (\d+)')


def _one_line(message: str) -> str:
    """PyYAML's multi-line 'in "<byte string>", line L, column C' marks -> one line."""
    return " ".join(_YAML_MARK.sub(r" (at line \1, column \2)", message).split())


def _msgspec_path(message: str) -> str:
    """Turn msgspec's "Expected `int`, got `str` - at `$.a[0].b`" into "a[0].b: Expected ..."."""
    text, sep, at = message.rpartition(" - at `$")
    if not sep:
        return message
    field = at.rstrip("`").lstrip(".")
    return f"{field}: {text}" if field else text
