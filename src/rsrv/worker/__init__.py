"""The worker process (``rsrv serve``): models, the inference pipeline, the task tree."""

from rsrv.worker.app import Worker
from rsrv.worker.main import serve_main
from rsrv.worker.models import ModelSet, ModelState, ServedModel

__all__ = ["ModelSet", "ModelState", "ServedModel", "Worker", "serve_main"]
