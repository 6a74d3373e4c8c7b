"""Bundles: the manifest schema, the model.py DSL, the file formats a bundle holds
(StableHLO modules, safetensors weights), loading and repository discovery."""

from rsrv.bundle._dsl import Hook, meta, postprocess, preprocess
from rsrv.bundle._loader import (
    UNBATCHED,
    Bundle,
    Hooks,
    defines_bundle,
    find_manifest,
    load_bundle,
)
from rsrv.bundle._manifest import (
    BATCH_LETTER,
    FORMAT_VERSION,
    MANIFEST_NAMES,
    Batching,
    Manifest,
    Signature,
    Tensor,
    TensorSpec,
    decode_manifest,
    resolve_manifest,
    rows_mismatch,
)
from rsrv.bundle._repository import (
    discover,
    has_manifest,
    is_model_name,
    model_versions,
    scan,
    version_policy_of,
)
from rsrv.bundle._safetensors import (
    ORDER_KEY,
    WeightInfo,
    WeightsFile,
    file_identity,
    read_weights_header,
)
from rsrv.bundle._stablehlo import ArgType, ModuleSignature, read_module, read_signature

__all__ = [
    "BATCH_LETTER", "FORMAT_VERSION", "MANIFEST_NAMES", "ORDER_KEY", "UNBATCHED", "ArgType",
    "Batching", "Bundle", "Hook", "Hooks", "Manifest", "ModuleSignature", "Signature", "Tensor",
    "TensorSpec", "WeightInfo", "WeightsFile", "decode_manifest", "defines_bundle", "discover",
    "file_identity", "find_manifest", "has_manifest", "is_model_name", "load_bundle", "meta",
    "model_versions", "postprocess",
    "preprocess", "read_module", "read_signature", "read_weights_header", "resolve_manifest",
    "rows_mismatch", "scan", "version_policy_of",
]  # fmt: skip
