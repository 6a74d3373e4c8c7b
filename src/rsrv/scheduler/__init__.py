"""Dispatch engine: per-model queues, fair / fifo / edf selection, and batch
coalescing at compiled sizes, over a transport-agnostic :class:`Executor`.

Formulas and rules: specs/scheduler.md.
"""

from rsrv.scheduler.scheduler import Scheduler
from rsrv.scheduler.spec import Executor, ModelSpec, Result
from rsrv.scheduler.stats import ModelStats

__all__ = ["Executor", "ModelSpec", "ModelStats", "Result", "Scheduler"]
