"""The worker process (``rsrv serve``): models, the inference pipeline, the task tree."""

from rsrv.worker._main import serve_main
from rsrv.worker._models import LoadState, ModelSet, ServedModel
from rsrv.worker._worker import Worker

__all__ = ["LoadState", "ModelSet", "ServedModel", "Worker", "serve_main"]
