"""Which devices a node has, and which one each worker uses (specs/node.md, Devices).

A device is named as ``CUDA_VISIBLE_DEVICES`` names it: an ordinal (``"3"``) or a UUID
(``"GPU-..."``, ``"MIG-..."``). The node's devices come from the first of:

1. ``INFERENCE_SERVER_GPUS``: a count (``"2"``: the first two devices this process was
   given, by ``CUDA_VISIBLE_DEVICES``, else ordinals 0 and 1; ``"0"``: none) or a
   comma-separated list of ordinals and UUIDs;
2. the node file's ``gpus`` when it is not ``auto``: a count (as above) or a list;
3. an existing ``CUDA_VISIBLE_DEVICES`` (the devices this process was given);
4. ``nvidia-smi --query-gpu=index --format=csv,noheader``;
5. ``/dev/nvidia<N>`` device files.

Worker i uses device i, or device ``gpu`` when its entry sets one. Two workers on one
device, a ``gpu`` beyond the list, and more workers than devices are errors naming the
workers. A cpu backend uses no device.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from ._env import GPUS_VARIABLE
from ._errors import ConfigError
from ._schema import DEVICE_ORDINAL, DEVICE_UUID, NodeConfig

__all__ = ["assign_devices", "detect_devices", "file_devices", "parse_device"]

_ORDINAL, _UUID = re.compile(DEVICE_ORDINAL), re.compile(DEVICE_UUID)
_DEVFS = re.compile(r"nvidia(\d+)")


def parse_device(item: int | str) -> str | None:
    """``item`` as a device name (``"3"``, ``"GPU-..."``), or None if it names none."""
    if isinstance(item, int):
        return str(item) if item >= 0 else None
    text = item.strip()
    if match := _ORDINAL.fullmatch(text):
        return str(int(match.group(1)))
    if _UUID.fullmatch(text):
        return text
    return None


def _listed(items: Sequence[int | str], what: str) -> list[str]:
    devices = []
    for i, item in enumerate(items):
        device = parse_device(item)
        if device is None:
            raise ConfigError(
                f"{what}[{i}]: {item!r} is not a device (an ordinal N or cuda:N, or a "
                "GPU-/MIG- UUID)"
            )
        devices.append(device)
    if len(set(devices)) != len(devices):
        raise ConfigError(f"{what}: a device appears twice in {list(items)}")
    return devices


def file_devices(node: NodeConfig, where: str) -> list[str]:
    """The node file's ``gpus`` list as device names (ConfigError when malformed)."""
    assert isinstance(node.gpus, list)
    return _listed(node.gpus, f"{where}: $.gpus")


def _visible(env: Mapping[str, str]) -> list[str] | None:
    """The devices this process was given by ``CUDA_VISIBLE_DEVICES``; None without it."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    items = [v for v in visible.split(",") if v.strip()]
    for i, item in enumerate(items):  # CUDA's list ends at -1 (the usual "hide every GPU")
        if _HIDDEN.fullmatch(item.strip()):
            items = items[:i]
            break
    return _listed(items, "CUDA_VISIBLE_DEVICES")


#: A CUDA_VISIBLE_DEVICES entry that ends the list, as CUDA reads it: a negative ordinal,
#: or NoDevFiles (what some schedulers set when a job has no GPU).
_HIDDEN = re.compile(r"-[0-9]+|NoDevFiles")


def _counted(count: int, env: Mapping[str, str], what: str) -> list[str]:
    """``count`` devices: the first of those this process was given, ordinals 0.. when
    it was given none (under a scheduler that hands out GPUs 4 and 5, a count of 2
    means those two, never another job's 0 and 1)."""
    if count == 0:
        return []
    visible = _visible(env)
    if visible is None:
        return [str(i) for i in range(count)]
    if count > len(visible):
        raise ConfigError(
            f"{what}: {count} devices, but CUDA_VISIBLE_DEVICES gives this process "
            f"{len(visible)} ({','.join(visible) or 'none'})"
        )
    return visible[:count]


def detect_devices(
    node: NodeConfig, env: Mapping[str, str], where: str, *, devfs: str = "/dev"
) -> tuple[list[str], str]:
    """The node's devices and where they came from (the module docstring's order).

    ``env`` supplies INFERENCE_SERVER_GPUS, CUDA_VISIBLE_DEVICES and the PATH searched
    for nvidia-smi. Raises ConfigError for a malformed list.
    """
    text = env.get(GPUS_VARIABLE)
    if text is not None:
        text = text.strip()
        if text.isascii() and text.isdigit():
            return _counted(int(text), env, GPUS_VARIABLE), GPUS_VARIABLE
        if not text:
            raise ConfigError(f"{GPUS_VARIABLE} is empty: give a count or a list of devices")
        return _listed(text.split(","), GPUS_VARIABLE), GPUS_VARIABLE
    gpus = node.gpus
    if isinstance(gpus, int):
        return _counted(gpus, env, f"{where}: $.gpus"), "gpus"
    if isinstance(gpus, list):
        return file_devices(node, where), "gpus"
    visible = _visible(env)
    if visible is not None:
        return visible, "CUDA_VISIBLE_DEVICES"
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if smi is not None:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=index", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
            return [line.strip() for line in out.splitlines() if line.strip()], "nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            pass  # a broken nvidia-smi: try the device files
    try:
        names = os.listdir(devfs)
    except OSError:
        names = []
    ordinals = sorted(int(m.group(1)) for n in names if (m := _DEVFS.fullmatch(n)))
    return [str(i) for i in ordinals], f"{devfs}/nvidia*"


def assign_devices(
    names: Sequence[str], gpus: Sequence[int | None], devices: Sequence[str], where: str
) -> list[str]:
    """The device of each worker: ``devices[gpu]``, or ``devices[i]`` for worker i.

    Raises ConfigError naming the workers when two share a device, a ``gpu`` is out of
    range, or there are more workers than devices.
    """
    if len(names) > len(devices) and any(g is None for g in gpus):
        raise ConfigError(
            f"{where}: {len(names)} workers ({', '.join(names)}) but {len(devices)} "
            f"device(s) ({', '.join(devices) or 'none'}): one worker per device"
        )
    assigned: list[str] = []
    owner: dict[str, str] = {}
    for i, (name, gpu) in enumerate(zip(names, gpus, strict=True)):
        index = i if gpu is None else gpu
        if index >= len(devices):
            raise ConfigError(
                f"{where}: worker {name!r}: gpu {index} is out of range: the node has "
                f"{len(devices)} device(s) ({', '.join(devices) or 'none'})"
            )
        device = devices[index]
        if device in owner:
            raise ConfigError(
                f"{where}: workers {owner[device]!r} and {name!r} are both on device "
                f"{device}: one worker per device"
            )
        owner[device] = name
        assigned.append(device)
    return assigned
