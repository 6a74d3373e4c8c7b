"""What the scheduler is told about a model: :class:`ModelSpec`."""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rsrv.config import MAX_WEIGHT, MIN_WEIGHT
from rsrv.errors import InvalidArgument
from rsrv.scheduler._batching import rows_of, signature

if TYPE_CHECKING:
    from rsrv.config import ModelSchedConfig


def check_weight(weight: float, where: str) -> float:
    """``weight`` as a float if it is a valid fair-share weight, else InvalidArgument."""
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # also refuses NaN
        raise InvalidArgument(
            f"{where}: weight must be between {MIN_WEIGHT:g} and {MAX_WEIGHT:g}, got {weight}"
        )
    return float(weight)


def check_rows(name: str, rows: int, batch_sizes: Sequence[int], max_rows: int) -> None:
    """InvalidArgument when a request of ``rows`` rows cannot run on model ``name``,
    compiled at ``batch_sizes`` (ascending, not empty), whose requests hold at most
    ``max_rows``."""
    largest = batch_sizes[-1]
    if rows > largest:
        raise InvalidArgument(
            f"model {name!r}: a request of {rows} rows exceeds the largest compiled "
            f"batch size {largest} (compiled sizes: {list(batch_sizes)})"
        )
    if rows > max_rows:
        raise InvalidArgument(
            f"model {name!r}: a request of {rows} rows exceeds max_batch_size {max_rows}"
        )


@dataclass(frozen=True)
class ModelSpec:
    """What the scheduler needs to know about one version of a model.

    ``batch_sizes`` are the compiled sizes (stored ascending); ``()`` marks an
    unbatched model, whose requests are never coalesced and run with batch size 0.
    ``input_axes`` / ``output_axes`` give, per executable tensor and in order, the
    row-major batch axis (all ints for a batched model, all None for an unbatched
    one). ``max_batch_size`` caps the rows of one dispatch (None: the largest
    compiled size); ``latency_budget`` is a target queue-plus-compute time in
    seconds (see specs/scheduler.md). ``executable`` is the name passed to the
    executor (default: ``name``); giving each version its own (e.g. ``"m@3"``) lets
    requests queued before a replacement run on the version they were queued for.
    ``version`` labels the version among those of the same name served side by side
    (a request names the label it is for; see :meth:`Scheduler.add_model`).
    ``max_queue_delay`` is how long, in seconds, a batch smaller than ``max_rows`` may
    wait for more requests (None: the scheduler's ``max_queue_delay_seconds``; 0:
    dispatch at once; specs/scheduler.md, Queue delay).

    Construction validates the fields and raises InvalidArgument naming the fault.
    """

    name: str
    batch_sizes: tuple[int, ...]
    input_axes: tuple[int | None, ...]
    output_axes: tuple[int | None, ...]
    weight: float = 1.0
    max_batch_size: int | None = None
    latency_budget: float | None = None
    executable: str | None = None
    version: str = ""
    max_queue_delay: float | None = None

    def __post_init__(self) -> None:
        sizes = tuple(sorted(int(s) for s in self.batch_sizes))
        object.__setattr__(self, "batch_sizes", sizes)
        object.__setattr__(self, "input_axes", tuple(self.input_axes))
        object.__setattr__(self, "output_axes", tuple(self.output_axes))
        where = f"model {self.name!r}"
        if any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
            raise InvalidArgument(
                f"{where}: compiled batch sizes must be distinct and positive, got {list(sizes)}"
            )
        axes = self.input_axes + self.output_axes
        if sizes and not self.input_axes:
            raise InvalidArgument(f"{where}: a batched model needs at least one executable input")
        if sizes and any(a is None or a < 0 for a in axes):
            raise InvalidArgument(
                f"{where}: a batched model needs a batch axis >= 0 on every "
                f"executable tensor, got inputs {list(self.input_axes)}, "
                f"outputs {list(self.output_axes)}"
            )
        if not sizes and any(a is not None for a in axes):
            raise InvalidArgument(
                f"{where}: an unbatched model (no compiled batch sizes) cannot have batch axes"
            )
        check_weight(self.weight, where)
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise InvalidArgument(
                f"{where}: max_batch_size must be >= 1, got {self.max_batch_size}"
            )
        if self.latency_budget is not None and not self.latency_budget > 0:
            raise InvalidArgument(
                f"{where}: latency_budget must be positive, got {self.latency_budget}"
            )
        delay = self.max_queue_delay
        if delay is not None and not (delay >= 0 and math.isfinite(delay)):
            raise InvalidArgument(
                f"{where}: max_queue_delay must be a finite number of seconds >= 0, got {delay}"
            )

    @property
    def batched(self) -> bool:
        return bool(self.batch_sizes)

    @property
    def key(self) -> str:
        """The name the executor receives."""
        return self.executable or self.name

    @property
    def max_rows(self) -> int:
        """Effective max batch size: rows one dispatch (and so one request) may hold.

        ``min(max_batch_size, largest compiled size)``; 0 for an unbatched model.
        """
        if not self.batch_sizes:
            return 0
        largest = self.batch_sizes[-1]
        return min(self.max_batch_size, largest) if self.max_batch_size else largest

    def size_for(self, rows: int) -> int:
        """The smallest compiled size holding ``rows`` rows (0 when unbatched)."""
        if not self.batch_sizes:
            return 0
        i = bisect_left(self.batch_sizes, rows)
        return self.batch_sizes[min(i, len(self.batch_sizes) - 1)]

    def check_inputs(self, arrays: list, rows: int | None, name: str) -> tuple[tuple, int]:
        """The input signature and rows (0 when unbatched) of one request's executable
        inputs; InvalidArgument when they do not fit this version (their count, a
        disagreement on rows, ``rows`` if given, more rows than a batch holds)."""
        if len(arrays) != len(self.input_axes):
            raise InvalidArgument(
                f"model {name!r} takes {len(self.input_axes)} executable inputs, got {len(arrays)}"
            )
        sig = signature(arrays, self.input_axes, name)
        if not self.batched:
            return sig, 0
        n = rows_of(arrays, self.input_axes, name)
        if rows is not None and rows != n:
            raise InvalidArgument(f"model {name!r}: rows={rows} but the inputs have {n} rows")
        check_rows(name, n, self.batch_sizes, self.max_rows)
        return sig, n

    def with_policy(self, policy: ModelSchedConfig | None) -> ModelSpec:
        """This spec with the configured weight, max_batch_size, latency budget and
        queue delay (``scheduler.models.<name>``) laid over it; unset config fields keep
        ours."""
        if policy is None:
            return self
        changes: dict[str, object] = {"weight": policy.weight}
        if policy.max_batch_size is not None:
            changes["max_batch_size"] = policy.max_batch_size
        if policy.latency_budget_seconds is not None:
            changes["latency_budget"] = policy.latency_budget_seconds
        if policy.max_queue_delay_seconds is not None:
            changes["max_queue_delay"] = policy.max_queue_delay_seconds
        return dataclasses.replace(self, **changes)
