"""rsrv: serve many compiled StableHLO models per accelerator over KServe V2 / Triton gRPC.

The names exported here are the bundle DSL used by a bundle's ``model.py``.
"""

from rsrv.bundle import Hook, meta, postprocess, preprocess

__version__ = "0.1.0"
__all__ = ["Hook", "__version__", "meta", "postprocess", "preprocess"]
