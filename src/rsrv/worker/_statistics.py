"""Per-model request statistics in Triton's InferStatistics shape."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the request latency histogram: 1 ms doubling to ~8 s.
LATENCY_BUCKETS = tuple(0.001 * 2**k for k in range(14))


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)


@dataclass(slots=True)
class RequestStatistics:
    """Cumulative since load. Durations are per request; ``compute_infer`` is the batch's
    execution time attributed to each request in it (as Triton reports it)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0  # rows inferred successfully (each batch row counts)
    last_inference_ms: int = 0
    failures_by_status: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def record(self, ok: bool, seconds: float, status: str = "OK", rows: int = 0) -> None:
        (self.success if ok else self.fail).add(seconds)
        self.latency_counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds
        if ok:
            self.inference_count += rows
        else:
            self.failures_by_status[status] += 1
        self.last_inference_ms = int(time.time() * 1000)
