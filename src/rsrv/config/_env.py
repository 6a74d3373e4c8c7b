"""Environment variable overrides: ``INFERENCE_SERVER_<SECTION>_<FIELD>``.

Overrides are applied last, to one worker's merged settings (a plain dict
shaped like :class:`~rsrv.config._schema.GlobalConfig` plus ``model_repo``),
so they beat both the ``global`` block and the worker's own overrides.

Guarantees:

* Every variable that starts with ``INFERENCE_SERVER_`` must name a
  field; an unknown one is a :class:`ConfigError`, never ignored, so a
  misspelt override cannot silently do nothing.
* A value is parsed by its field's type and checked against the field's
  constraints here, so an error names the variable rather than a path in
  a merged dict the operator never wrote.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

import msgspec

from ._errors import ConfigError, reword
from ._schema import SECTIONS, GlobalConfig, NodeConfig

__all__ = [
    "is_service_link",
    "CPU_WORKERS_VARIABLE",
    "ENV_PREFIX",
    "GPUS_VARIABLE",
    "apply_env",
    "env_variables",
    "parse_env_value",
]

ENV_PREFIX = "INFERENCE_SERVER_"
#: The node's devices (a count or a list), before the node file's ``gpus``.
GPUS_VARIABLE = ENV_PREFIX + "GPUS"
#: The worker count of a cpu node without a ``workers`` list (``cpu_workers``).
CPU_WORKERS_VARIABLE = ENV_PREFIX + "CPU_WORKERS"
# The variables Kubernetes gives a container for each Service of its namespace, after
# the Service's name S: S_SERVICE_HOST, S_SERVICE_PORT[_<PORT NAME>], S_PORT (an address),
# and S_PORT_<N>_<PROTOCOL> (an address), with _PROTO, _PORT, _ADDR after it.
_LINK_SUFFIX = re.compile(
    r"SERVICE_HOST|SERVICE_PORT(_\w+)?|(?P<address>PORT(_\d+_(TCP|UDP|SCTP))?)"
    r"|PORT_\d+_(TCP|UDP|SCTP)_(PROTO|PORT|ADDR)"
)
_LINK_ADDRESS = re.compile(r"(tcp|udp|sctp)://(?P<host>\S+):\d+")


def is_service_link(name: str, value: str, env: Mapping[str, str]) -> bool:
    """Whether ``name=value`` is one of the variables Kubernetes gives every container for
    each Service of its namespace: a Service named ``inference-server...`` gives
    ``INFERENCE_SERVER_...`` ones, which are no settings and must not stop the server.
    Told by ``env`` holding the Service's ``S_SERVICE_HOST`` and ``S_SERVICE_PORT`` (set
    together with the others), and an address value (``S_PORT=tcp://...``) naming that
    host: a variable an operator sets, a typo included, is not one."""
    for i, char in enumerate(name):
        if char != "_" or (suffix := _LINK_SUFFIX.fullmatch(name, i + 1)) is None:
            continue
        service = name[:i]
        host = env.get(f"{service}_SERVICE_HOST")
        if host is None or f"{service}_SERVICE_PORT" not in env:
            continue
        if suffix["address"] is None:
            return True
        address = _LINK_ADDRESS.fullmatch(value)
        if address is not None and address["host"].strip("[]") == host.strip("[]"):
            return True
    return False


#: Variables that shape the node rather than a worker's settings.
_NODE_VARIABLES = frozenset({GPUS_VARIABLE, CPU_WORKERS_VARIABLE})

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_members(tp: Any) -> tuple[Any, ...]:
    tp = _strip_annotated(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        return tuple(_strip_annotated(a) for a in typing.get_args(tp))
    return (tp,)


def _is_scalar(tp: Any) -> bool:
    # Structs and mappings have no single-string spelling; lists do (a:b:c), unless of
    # structs or mappings.
    for member in _union_members(tp):
        if isinstance(member, type) and issubclass(member, msgspec.Struct | dict):
            return False
        if typing.get_origin(member) is dict:
            return False
        if typing.get_origin(member) is list and not _is_scalar(typing.get_args(member)[0]):
            return False
    return True


def env_variables() -> dict[str, tuple[tuple[str, ...], Any]]:
    """Every variable that sets a key of the worker settings -> (its key path, field
    type). The device variables (GPUS_VARIABLE, CPU_WORKERS_VARIABLE) are read apart."""
    table: dict[str, tuple[tuple[str, ...], Any]] = {}
    repo = next(f for f in msgspec.structs.fields(NodeConfig) if f.name == "model_repo")
    table[ENV_PREFIX + "MODEL_REPO"] = (("model_repo",), repo.type)
    for f in msgspec.structs.fields(GlobalConfig):
        if f.name not in SECTIONS and _is_scalar(f.type):
            table[ENV_PREFIX + f.name.upper()] = ((f.name,), f.type)
    for section, cls in SECTIONS.items():
        for f in msgspec.structs.fields(cls):
            if _is_scalar(f.type):
                var = f"{ENV_PREFIX}{section.upper()}_{f.name.upper()}"
                table[var] = ((section, f.name), f.type)
    return table


def _parse_one(text: str, tp: Any) -> Any:
    """Parse `text` as the (non-union) type `tp`; ValueError if it cannot be."""
    word = text.strip()
    if tp is bool:
        if word.lower() in _TRUE:
            return True
        if word.lower() in _FALSE:
            return False
        raise ValueError("expected a boolean (1/0, true/false, yes/no, on/off)")
    if tp is int:
        try:
            return int(word)
        except ValueError:
            raise ValueError("expected an integer") from None
    if tp is float:
        try:
            value = float(word)
        except ValueError:
            raise ValueError("expected a number") from None
        if not math.isfinite(value):
            raise ValueError("expected a finite number")
        return value
    if tp is str:
        return text
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        # Accept INFO for info: env values are often written in upper case.
        for candidate in (word, word.lower()):
            if candidate in choices:
                return candidate
        raise ValueError("expected one of " + ", ".join(map(str, choices)))
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return [parse_env_value(part, item) for part in word.split(":")] if word else []
    raise ValueError(f"cannot be set from the environment ({tp!r})")


def parse_env_value(text: str, tp: Any) -> Any:
    """Parse an environment string into a value of field type `tp`.

    Booleans accept 1/0, true/false, yes/no, on/off in any case; optional
    fields accept ``none``, ``null`` or the empty string as None; lists are
    colon-separated. Raises ValueError when the text does not parse; range
    constraints are not checked here (see :func:`apply_env`).
    """
    members = _union_members(tp)
    if type(None) in members and text.strip().lower() in _NONE:
        return None
    candidates = [m for m in members if m is not type(None)]
    errors = []
    # A union such as int | str: the first member that parses wins, in the
    # order the schema declares them.
    for member in candidates:
        try:
            return _parse_one(text, member)
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError("; ".join(dict.fromkeys(errors)) or "unparseable")


def apply_env(settings: dict[str, Any], env: Mapping[str, str]) -> tuple[str, ...]:
    """Apply every ``INFERENCE_SERVER_*`` variable in `env` to `settings`, in place.

    Returns the applied overrides as ``NAME=value`` strings, sorted by name,
    for the startup log. The node-level variables (``INFERENCE_SERVER_GPUS``,
    ``INFERENCE_SERVER_CPU_WORKERS``) are left to :func:`plan_node`. Raises
    ConfigError naming the variable when it is unknown or its value is invalid for
    its field.
    """
    table = env_variables()
    applied = []
    for var in sorted(k for k in env if k.startswith(ENV_PREFIX)):
        text = env[var]
        if var in _NODE_VARIABLES:
            continue  # read when the node is planned (_resolve.plan_node)
        if is_service_link(var, text, env):
            continue
        if var not in table:
            close = difflib.get_close_matches(var, [*table, *_NODE_VARIABLES], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{var}: unknown configuration variable{hint}")
        path, tp = table[var]
        try:
            value = parse_env_value(text, tp)
        except ValueError as exc:
            raise ConfigError(f"{var}={text!r}: {exc}") from None
        try:
            # Checks the Meta constraints (ranges) of the field.
            value = msgspec.convert(value, type=tp, strict=True)
        except msgspec.ValidationError as exc:
            message = reword(str(exc).removesuffix(" - at `$`"))
            raise ConfigError(f"{var}={text!r}: {message}") from None
        target = settings
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value
        applied.append(f"{var}={text}")
    return tuple(applied)
