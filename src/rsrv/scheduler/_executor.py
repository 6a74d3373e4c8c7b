"""The scheduler's view of the device (:class:`Executor`) and what a request gets back
(:class:`Result`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Executor(Protocol):
    """Runs one batch on the device; the scheduler calls it one batch at a time.

    ``execute`` receives the executable inputs of a whole batch, already padded to
    ``batch_size`` rows along each input's batch axis (``batch_size`` 0 for an
    unbatched model), and returns the executable outputs, each with ``batch_size``
    rows along its batch axis. The returned arrays belong to the scheduler from then
    on (it hands out views of them), so an executor must not reuse their memory.
    An exception fails every request of the batch: an ``RsrvError`` as is, any other
    as ``Internal`` carrying its message.

    Three optional methods are used when present:

    * ``async def prefetch(self, model: str) -> None``: started in the background,
      while a batch executes, for the model that the scheduler expects to run next
      (e.g. to start moving its weights to the device). Its errors are logged only.
    * ``def retire(self, model: str) -> None``: a version that was replaced or
      removed has no queued or executing request left, so whatever ``execute``
      needs for that name can go. Never called for a name that a registered model's
      current version uses.
    * ``def measured_seconds(self, model: str, batch_size: int) -> float | None``:
      the device time of the last execution of ``model`` at ``batch_size``, measured
      apart from what ``execute`` waited for (the device, weights being copied); the
      cost estimates learn it instead of ``execute``'s wall time, which still counts
      as the model's device usage.

    ``model`` is :attr:`ModelSpec.key`: the model name, unless the spec names its
    executable (see there).
    """

    async def execute(
        self, model: str, batch_size: int, inputs: list[np.ndarray]
    ) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class Result:
    """One request's answer."""

    outputs: list[np.ndarray]  # this request's executable outputs, padding removed
    queue_seconds: float  # enqueue -> dispatch start
    compute_seconds: float  # the batch's execute() wall time, shared by its requests
    batch_size: int  # compiled size used (0: unbatched)
