"""Request and tensor parameters of the KServe V2 / Triton protocol.

* ``timeout`` (request, int64 µs): a deadline enforced by the server; absent or 0: none;
  negative or another type: INVALID_ARGUMENT.
* ``priority`` (request): tritonclient sends ``uint64_param``; Triton also accepts
  ``int64_param`` >= 0. Validated; not used by the scheduler.
* ``shared_memory_region`` (string), ``shared_memory_byte_size`` (int64, required with a
  region) and ``shared_memory_offset`` (int64, default 0) on a tensor: it lives in a
  registered system shared memory region (:class:`ShmTarget`). A region named while
  shared memory is disabled is FAILED_PRECONDITION; an unregistered one NOT_FOUND with
  Triton's message (``Unable to find shared memory region: '<name>'``); a window past
  the region INVALID_ARGUMENT.

The checks are the same on both wires: the protobuf accessors (``shm_target``,
``request_deadline``, ``request_priority``) and the REST codec's JSON one
(``json_param``) read a value, then ``shm_target_of`` / ``deadline_of`` /
``priority_of`` decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rsrv.errors import FailedPrecondition, InvalidArgument, RsrvError
from rsrv.protocol._shm import DISABLED_MESSAGE, Registration, SharedMemoryRegistry

__all__ = [
    "Getter",
    "ShmTarget",
    "deadline_of",
    "json_param",
    "priority_of",
    "request_deadline",
    "request_priority",
    "shm_target",
    "shm_target_of",
]

#: ``get(key, kind)``: a parameter's value (None if absent); InvalidArgument for a value
#: of another kind (``kind``: the protobuf oneof name, e.g. ``"int64_param"``).
Getter = Callable[[str, str], Any]


@dataclass(frozen=True, slots=True)
class ShmTarget:
    """A tensor's place in a registered system shared memory region; ``registration``
    the region as it was registered when checked (:func:`check_region`), which the
    request then reads or writes whatever becomes of the name."""

    region: str
    byte_size: int
    offset: int = 0
    registration: Registration | None = None

    @property
    def registered(self) -> str | Registration:
        """What the registry's ``read`` and ``write`` take: the registration when
        checked, else the name (looked up then)."""
        return self.region if self.registration is None else self.registration


def _param(params: Any, key: str, kind: str, what: str) -> Any:
    """The value of parameter ``key`` (None if absent), which must be of oneof ``kind``."""
    if key not in params:  # `params[key]` would insert a default entry
        return None
    value = params[key]
    if value.WhichOneof("parameter_choice") != kind:
        raise InvalidArgument(
            f"invalid value type for '{key}' parameter for {what}, expected {kind}"
        )
    return getattr(value, kind)


def shm_target(tensor: Any, what: str) -> ShmTarget | None:
    """The shared-memory window a protobuf tensor names (None: not in shared memory)."""
    params = tensor.parameters
    if not params:
        return None
    return shm_target_of(lambda key, kind: _param(params, key, kind, what), what)


def shm_target_of(get: Getter, what: str) -> ShmTarget | None:
    """The checks of a tensor's shared-memory parameters, whatever the wire: ``get(key,
    kind)`` returns a parameter's value (None if absent) or raises InvalidArgument for a
    value of another kind."""
    region = get("shared_memory_region", "string_param")
    byte_size = get("shared_memory_byte_size", "int64_param")
    offset = get("shared_memory_offset", "int64_param")
    if region is None:
        if byte_size is not None or offset is not None:
            raise InvalidArgument(
                f"'shared_memory_byte_size' and 'shared_memory_offset' can not be specified "
                f"without 'shared_memory_region' parameter for {what}"
            )
        return None
    if not region:
        raise InvalidArgument(f"empty 'shared_memory_region' parameter for {what}")
    if byte_size is None:
        raise InvalidArgument(
            f"'shared_memory_byte_size' parameter is required with 'shared_memory_region' "
            f"'{region}' for {what}"
        )
    offset = offset or 0
    if byte_size < 0 or offset < 0:
        raise InvalidArgument(
            f"negative shared memory byte size {byte_size} or offset {offset} in region "
            f"'{region}' for {what}"
        )
    return ShmTarget(region, byte_size, offset)


#: JSON value types of the protobuf parameter kinds (the REST wire's parameters).
_JSON_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "string_param": ((str,), "a string"),
    "int64_param": ((int,), "an integer"),
    "uint64_param": ((int,), "an integer >= 0"),
    "bool_param": ((bool,), "a boolean"),
    "double_param": ((int, float), "a number"),
}


#: Integers the protobuf parameter kinds hold (what the gRPC wire could carry).
_RANGES = {
    "int64_param": (-(1 << 63), (1 << 63) - 1, "int64"),
    "uint64_param": (0, (1 << 64) - 1, "uint64"),
}


def json_param(params: Mapping[str, Any], key: str, kind: str, what: str) -> Any:
    """The value of JSON parameter ``key`` (None if absent or null), which must be the
    JSON type of protobuf kind ``kind`` (a boolean is never a number), an integer in its
    range."""
    value = params.get(key)
    if value is None:
        return None
    types, words = _JSON_KINDS[kind]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise InvalidArgument(
            f"invalid value type for '{key}' parameter for {what}, expected {words}"
        )
    bounds = _RANGES.get(kind)
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise InvalidArgument(
            f"invalid value for '{key}' parameter for {what}: {value} is outside the "
            f"{bounds[2]} range [{bounds[0]}, {bounds[1]}]"
        )
    return value


def registry(shm: SharedMemoryRegistry | None, target: ShmTarget, what: str):
    if shm is None or not shm.enabled:
        raise FailedPrecondition(
            f"{what} uses shared memory region '{target.region}', but {DISABLED_MESSAGE}"
        )
    return shm


def with_context(e: RsrvError, what: str) -> RsrvError:
    return type(e)(f"{e} ({what})")


def check_region(shm: SharedMemoryRegistry | None, target: ShmTarget, what: str) -> ShmTarget:
    """``target`` with its region's registration, once its window is known to lie in
    it; FailedPrecondition (disabled), NotFound or InvalidArgument naming ``what``."""
    found = registry(shm, target, what)
    try:
        registration = found.check(target.region, target.offset, target.byte_size)
    except RsrvError as e:
        raise with_context(e, what) from None
    return dataclasses.replace(target, registration=registration)


def request_deadline(request: Any, now: float) -> float | None:
    """Absolute deadline (``now`` + the ``timeout`` parameter, in µs) or None.

    tritonclient's ``infer(..., timeout=µs)`` sends ``parameters["timeout"].int64_param``.
    Absent or 0 means no deadline; negative or a non-int64 value is INVALID_ARGUMENT.
    ``now`` and the result are in seconds on the caller's clock (e.g. ``trio.current_time``).
    """
    return deadline_of(_param(request.parameters, "timeout", "int64_param", "the request"), now)


def deadline_of(value: int | None, now: float) -> float | None:
    """The deadline of a ``timeout`` value already read as an integer (µs), any wire."""
    if not value:
        return None
    if value < 0:
        raise InvalidArgument(
            f"invalid value {value} for 'timeout' parameter: expected microseconds >= 0 "
            "(0 means no timeout)"
        )
    return now + value / 1e6


def request_priority(request: Any) -> int:
    """The ``priority`` parameter (0, the default, if absent).

    tritonclient sends ``uint64_param``; Triton also accepts ``int64_param`` >= 0.
    """
    params = request.parameters
    if "priority" not in params:
        return 0
    value = params["priority"]
    which = value.WhichOneof("parameter_choice")
    if which == "uint64_param":
        return value.uint64_param
    if which == "int64_param":
        return priority_of(value.int64_param)
    raise InvalidArgument(
        "invalid value type for 'priority' parameter, expected uint64_param or int64_param"
    )


def priority_of(value: int) -> int:
    """A signed ``priority`` value, any wire: it must be >= 0 (and a uint64: a JSON
    integer may be larger than any the gRPC wire carries)."""
    if value < 0:
        raise InvalidArgument("invalid value for 'priority', expected value >= 0")
    if value >= 1 << 64:
        raise InvalidArgument(f"invalid value for 'priority', expected value < 2^64, got {value}")
    return value
