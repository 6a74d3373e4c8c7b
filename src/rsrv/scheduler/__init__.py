"""Dispatch engine: per-model queues, fair / fifo / edf selection, and batch
coalescing at compiled sizes, over a transport-agnostic :class:`Executor`.

Formulas and rules: specs/scheduler.md.
"""

from rsrv.scheduler._executor import Executor, Result
from rsrv.scheduler._scheduler import PinnedVersion, Scheduler
from rsrv.scheduler._spec import ModelSpec, check_rows, check_weight
from rsrv.scheduler._stats import SchedulingCounters, SchedulingStats, VersionStats

__all__ = [
    "Executor",
    "ModelSpec",
    "PinnedVersion",
    "Result",
    "Scheduler",
    "SchedulingCounters",
    "SchedulingStats",
    "VersionStats",
    "check_rows",
    "check_weight",
]
