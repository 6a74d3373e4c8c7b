"""Triton's ModelConfig: derived from a manifest, and RepositoryModelLoad's overrides.

:func:`model_config` is what ModelConfig reports for one loaded version.
:func:`load_parameters` reads RepositoryModelLoad's ``parameters``: a ``config`` JSON
override (the subset that maps to rsrv settings; every other field must equal what rsrv
derives) and ``file:<path>`` contents. The rules are in specs/protocol.md §2.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from rsrv.bundle import Bundle, Tensor
from rsrv.errors import InvalidArgument
from rsrv.protocol._backend import LoadOverride
from rsrv.protocol.generated.inference import model_config_pb2 as mc
from rsrv.versions import VersionPolicy

__all__ = ["APPLIED", "DERIVED", "FILE_PREFIX", "load_parameters", "model_config"]

#: Config override fields that change a setting (specs/protocol.md §2).
APPLIED = ("name", "max_batch_size", "version_policy", "dynamic_batching")
#: Fields rsrv derives from the bundle: an override may repeat them, not change them.
DERIVED = ("platform", "backend", "input", "output", "parameters")
#: RepositoryModelLoad parameters naming a file's contents (Triton's prefix).
FILE_PREFIX = "file:"
#: The largest dynamic_batching.max_queue_delay_microseconds an override may set: the
#: bound of scheduler.models.<name>.max_queue_delay_seconds (1 s, specs/config.md).
MAX_QUEUE_DELAY_US = 1_000_000
#: dynamic_batching fields an override may give (the others are refused).
_BATCHING = ("preferred_batch_size", "max_queue_delay_microseconds")

_FORMATS = {
    "chw": mc.ModelInput.FORMAT_NCHW,
    "hwc": mc.ModelInput.FORMAT_NHWC,
}


def model_config(
    bundle: Bundle,
    platform: str,
    max_batch_size: int,
    policy: VersionPolicy,
    max_queue_delay: float = 0.0,
) -> mc.ModelConfig:
    """A Triton ModelConfig of one version, derived from its manifest, with the
    scheduler's queue delay (seconds) as ``dynamic_batching.max_queue_delay_microseconds``.

    Triton's config has an implicit *leading* batch axis: when every client tensor has
    its batch letter first, ``max_batch_size`` is the scheduler's cap and dims omit that
    axis; otherwise ``max_batch_size`` is 0 and dims show the batch axis as -1. An input
    whose other axes are ``chw`` / ``hwc`` has format FORMAT_NCHW / FORMAT_NHWC.
    """
    sig = bundle.signature
    tensors = sig.client_inputs + sig.client_outputs
    leading = bool(bundle.batch_sizes) and all(t.batch_axis == 0 for t in tensors)

    def dims(t: Tensor) -> list[int]:
        return list(t.shape[1:]) if leading else list(t.shape)

    def dtype(t: Tensor) -> int:
        name = "TYPE_STRING" if t.dtype.kserve == "BYTES" else f"TYPE_{t.dtype.kserve}"
        return mc.DataType.Value(name)

    def image_format(t: Tensor) -> int:
        letters = t.letters[1:] if leading else t.letters
        if not leading and t.batch_axis is not None:
            return mc.ModelInput.FORMAT_NONE
        return _FORMATS.get(letters, mc.ModelInput.FORMAT_NONE)

    config = mc.ModelConfig(
        name=bundle.name,
        platform=f"rsrv_stablehlo_{platform}",
        backend="rsrv",
        max_batch_size=max_batch_size if leading else 0,
        input=[
            mc.ModelInput(name=t.name, data_type=dtype(t), format=image_format(t), dims=dims(t))
            for t in sig.client_inputs
        ],
        output=[
            mc.ModelOutput(name=t.name, data_type=dtype(t), dims=dims(t))
            for t in sig.client_outputs
        ],
        version_policy=_policy_message(policy),
    )
    if bundle.batch_sizes:
        cap = max_batch_size or bundle.batch_sizes[-1]
        config.dynamic_batching.preferred_batch_size.extend(
            n for n in bundle.batch_sizes if n <= cap
        )
        config.dynamic_batching.max_queue_delay_microseconds = round(max_queue_delay * 1e6)
    for key, value in _parameters(bundle).items():
        config.parameters[key].string_value = value
    return config


def _policy_message(policy: VersionPolicy) -> mc.ModelVersionPolicy:
    if policy.all:
        return mc.ModelVersionPolicy(all=mc.ModelVersionPolicy.All())
    if policy.specific is not None:
        return mc.ModelVersionPolicy(
            specific=mc.ModelVersionPolicy.Specific(versions=sorted(policy.specific))
        )
    return mc.ModelVersionPolicy(
        latest=mc.ModelVersionPolicy.Latest(num_versions=policy.latest or 1)
    )


def _parameters(bundle: Bundle) -> dict[str, str]:
    """What else the manifest says: kind, compiled sizes, description, provenance."""
    manifest = bundle.manifest
    out = {"kind": bundle.kind}
    if bundle.batch_sizes:
        out["compiled_batch_sizes"] = ",".join(map(str, bundle.batch_sizes))
    if manifest.description:
        out["description"] = manifest.description
    for key, value in sorted(manifest.provenance.items()):
        out[f"provenance.{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


# -- RepositoryModelLoad parameters ---------------------------------------------------------


def load_parameters(
    name: str, parameters: Mapping[str, Any], platform: str
) -> tuple[LoadOverride | None, dict[str, bytes]]:
    """RepositoryModelLoad's ``parameters``: the config override, if any, and the
    ``file:`` contents by path. INVALID_ARGUMENT for anything else, and for a config
    field rsrv cannot apply (named)."""
    override = None
    files: dict[str, bytes] = {}
    for key in sorted(parameters):
        value = parameters[key]
        kind = value.WhichOneof("parameter_choice")
        if key == "config" and kind == "string_param":
            override = _config_override(name, value.string_param, platform)
        elif key.startswith(FILE_PREFIX) and kind == "bytes_param":
            files[key[len(FILE_PREFIX) :]] = value.bytes_param
        else:  # Triton's words (model_repository_manager.cc)
            raise InvalidArgument(
                f"Unrecognized load parameter '{key}' with type '{kind or 'none'}' (rsrv "
                f"accepts config as a string and {FILE_PREFIX}<path> as bytes)"
            )
    return override, files


def _config_override(name: str, text: str, platform: str) -> LoadOverride:
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
        config = json_format.ParseDict(raw, mc.ModelConfig())
    except (ValueError, json_format.ParseError) as e:
        raise InvalidArgument(f"Invalid config override: {e}") from None
    fields = mc.ModelConfig.DESCRIPTOR.fields_by_name
    by_json = {f.json_name: f.name for f in mc.ModelConfig.DESCRIPTOR.fields}
    given = [k if k in fields else by_json[k] for k in raw]  # ParseDict knew them all
    unsupported = [f for f in given if f not in APPLIED + DERIVED]
    if unsupported:
        raise InvalidArgument(
            f"config override for {name!r}: field {unsupported[0]!r} is not supported by "
            f"rsrv (it may set {', '.join(APPLIED)}, and repeat {', '.join(DERIVED)} as "
            "ModelConfig reports them)"
        )
    if "name" in given and config.name != name:
        raise InvalidArgument(
            f"config override for {name!r}: field 'name' is {config.name!r}; a config "
            "cannot rename the model"
        )
    max_batch_size = config.max_batch_size if "max_batch_size" in given else None
    if max_batch_size is not None and max_batch_size < 0:
        raise InvalidArgument(
            f"config override for {name!r}: field 'max_batch_size' must be >= 0, "
            f"got {max_batch_size}"
        )
    policy = _policy_of(name, config) if "version_policy" in given else None
    preferred: list[int] | None = None
    delay: float | None = None
    if "dynamic_batching" in given:
        batching = config.dynamic_batching
        extra = [f.name for f, _ in batching.ListFields() if f.name not in _BATCHING]
        if extra:
            raise InvalidArgument(
                f"config override for {name!r}: field 'dynamic_batching.{extra[0]}' is not "
                "supported by rsrv (requests are coalesced at the compiled batch sizes; "
                "only preferred_batch_size, as a subset of them, and "
                "max_queue_delay_microseconds may be given)"
            )
        preferred = list(batching.preferred_batch_size)
        if _given_delay(raw):  # also when 0, which ListFields does not show
            micros = batching.max_queue_delay_microseconds
            if micros > MAX_QUEUE_DELAY_US:
                raise InvalidArgument(
                    f"config override for {name!r}: field "
                    f"'dynamic_batching.max_queue_delay_microseconds' must be at most "
                    f"{MAX_QUEUE_DELAY_US} (1 s), got {micros}"
                )
            delay = micros / 1e6
    derived = [f for f in given if f in DERIVED]

    def check(bundle: Bundle, rows: int, served: VersionPolicy) -> None:
        if delay and not bundle.batch_sizes:
            raise InvalidArgument(
                f"config override for {name!r}: dynamic_batching.max_queue_delay_microseconds "
                f"must be 0: {bundle.path} has no compiled batch sizes (it runs one request "
                "at a time)"
            )
        if preferred is not None:
            bad = sorted(set(preferred) - set(bundle.batch_sizes))
            if bad:
                raise InvalidArgument(
                    f"config override for {name!r}: dynamic_batching.preferred_batch_size "
                    f"{bad} not among the compiled batch sizes "
                    f"{list(bundle.batch_sizes)} of {bundle.path}"
                )
        ours = model_config(bundle, platform, rows, served)
        for field in derived:
            if _only(config, field) != _only(ours, field):
                raise InvalidArgument(
                    f"config override for {name!r}: field {field!r} differs from what rsrv "
                    f"derives from {bundle.manifest_path}; rsrv cannot change it (send it as "
                    "ModelConfig reports it, or leave it out)"
                )

    return LoadOverride(max_batch_size, policy, check, delay)


def _given_delay(raw: dict) -> bool:
    """Whether the override's JSON names dynamic_batching.max_queue_delay_microseconds
    (by its proto or its JSON name)."""
    batching = raw.get("dynamic_batching", raw.get("dynamicBatching"))
    return isinstance(batching, dict) and (
        "max_queue_delay_microseconds" in batching or "maxQueueDelayMicroseconds" in batching
    )


def _policy_of(name: str, config: mc.ModelConfig) -> VersionPolicy:
    message = config.version_policy
    choice = message.WhichOneof("policy_choice")
    where = f"config override for {name!r}: field 'version_policy'"
    if choice == "all":
        return VersionPolicy(all=True)
    if choice == "specific":
        versions = tuple(message.specific.versions)
        if not versions or min(versions) < 1:
            raise InvalidArgument(f"{where}: specific needs versions >= 1, got {list(versions)}")
        return VersionPolicy(specific=versions)
    if choice == "latest":
        if message.latest.num_versions < 1:
            raise InvalidArgument(f"{where}: latest.num_versions must be >= 1")
        return VersionPolicy(latest=message.latest.num_versions)
    raise InvalidArgument(f"{where}: give one of latest, all or specific")


def _only(config: mc.ModelConfig, field: str) -> mc.ModelConfig:
    """A ModelConfig holding only ``field`` of ``config``."""
    out = mc.ModelConfig()
    out.MergeFrom(config)
    for descriptor, _ in out.ListFields():
        if descriptor.name != field:
            out.ClearField(descriptor.name)
    return out
