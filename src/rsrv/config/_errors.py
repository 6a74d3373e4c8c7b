"""The one exception the configuration package raises, and how msgspec's validation
messages become its messages (``$.path: problem``, every mapping key named)."""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any, TypeVar

import msgspec

from ._schema import HOST_PATTERN

__all__ = ["ConfigError", "convert", "key_segment", "reword", "unusable_tls"]

_T = TypeVar("_T")


class ConfigError(ValueError):
    """A node file, or the environment, does not describe a valid deployment.

    The message always starts with where the problem is: the node file's
    path (or ``<embedded default.toml>``), and, when the problem is a
    single field, its ``$.path`` or the environment variable's name. It is
    meant to be shown to the operator as is.
    """


def unusable_tls(files: dict[str, str | None], error: Exception, who: str = "") -> ConfigError:
    """The error for TLS ``files`` (setting -> path) that cannot be read or used, naming
    those that are set; ``who`` (e.g. "worker gpu0") leads the message."""
    named = ", ".join(f"{key} = {path}" for key, path in files.items() if path)
    lead = f"{who}: " if who else ""
    return ConfigError(f"{lead}a TLS file cannot be used ({named}): {error}")


def key_segment(key: str) -> str:
    """A mapping key as a path segment: `.name`, or `["odd key"]`."""
    return f".{key}" if re.fullmatch(r"[A-Za-z_][\w-]*", key) else f"[{json.dumps(key)}]"


_SEGMENT = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+)\]|\[(\.\.\.)\]")


#: msgspec's words for a constraint, and ours.
_REWORDED = {
    f"Expected `str` matching regex {HOST_PATTERN!r}": (
        "expected a host name or address, without white space"
    ),
}


def reword(problem: str) -> str:
    """msgspec's problem, in the operator's words where it would be cryptic."""
    return _REWORDED.get(problem, problem)


def _split(message: str) -> tuple[str, str]:
    """msgspec's message as (problem, `$.path`); a mapping key's own problem (a YAML key
    read as a number, a date, a boolean) as the mapping's, saying so."""
    match = re.fullmatch(r"(?s)(.*) - at `key` in `(\$[^`]*)`", message)
    if match:
        return f"a key: {match.group(1)} (quote the key)", match.group(2)
    match = re.fullmatch(r"(?s)(.*) - at `(\$[^`]*)`", message)
    return (match.group(1), match.group(2)) if match else (message, "$")


def _name_keys(raw: Any, type_: type, message: str) -> str | None:
    """The error's path with msgspec's `[...]` placeholders replaced by the keys.

    msgspec does not say which mapping key an error is under. It reports
    the first error in document order, so the culprit is the first key k
    for which the mapping cut after k reproduces the same error: found by
    bisection (every cut after it reproduces it, none before it does), each
    trial a copy of the mappings on the path alone. Returns None when the
    path cannot be followed.
    """
    _, path = _split(message)
    tokens: list[Any] = []
    for match in _SEGMENT.finditer(path):
        name, index, _ = match.groups()
        tokens.append(name if name else int(index) if index else ...)
    for pos, token in enumerate(tokens):
        if token is not ...:
            continue
        if pos == 0:
            return None
        node = raw
        for step in tokens[:pos]:
            node = node[step]
        if not isinstance(node, dict):
            return None
        culprit = _culprit(raw, type_, message, tokens[:pos], node)
        if culprit is None:
            return None
        tokens[pos] = culprit
    rendered = "$"
    for token in tokens:
        rendered += f"[{token}]" if isinstance(token, int) else key_segment(token)
    return rendered


def _culprit(raw: Any, type_: type, message: str, steps: list, node: dict) -> Any:
    """The key of ``node`` (the mapping at ``steps`` in ``raw``) the error ``message``
    is under: the least k such that ``node`` cut after k fails with it; None if none."""
    keys = list(node)

    def reproduces(cut: int) -> bool:
        trial = parent = copy.copy(raw)  # (the mappings on the way copied, the rest shared)
        for step in steps[:-1]:
            parent[step] = copy.copy(parent[step])
            parent = parent[step]
        parent[steps[-1]] = {k: node[k] for k in keys[:cut]}
        try:
            msgspec.convert(trial, type=type_, strict=True)
        except msgspec.ValidationError as exc:
            return str(exc) == message
        return False

    low, high = 1, len(keys)
    if not keys or not reproduces(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if reproduces(middle):
            high = middle
        else:
            low = middle + 1
    return keys[low - 1]


def _describe(exc: msgspec.ValidationError, raw: Any, type_: type) -> str:
    """msgspec's message, reworded as `$.path: problem` with every key named.

    msgspec reports an unknown field at its parent's path; appending the
    field's name gives the operator the exact key to delete.
    """
    problem, path = _split(str(exc))
    if "[...]" in path:
        try:
            path = _name_keys(raw, type_, str(exc)) or path
        except (KeyError, IndexError, TypeError):
            pass  # keep msgspec's own path
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", problem)
    if unknown:
        return f"{path}{key_segment(unknown.group(1))}: unknown field"
    return f"{path}: {reword(problem)}"


def convert(raw: Any, type_: type[_T], where: str) -> _T:
    """``raw`` (a file's data) as ``type_``; ConfigError naming ``where`` and the key's
    path. A number that is not finite (`.inf`, `nan`) is refused wherever it is, as
    the environment refuses it: no setting means "for ever" by infinity."""
    try:
        converted = msgspec.convert(raw, type=type_, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {_describe(exc, raw, type_)}") from None
    path = _non_finite(raw, "$")  # (after the checks of keys and types: theirs first)
    if path is not None:
        raise ConfigError(f"{where}: {path}: expected a finite number")
    return converted


def _non_finite(value: Any, path: str) -> str | None:
    """The path of the first float in ``value`` that is not finite, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, dict):
        items = [(key_segment(str(key)), item) for key, item in value.items()]
    elif isinstance(value, list):
        items = [(f"[{i}]", item) for i, item in enumerate(value)]
    else:
        return None
    for segment, item in items:
        found = _non_finite(item, path + segment)
        if found is not None:
            return found
    return None
