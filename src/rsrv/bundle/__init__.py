"""Bundles: the manifest schema, the model.py DSL, loading and repository discovery."""

from rsrv.bundle.dsl import Hook, meta, postprocess, preprocess
from rsrv.bundle.loader import UNBATCHED, Bundle, Hooks, load_bundle
from rsrv.bundle.manifest import Manifest, Signature, Tensor, TensorSpec
from rsrv.bundle.repository import discover, scan

__all__ = [
    "UNBATCHED", "Bundle", "Hook", "Hooks", "Manifest", "Signature", "Tensor", "TensorSpec",
    "discover", "load_bundle", "meta", "postprocess", "preprocess", "scan",
]  # fmt: skip
