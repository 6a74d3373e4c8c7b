"""Model versions: the version policy, and the version strings clients send.

A model directory of the repository holds one or more numbered versions (specs/bundle.md
§1); its version policy picks the ones served, as Triton's ``version_policy`` does. The
policy is written in a manifest or in the node file's per-model block
(``scheduler.models.<name>.version_policy``), in the same form::

    version_policy: {latest: 2}        # the two highest-numbered versions (default: 1)
    version_policy: {all: true}        # every version
    version_policy: {specific: [1, 3]} # exactly these

Clients name a version with a decimal string; the empty string means the newest ready
version the policy serves. A string that is not a version gets Triton's status and message
(:func:`parse_version`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated

import msgspec
from msgspec import Meta

from rsrv.errors import InvalidArgument

__all__ = ["DEFAULT_POLICY", "MAX_VERSION", "VersionPolicy", "parse_version", "version_dir_number"]

#: Versions are int64 in Triton (and in the statistics' protobuf messages).
MAX_VERSION = (1 << 63) - 1
_DECIMAL = re.compile(r"[0-9]+")
_DIRECTORY = re.compile(r"[1-9][0-9]*")


class VersionPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which versions of a model are served. At most one of the three is given; none
    given is ``latest: 1``."""

    latest: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Serve the N highest-numbered versions."),
    ] = None
    all: Annotated[bool, Meta(description="Serve every version.")] = False
    specific: Annotated[
        tuple[Annotated[int, Meta(ge=1)], ...] | None,
        Meta(
            description="Serve exactly these versions (those that exist).",
            extra_json_schema={"minItems": 1},  # (__post_init__ says so for the loader)
        ),
    ] = None

    def __post_init__(self) -> None:
        given = [k for k in ("latest", "all", "specific") if getattr(self, k) not in (None, False)]
        if len(given) > 1:
            raise ValueError(
                f"a version policy is one of latest, all or specific, got {' and '.join(given)}"
            )
        if self.specific is not None and not self.specific:
            raise ValueError("specific: list at least one version")

    def select(self, available: Iterable[int]) -> list[int]:
        """The versions of ``available`` this policy serves, ascending."""
        versions = sorted(set(available))
        if self.all:
            return versions
        if self.specific is not None:
            wanted = set(self.specific)
            return [v for v in versions if v in wanted]
        latest = self.latest or 1
        return versions[-latest:] if versions else []

    def describe(self) -> str:
        """``latest 2`` / ``all`` / ``specific [1, 3]``."""
        if self.all:
            return "all"
        if self.specific is not None:
            return f"specific {sorted(self.specific)}"
        return f"latest {self.latest or 1}"


#: What a model without a policy serves: its highest-numbered version.
DEFAULT_POLICY = VersionPolicy(latest=1)


def parse_version(text: str) -> int | None:
    """A client's version string: None for "" (the newest ready version), else the
    version number. Anything else is INVALID_ARGUMENT with Triton's message
    (``GetModelVersionFromString`` in triton-inference-server/server src/common.cc),
    then what was wrong with it."""
    if text == "":
        return None
    if _DECIMAL.fullmatch(text):
        # (Python refuses to convert thousands of digits; 20 already exceed int64;
        # leading zeros count for nothing: "0...07" is 7, as Triton's stol reads it)
        digits = text.lstrip("0") or "0"
        number = int(digits) if len(digits) <= 20 else MAX_VERSION + 1
        if number <= MAX_VERSION:
            return number
        detail = f"above the largest version {MAX_VERSION}"
    elif text.startswith("-") and _DECIMAL.fullmatch(text[1:]):
        if not text[1:].strip("0"):  # ("-0" is 0 to Triton's stol: not negative)
            return 0
        raise InvalidArgument(
            f"invalid model version specified '{text}' , version should be an integral value > 0"
        )
    else:
        detail = "not a decimal integer"
    shown = text if len(text) <= 80 else text[:80] + "..."
    raise InvalidArgument(
        f"failed to get model version from specified version string '{shown}' "
        f"(details: {detail}), version should be an integral value > 0"
    )


def version_dir_number(name: str) -> int | None:
    """The version a directory of that name holds in a model directory: a positive
    decimal number without leading zeros (at most :data:`MAX_VERSION`); None otherwise."""
    if _DIRECTORY.fullmatch(name) and int(name) <= MAX_VERSION:
        return int(name)
    return None
