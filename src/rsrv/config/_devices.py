"""Which device each worker of a node uses (specs/config.md, Devices)."""

from __future__ import annotations

import re

from ._errors import ConfigError
from ._schema import NodeConfig, WorkerEntry

__all__ = ["assign_gpu", "device_ordinals"]


def device_ordinals(node: NodeConfig, where: str) -> list[int] | None:
    """`gpus` as device ordinals; None for "auto" (every visible device)."""
    gpus = node.gpus
    if gpus == "auto":
        return None
    if isinstance(gpus, int):
        return list(range(gpus))
    ordinals = []
    for i, item in enumerate(gpus):
        if isinstance(item, str):
            match = re.fullmatch(r"\s*(?:cuda:)?(\d+)\s*", item)
            if match is None:
                raise ConfigError(
                    f"{where}: $.gpus[{i}]: {item!r} is not a device ordinal (N or cuda:N)"
                )
            item = int(match.group(1))
        ordinals.append(item)
    return ordinals


def assign_gpu(
    node: NodeConfig, entry: WorkerEntry, index: int, backend: str, here: str, where: str
) -> int | None:
    """The device ordinal worker ``entry`` (number ``index``) uses; None on CPU."""
    if backend == "cpu":
        return None
    ordinals = device_ordinals(node, where)
    if entry.gpu is not None:
        if ordinals is not None and entry.gpu not in ordinals:
            raise ConfigError(f"{here}: gpu {entry.gpu} is not among gpus {ordinals}")
        return entry.gpu
    if ordinals is None:
        return index
    if not ordinals:
        raise ConfigError(f"{here}: backend {backend!r} but gpus is 0")
    # More workers than devices: they share devices round-robin.
    return ordinals[index % len(ordinals)]
