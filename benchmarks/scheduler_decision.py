"""Scheduler decision time versus the number of registered models.

A decision is what the dispatch loop does between two executions: select the
next model and plan its batch (``Scheduler._next_batch``). Execution is not
run: after each decision the batch is answered at once, charged its learned
cost, and its model is refilled, so the backlog stays constant.

    python benchmarks/scheduler_decision.py [--quick] [--out results/scheduler_decision.json]

Prints microseconds per decision (mean and median) for 10, 1,000 and 10,000
registered models, with 10% and 100% of them backlogged, under each discipline,
next to what a single pass over all registered models would cost, and writes them
to the JSON file. How it is measured: 1,000 decisions (``--quick``: 300) timed one
by one in each configuration, the configurations one after another (not
interleaved: there is no ratio between them to protect), the garbage collector
off while timing. Runs in well under 30 s; importing it runs nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

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
    discipline: str,
    n_models: int,
    fractions=BACKLOGGED,
    seed: int = 0,
    decisions: int = DECISIONS,
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
        results.append(decide(sched, enqueue, decisions))
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


def decide(sched: Scheduler, enqueue, decisions: int = DECISIONS) -> list[float]:
    """Time ``decisions`` decisions; answer each batch at once and refill its model."""
    times = []
    gc.collect()
    gc.disable()  # collector pauses are not decision time
    try:
        for _ in range(decisions):
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 decisions per configuration")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "results" / "scheduler_decision.json",
    )
    args = parser.parse_args(argv)
    decisions = 300 if args.quick else DECISIONS
    print(
        f"scheduler decision time (select + plan), {decisions} decisions each, "
        f"{DEPTH} one-row requests per backlogged model; microseconds, mean / median\n"
    )
    header = (
        f"{'discipline':<11}{'models':>8}"
        + "".join(f"{f'{int(f * 100)}% backlogged':>22}" for f in BACKLOGGED)
        + f"{'(full scan)':>14}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for discipline in DISCIPLINES:
        for n in MODEL_COUNTS:
            *measured, (scan,) = measure(discipline, n, decisions=decisions)
            row = {"discipline": discipline, "models": n, "full_scan_us": scan * 1e6}
            cells = ""
            for fraction, times in zip(BACKLOGGED, measured, strict=True):
                mean, median = statistics.fmean(times) * 1e6, statistics.median(times) * 1e6
                row[f"backlogged_{int(fraction * 100)}"] = {"mean_us": mean, "median_us": median}
                cells += f"{f'{mean:.1f} / {median:.1f}':>22}"
            rows.append(row)
            print(f"{discipline:<11}{n:>8}{cells}{scan * 1e6:>14.1f}")
    print(
        "\n(full scan): one pass over all registered models computing a fair key, for "
        "contrast;\nthe scheduler never does this per decision."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "decisions": decisions,
                "depth": DEPTH,
                "method": f"{decisions} decisions timed one by one per configuration, "
                "configurations one after another (not interleaved), gc off while timing; "
                "mean / median",
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
