"""Restricted protocols as a server enforces them: the blocks of a worker's
``endpoints.restricted`` or a gateway's ``grpc.restricted``, their header values read
at startup."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from rsrv.config import ConfigError, RestrictedConfig
from rsrv.protocol._calls import Restriction
from rsrv.transport import NOT_METADATA, metadata_problem

__all__ = ["restrictions_of"]


def restrictions_of(blocks: Sequence[RestrictedConfig], key: str) -> list[Restriction]:
    """The restrictions of ``blocks`` (the setting ``key``, for messages), their values
    read from the file, the environment or a file. Raises ConfigError when a value
    cannot be read, is empty or is not printable ASCII, or when the header is one gRPC
    keeps to itself."""
    out = []
    for i, block in enumerate(blocks):
        where = f"{key}[{i}]"
        if block.value_env is not None:
            value = os.environ.get(block.value_env)
            if value is None:
                raise ConfigError(f"{where}: environment variable {block.value_env} is not set")
        elif block.value_file is not None:
            try:
                value = Path(block.value_file).read_text().rstrip("\r\n")
            except OSError as e:
                raise ConfigError(
                    f"{where}: cannot read value_file {block.value_file}: {e.strerror}"
                ) from None
        else:
            value = block.value
        if not value:
            raise ConfigError(f"{where}: the header value is empty")
        if not (value.isascii() and value.isprintable()):
            raise ConfigError(
                f"{where}: the header value must be printable ASCII (all gRPC metadata may "
                "carry; no client could send another)"
            )
        if block.header.encode() in NOT_METADATA or metadata_problem(block.header, value):
            raise ConfigError(
                f"{where}.header: {block.header!r} is a header gRPC itself sets, never a "
                "call's metadata: choose another name"
            )
        out.append(Restriction(frozenset(block.protocols), block.header, value))
    return out
