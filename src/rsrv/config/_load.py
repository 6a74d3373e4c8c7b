"""Reading node files: YAML or TOML, by extension, validated against :class:`NodeConfig`.

Every error is a :class:`ConfigError` naming the file and, when there is one, the
field's ``$.path``.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import msgspec.toml
import yaml

from ._errors import ConfigError, convert
from ._resolve import DEFAULT_NODE_NAME, plan_node, resolve_worker
from ._schema import NodeConfig, WorkerConfig

__all__ = ["DEFAULT_NODE_NAME", "load_node", "load_worker", "read_config_bytes", "read_document"]


_FORMATS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """PyYAML's safe loader, refusing a key given twice in one mapping (which it would
    let the last win silently, where TOML refuses it)."""

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, yaml.MappingNode):  # (`!!map x`: a raw ValueError)
            raise yaml.constructor.ConstructorError(
                None, None, f"expected a mapping, found {node.id}", node.start_mark
            )
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # (<<: keys merged in may be overridden)
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the base class says so
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
        return super().construct_mapping(node, deep)

    def construct_object(self, node, deep=False):
        """PyYAML's, with what its constructors raise on an explicit tag they cannot
        read (``!!bool maybe``: KeyError, ``!!timestamp x``: AttributeError) made a
        ConstructorError at the node, as every other YAML error is."""
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, KeyError, AttributeError, TypeError, OverflowError):
            tag = node.tag.removeprefix("tag:yaml.org,2002:")
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} cannot be read as !!{tag}", node.start_mark
            ) from None


# Numbers as YAML 1.2 reads them (its core schema), not PyYAML's YAML 1.1: `010` is 10
# (1.1: octal 8), `1:30` a string (1.1: 90, base 60), `1e3` the number 1000 (1.1: a
# string); octal is written `0o10`. As 1.1 allowed, `_` may separate digits (`1_000`) and
# `0b` writes binary. Booleans stay 1.1's (`yes`, `on` are true).
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in _UniqueKeyLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(
    _INT_TAG,
    re.compile(r"[-+]?(?:0b[01_]+|0o[0-7_]+|0x[0-9a-fA-F_]+|[0-9][0-9_]*)\Z"),
    list("-+0123456789"),
)
_UniqueKeyLoader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?\Z"
        r"|[-+]?\.(?:inf|Inf|INF)\Z|\.(?:nan|NaN|NAN)\Z"
    ),
    list("-+.0123456789"),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    digits = text.replace("_", "").lstrip("+-")
    base = {"0b": 2, "0o": 8, "0x": 16}.get(digits[:2], 10)
    try:  # (an explicit !!int may carry anything)
        value = int(digits[2:] if base != 10 else digits, base)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not an integer", node.start_mark
        ) from None
    return -value if text.startswith("-") else value


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    word = text.replace("_", "").lower()
    special = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}.get(word)
    try:  # (an explicit !!float may carry anything; YAML 1.2 has no base 60)
        return float(special or word)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a number", node.start_mark
        ) from None


_UniqueKeyLoader.add_constructor(_INT_TAG, _construct_int)
_UniqueKeyLoader.add_constructor(_FLOAT_TAG, _construct_float)


def _load_yaml(data: bytes) -> Any:
    try:
        return yaml.load(data, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise msgspec.DecodeError(str(exc)) from None


_DECODERS = {"YAML": _load_yaml, "TOML": msgspec.toml.decode}


def _decode(data: bytes, fmt: str, where: str) -> Any:
    data = data.removeprefix(b"\xef\xbb\xbf")  # (a UTF-8 BOM: YAML skips it, TOML did not)
    try:
        raw = _DECODERS[fmt](data)
    except msgspec.DecodeError as exc:
        # PyYAML names the input "<byte string>"; the prefix names it better.
        detail = str(exc).replace('in "<byte string>", ', "")
        raise ConfigError(f"{where}: invalid {fmt}: {detail}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{where}: invalid {fmt}: not UTF-8 (byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start})"
        ) from None
    except RecursionError:  # (tomllib parses nested arrays and tables recursively)
        raise ConfigError(f"{where}: invalid {fmt}: nested too deeply") from None
    # An empty YAML file is a node with every default.
    return {} if raw is None else raw


def _format(path: Path) -> str:
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{os.fspath(path)}: unsupported extension; use .yaml, .yml or .toml")
    return fmt


def read_config_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file. Raises
    ConfigError naming the file (a directory, another extension, unreadable)."""
    path = Path(path)
    where = os.fspath(path)
    if path.is_dir():
        raise ConfigError(f"{where}: is a directory; give a .yaml, .yml or .toml file")
    _format(path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from None


def read_document(path: Path, data: bytes | None = None) -> Any:
    """A YAML (``.yaml``/``.yml``) or TOML (``.toml``) file as plain data; an empty
    YAML file is an empty table. ``data``: the file's bytes, read already (a
    supervisor's copy); ``path`` then only names the file and gives its format. Raises
    ConfigError naming the file."""
    if data is None:
        data = read_config_bytes(path)
    return _decode(data, _format(path), os.fspath(path))


def load_node(path: str | os.PathLike[str] | None = None, data: bytes | None = None) -> NodeConfig:
    """Read and validate a node file; None reads the embedded ``default.toml``.
    ``data``: the file's bytes, read already (see :func:`read_document`).

    The format follows the extension: ``.yaml``/``.yml`` or ``.toml``.
    Values are returned as written (paths unresolved, derived ports None);
    use :func:`resolve_worker` with ``source=path`` to get a runnable
    worker. Besides the schema this checks what can be checked without the
    environment: worker names are unique, the pin map names defined
    workers (a pin on ``workerN`` of a node whose workers the machine numbers
    is left to the plan made there), device lists are well formed and ports do
    not collide.

    Raises ConfigError, naming the file, for unreadable files, syntax
    errors and invalid contents.
    """
    if path is None:
        data = importlib.resources.files(__package__).joinpath("default.toml").read_bytes()
        where, raw = DEFAULT_NODE_NAME, _decode(data, "TOML", DEFAULT_NODE_NAME)
    else:
        where, raw = os.fspath(path), read_document(Path(path), data)
    node = convert(raw, NodeConfig, where)
    # Resolve every worker with no environment and no device detection: a file
    # that cannot yield a worker is rejected now rather than when its worker starts.
    plan_node(node, {}, source=None if path is None else Path(where), detect=False)
    return node


def load_worker(
    path: str | os.PathLike[str] | None,
    name: str | None = None,
    env: Mapping[str, str] = os.environ,
    data: bytes | None = None,
) -> WorkerConfig:
    """:func:`load_node` (of ``path``, or of its bytes ``data``) then
    :func:`resolve_worker`, with `source` set to `path`."""
    node = load_node(path, data)
    return resolve_worker(node, name, env, source=None if path is None else Path(path))
