"""StableHLO modules on disk: read the bytes and the entry signature.

A module file holds StableHLO either as MLIR text or as a portable artifact (the VHLO
bytecode that ``jax.export`` serializes). PJRT compiles both; the signature is read with
the MLIR bindings that ship with jaxlib, without compiling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rsrv.dtypes import DType

_BYTECODE_MAGIC = b"ML\xefR"


@dataclass(frozen=True, slots=True)
class ArgType:
    shape: tuple[int, ...]  # -1 for a dynamic extent
    dtype: DType


@dataclass(frozen=True, slots=True)
class ModuleSignature:
    inputs: tuple[ArgType, ...]
    outputs: tuple[ArgType, ...]


def read_module(path: Path) -> bytes | str:
    """Return the module as bytecode (bytes) or text (str), as PJRT's compiler accepts it.

    Raises ``ValueError`` (``not a StableHLO module: ...``) for a file that is neither
    bytecode nor UTF-8 text, OSError when it cannot be read."""
    data = path.read_bytes()
    if data.startswith(_BYTECODE_MAGIC):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not a StableHLO module: neither bytecode nor UTF-8 text (byte {e.start} "
            f"is {data[e.start]:#04x})"
        ) from None


def read_signature(source: bytes | str, entry: str = "main") -> ModuleSignature:
    """Parse ``source`` and return the argument and result types of ``entry``.

    Raises ``ValueError`` with a readable reason when the module does not parse, has no
    such function, or uses a type rsrv cannot serve.
    """
    from jax._src.interpreters import mlir as jax_mlir  # registers every dialect jax uses
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import stablehlo

    with jax_mlir.make_ir_context() as ctx:
        try:
            if isinstance(source, bytes):
                module = stablehlo.deserialize_portable_artifact(ctx, source)
            else:
                module = ir.Module.parse(source)
        except Exception as e:  # the MLIR bindings raise a bare Exception subclass
            raise ValueError(f"not a StableHLO module: {_first_line(e)}") from None
        for op in module.body.operations:
            attrs = op.attributes
            if "sym_name" in attrs and ir.StringAttr(attrs["sym_name"]).value == entry:
                ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                return ModuleSignature(
                    tuple(_arg_type(t, ir) for t in ftype.inputs),
                    tuple(_arg_type(t, ir) for t in ftype.results),
                )
    raise ValueError(f"module has no function @{entry}")


def _arg_type(t, ir) -> ArgType:
    try:
        rt = ir.RankedTensorType(t)
    except ValueError:
        raise ValueError(f"unsupported argument type {t} (expected a ranked tensor)") from None
    shape = tuple(-1 if rt.is_dynamic_dim(i) else rt.get_dim_size(i) for i in range(rt.rank))
    return ArgType(shape, DType.from_mlir(str(rt.element_type)))


def _first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:3])[:300] if lines else type(e).__name__
