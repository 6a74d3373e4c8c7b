"""Scheduler decision time versus the number of registered models.

A decision is what the dispatch loop does between two executions: select the
next model and plan its batch (``Scheduler._next_batch``). Execution is not
run: after each decision the batch is answered at once, charged its learned
cost, and its model is refilled, so the backlog stays constant.

    python benchmarks/scheduler_decision.py

Prints microseconds per decision (mean and median) for 10, 1,000 and 10,000
registered models, with 10% and 100% of them backlogged, under each discipline,
next to what a single pass over all registered models would cost.
Runs in well under 30 s; importing it runs nothing.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import numpy as np

from rsrv.config._schema import SchedulerConfig
from rsrv.scheduler import ModelSpec, Result, Scheduler

MODEL_COUNTS = (10, 1_000, 10_000)
BACKLOGGED = (0.1, 1.0)
DISCIPLINES = ("fair", "fifo", "edf")
DECISIONS = 1_000
DEPTH = 4  # one-row requests queued per backlogged model


class NoExecutor:
    async def execute(self, model, batch_size, inputs):  # never called here
        raise AssertionError("the benchmark does not execute")


def measure(
    discipline: str, n_models: int, fractions=BACKLOGGED, seed: int = 0
) -> list[list[float]]:
    """Seconds of each decision, per backlogged fraction (ascending; the backlog of
    one fraction is topped up for the next, on the same registered models)."""
    rng = random.Random(seed)
    config = SchedulerConfig(discipline=discipline, dispatch_timeout_seconds=3600.0)
    sched = Scheduler(config, NoExecutor(), clock=time.perf_counter)
    names = [f"m{i}" for i in range(n_models)]
    for i, name in enumerate(names):
        sched.add_model(
            ModelSpec(
                name,
                (1, 4, 8),
                (0,),
                (0,),
                weight=1.0 + i % 4,
                latency_budget=0.5 if i % 10 == 0 else None,
            )
        )
        sched.warm_costs(
            name, {1: 1e-3 * (1 + i % 7), 4: 2e-3 * (1 + i % 7), 8: 3e-3 * (1 + i % 7)}
        )
    x = np.zeros((1, 16), np.float32)

    def enqueue(name: str) -> None:
        deadline = time.perf_counter() + rng.uniform(60, 120) if discipline == "edf" else None
        sched._admit(name, [x], deadline, None, False)

    rng.shuffle(names)
    backlogged = 0
    results = []
    for fraction in fractions:
        target = max(1, int(n_models * fraction))
        for name in names[backlogged:target]:
            for _ in range(DEPTH):
                enqueue(name)
        backlogged = target
        results.append(decide(sched, enqueue))
    results.append([full_scan(sched)])
    return results


def full_scan(sched: Scheduler, repeats: int = 20) -> float:
    """Contrast: seconds for one pass over every registered model computing a fair
    key, what a per-decision scan would cost at the least."""
    states = list(sched._models.values())
    start = time.perf_counter()
    for _ in range(repeats):
        min(states, key=lambda m: m.tag + m.version.costs.estimate(8) / m.weight)
    return (time.perf_counter() - start) / repeats


def decide(sched: Scheduler, enqueue) -> list[float]:
    """Time DECISIONS decisions; answer each batch at once and refill its model."""
    times = []
    gc.collect()
    gc.disable()  # collector pauses are not decision time
    try:
        for _ in range(DECISIONS):
            start = time.perf_counter()
            batch = sched._next_batch()
            times.append(time.perf_counter() - start)
            assert batch is not None
            sched._account(batch, batch.estimate, ok=True)
            for req in batch.requests:
                sched._settle(req, result=Result([], 0.0, batch.estimate, batch.size))
                enqueue(batch.model.name)
    finally:
        gc.enable()
    return times


def main() -> None:
    print(
        f"scheduler decision time (select + plan), {DECISIONS} decisions each, "
        f"{DEPTH} one-row requests per backlogged model; microseconds, mean / median\n"
    )
    header = (
        f"{'discipline':<11}{'models':>8}"
        + "".join(f"{f'{int(f * 100)}% backlogged':>22}" for f in BACKLOGGED)
        + f"{'(full scan)':>14}"
    )
    print(header)
    print("-" * len(header))
    for discipline in DISCIPLINES:
        for n in MODEL_COUNTS:
            *decisions, (scan,) = measure(discipline, n)
            cells = ""
            for times in decisions:
                mean, median = statistics.fmean(times) * 1e6, statistics.median(times) * 1e6
                cells += f"{f'{mean:.1f} / {median:.1f}':>22}"
            print(f"{discipline:<11}{n:>8}{cells}{scan * 1e6:>14.1f}")
    print(
        "\n(full scan): one pass over all registered models computing a fair key, for "
        "contrast;\nthe scheduler never does this per decision."
    )


if __name__ == "__main__":
    main()
