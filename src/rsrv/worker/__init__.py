"""The worker process (``rsrv serve``): models, the inference pipeline, the task tree."""

from rsrv.worker._main import serve_main
from rsrv.worker._models import LoadState, ModelSet, ServedModel
from rsrv.worker._worker import Worker, restrictions_of

__all__ = ["LoadState", "ModelSet", "ServedModel", "Worker", "restrictions_of", "serve_main"]
