"""Cold-load time of a model's weights against the memcpy bound, and prefetch.

    python benchmarks/cold_load.py [--quick] [--out results/cold_load.json]

For each weight size (1, 4, 16, 64, 256, 512 MiB; ``--quick``: up to 64 MiB) a weights
file of that size is written (a few float32 tensors and a 12-byte one, so tensors sit at
the unaligned offsets safetensors gives them), then these are measured:

  memcpy     ``np.copyto`` of the same number of bytes into a preallocated buffer: the
             bound a host-to-device copy is compared with.
  system     a cold device load from the staged ``system`` host floor:
             ``to_device`` of ``place(stage(file), route)``, what the transfer task runs
             (``route``: the device's default staging route, pageable on CPU).
  system/WM  the same through the real ``WeightManager.lease`` (trio task, worker thread,
             cache bookkeeping), the weights evicted before each lease.
  unpinned   a cold load of an ``unpinned`` model: ``staging.stage`` (read the file into
             one aligned buffer) + ``to_device``; the file is in the page cache.
  unp/disk   the same with the file dropped from the page cache first (``fsync``, then
             ``posix_fadvise(DONTNEED)``, not timed): a read from the disk.
  naive      ``jax.device_put`` of the per-tensor arrays ``safetensors.numpy.load_file``
             returns (unaligned), what a simple implementation does; the file read
             itself is not included.

**Paired and interleaved**: each repetition times every column once, back to back, the
order rotating from one repetition to the next, so a disturbance from other work on a
shared machine lands on one repetition of every column rather than on one column. A
ratio is the median over repetitions of (column time / memcpy time of the same
repetition), with the lowest and highest in the JSON; a time is the best repetition. On
the CPU backend an aligned host array is adopted by PJRT without a copy, so ``system``
can beat the memcpy bound: no byte moves (the ``zero_copy`` column says whether that
happened).

Then prefetch: a real Scheduler + DeviceExecutor + WeightManager serve requests that
alternate between models whose weights do not all fit the budget, ``unpinned`` (a load
reads the file, so there is something to overlap on CPU), each execution taking about as
long as a load. Total time with the executor's prefetch against a subclass without it:

  * 2 models alternating, budget = 1 model: a prefetch would need both resident, so it
    is skipped (the budget is never exceeded) and both variants take the same time;
  * 3 models in turn, budget = 2 models: the next model loads while the current runs.

**Paired runs**: each pair runs the two variants back to back (which goes first
alternates from pair to pair); the speedup is the median of the per-pair ratios (total
without / total with), with the lowest and highest; totals are medians. Also the median
"lease wait": how long executions waited for their weights in all (the transfer time
prefetch did not hide), and "hidden", the share of the load time no execution waited
for.

Writes the figures to results/cold_load.json. Memory: about 7x the largest size at peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import trio
from common import drop_from_page_cache, rotated
from safetensors.numpy import load_file, save_file
from trio.testing import wait_all_tasks_blocked

from rsrv.bundle._safetensors import ORDER_KEY, read_weights_header
from rsrv.config._schema import SchedulerConfig
from rsrv.runtime._staging import free, place, stage, staging_route, to_device

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
SIZES = (1, 4, 16, 64, 256, 512)
QUICK_SIZES = (1, 4, 16, 64)


def best(fn, reps: int) -> float:
    """The best wall time of ``fn()`` over ``reps`` runs."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        if isinstance(result, list):
            free(result)
        del result
    return min(times)


def reps_for(nbytes: int) -> int:
    return 9 if nbytes <= 16 * MIB else 5 if nbytes <= 64 * MIB else 3


# -- the weights file ---------------------------------------------------------------------


def write_weights(path: Path, nbytes: int, seed: int = 0) -> None:
    """``nbytes`` of float32 weights in four tensors, plus a 12-byte tensor first in
    argument order; values seeded."""
    rng = np.random.default_rng(seed)
    parts = [nbytes // 2, nbytes // 4, nbytes // 8, nbytes // 8 - 12, 12]
    tensors = {f"t{i}": rng.random(n // 4, dtype=np.float32) for i, n in enumerate(parts)}
    order = ["t4", "t0", "t1", "t2", "t3"]
    save_file(tensors, str(path), metadata={ORDER_KEY: json.dumps(order)})


# -- per size -----------------------------------------------------------------------------

COLUMNS = ("memcpy", "system", "system_wm", "unpinned", "unpinned_disk", "naive")


def measure_size(mib: int, workdir: Path, device) -> dict:
    nbytes = mib * MIB
    path = workdir / f"w{mib}.safetensors"
    write_weights(path, nbytes)
    wf = read_weights_header(path)
    assert wf.nbytes == nbytes
    try:
        row = {"mib": mib, "bytes": nbytes, **trio.run(paired, wf, device, reps_for(nbytes))}
    finally:
        path.unlink()
        gc.collect()
    return row


async def paired(wf, device, reps: int) -> dict:
    """Every column once per repetition, back to back, the order rotating (see the
    module docstring); times: best repetition; ratios: median of per-repetition ratios
    to memcpy."""
    from rsrv.runtime._weight_manager import WeightManager

    src = np.random.default_rng(1).integers(0, 255, wf.nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the destination pages in
    start = time.perf_counter()
    host = place(stage(wf), staging_route(device), device)  # a system model's floor
    stage_s = time.perf_counter() - start
    probe = to_device(host, device)
    zero_copy = all(
        d.unsafe_buffer_pointer() == pointer(h) for h, d in zip(host.arrays, probe, strict=True)
    )
    free(probe)
    start = time.perf_counter()
    tensors = load_file(str(wf.path))
    arrays = [tensors[w.name] for w in wf.weights]  # what naive puts
    naive_read_s = time.perf_counter() - start

    def naive():
        on_device = jax.device_put(arrays, device)
        jax.block_until_ready(on_device)
        return on_device

    def unpinned_disk():
        drop_from_page_cache(wf.path, sync=True)
        start = time.perf_counter()
        free(to_device(stage(wf), device))
        return time.perf_counter() - start

    plain = {
        "memcpy": lambda: np.copyto(dst, src),
        "system": lambda: to_device(host, device),
        "unpinned": lambda: to_device(stage(wf), device),
        "naive": naive,
    }
    manager = WeightManager(wf.nbytes, device)
    times: dict[str, list[float]] = {c: [] for c in COLUMNS}
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await manager.add("m", wf, "system")

        async def timed(column: str) -> float:
            if column == "system_wm":
                manager.cache.evict("m")
                start = time.perf_counter()
                async with manager.lease("m"):
                    return time.perf_counter() - start
            if column == "unpinned_disk":
                return unpinned_disk()
            start = time.perf_counter()
            result = plain[column]()
            seconds = time.perf_counter() - start
            if isinstance(result, list):
                free(result)
            return seconds

        for column in COLUMNS:  # each once before anything is timed
            await timed(column)
        for rep in range(reps):
            for column in rotated(COLUMNS, rep):
                times[column].append(await timed(column))
        manager.remove("m")
        nursery.cancel_scope.cancel()
    row: dict = {
        "reps": reps,
        "stage_s": stage_s,
        "zero_copy": zero_copy,
        "naive_read_s": naive_read_s,
        "naive_aligned_bytes": sum(a.nbytes for a in arrays if a.ctypes.data % 64 == 0),
        "memcpy_s": min(times["memcpy"]),
    }
    for column in COLUMNS[1:]:
        ratios = [t / m for t, m in zip(times[column], times["memcpy"], strict=True)]
        row[f"{column}_s"] = min(times[column])
        row[f"{column}_ratio"] = statistics.median(ratios)
        row[f"{column}_ratios"] = [min(ratios), max(ratios)]
    return row


def pointer(a) -> int:
    """Where a host array's bytes are: a numpy buffer, or a pinned_host jax array."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.unsafe_buffer_pointer()


# -- prefetch -----------------------------------------------------------------------------


def export_models(workdir: Path, count: int, k: int, rows: int) -> list[Path]:
    """``count`` unbatched models y = tanh(x @ w), x f32[rows,k], w f32[k,k] (distinct)."""
    from rsrv.export import Input, export_jax

    paths = []
    for i in range(count):
        w = (np.random.default_rng(10 + i).standard_normal((k, k)) / np.sqrt(k)).astype(np.float32)
        paths.append(
            export_jax(
                lambda p, x: jnp.tanh(x @ p["w"]),
                {"w": w},
                inputs=[Input("x", np.float32, (rows, k))],
                outputs=["y"],
                batch_sizes=[],
                out_dir=workdir / "models" / f"p{i}",
            )
        )
    return paths


async def serve_sequence(served, budget: int, prefetch: bool, requests: int, x: np.ndarray) -> dict:
    """Run ``requests`` requests cycling through ``served`` on a fresh WeightManager,
    DeviceExecutor (with or without prefetch) and Scheduler; all weights cold."""
    from rsrv.runtime._weight_manager import WeightManager
    from rsrv.scheduler import Scheduler
    from rsrv.worker._executor import DeviceExecutor

    class NoPrefetch(DeviceExecutor):
        prefetch = None  # the scheduler looks the hook up and skips it when None

    weights = WeightManager(budget, jax.devices("cpu")[0])
    executor = (DeviceExecutor if prefetch else NoPrefetch)(weights)
    scheduler = Scheduler(
        SchedulerConfig(discipline="fifo", dispatch_timeout_seconds=600), executor
    )
    calls, waits = [], []
    lease = weights.lease

    @asynccontextmanager
    async def timed_lease(key):  # how long the dispatch path waits for weights
        start = time.perf_counter()
        async with lease(key) as arrays:
            waits.append(time.perf_counter() - start)
            yield arrays

    weights.lease = timed_lease
    if prefetch:
        inner = weights.prefetch

        async def counted(key):
            calls.append(key)
            await inner(key)

        weights.prefetch = counted
    async with trio.open_nursery() as nursery:
        await nursery.start(weights.run)
        for s in served:
            executor.versions[s.key] = s
            await weights.add(s.key, s.bundle.weights, "unpinned")
            scheduler.add_model(s.spec())
        weights.compact()
        loads0, seconds0 = weights.cache.counters.loads, weights.cache.counters.load_seconds
        done = trio.Event()
        left = [requests]

        async def one(name):
            await scheduler.submit(name, [x])
            left[0] -= 1
            if not left[0]:
                done.set()

        for i in range(requests):  # queue them all, in order, before the loop starts
            nursery.start_soon(one, served[i % len(served)].name)
            await wait_all_tasks_blocked()
        start = time.perf_counter()
        nursery.start_soon(scheduler.run)
        await done.wait()
        total = time.perf_counter() - start
        counters = weights.cache.counters
        result = {
            "total_s": total,
            "loads": counters.loads - loads0,
            "load_seconds": counters.load_seconds - seconds0,
            "prefetch_calls": len(calls),
            "lease_wait_s": sum(waits),
        }
        nursery.cancel_scope.cancel()
    return result


async def prefetch_bench(workdir: Path, k: int, rows: int, requests: int, runs: int) -> dict:
    from rsrv.runtime import Compiler
    from rsrv.worker._models import build_model

    paths = export_models(workdir, 3, k, rows)
    compiler = Compiler(workdir / "cache")
    served = [await build_model(p, compiler, i + 1) for i, p in enumerate(paths)]
    nbytes = served[0].bundle.weights.nbytes
    x = np.random.default_rng(0).standard_normal((rows, k), np.float32)
    device = jax.devices("cpu")[0]

    # the two costs that can overlap: one execution (weights resident), one cold load
    for s in served:  # and every executable has run once before anything is timed
        weights = to_device(stage(s.bundle.weights), device)
        s.compiled.run(0, [x], weights)
        if s is served[0]:
            exec_s = best(lambda: s.compiled.run(0, [x], weights) and None, 5)  # noqa: B023
        free(weights)
    load_s = best(lambda: to_device(stage(served[0].bundle.weights), device), 5)

    out = {
        "weight_mib": nbytes / MIB,
        "rows": rows,
        "requests": requests,
        "runs": runs,
        "execute_s": exec_s,
        "unpinned_load_s": load_s,
        "cases": [],
    }
    cases = [
        {"models": 2, "budget_models": 1, "runs": {"without": [], "with": []}},
        {"models": 3, "budget_models": 2, "runs": {"without": [], "with": []}},
    ]
    for run in range(runs):  # each run a pair per case: without and with back to back,
        for case in cases:  # which goes first alternating, so drifting noise hits both alike
            for variant in ("without", "with")[:: 1 if run % 2 else -1]:
                case["runs"][variant].append(
                    await serve_sequence(
                        served[: case["models"]],
                        case["budget_models"] * nbytes,
                        variant == "with",
                        requests,
                        x,
                    )
                )
    for case in cases:
        measured = case.pop("runs")
        pairs = [
            wo["total_s"] / w["total_s"]
            for wo, w in zip(measured["without"], measured["with"], strict=True)
        ]
        for variant, results in measured.items():
            case[variant] = {
                "total_s": statistics.median(r["total_s"] for r in results),
                "totals_s": [r["total_s"] for r in results],
                "lease_wait_s": statistics.median(r["lease_wait_s"] for r in results),
                "hidden": statistics.median(
                    1 - r["lease_wait_s"] / r["load_seconds"] for r in results
                ),
                "loads": max(r["loads"] for r in results),  # (the most in one run)
                "prefetch_calls": max(r["prefetch_calls"] for r in results),
            }
        case["speedup"] = statistics.median(pairs)  # median of the per-pair ratios
        case["pair_speedups"] = pairs
        out["cases"].append(case)
    return out


# -- report -------------------------------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:7.1f}" if seconds > 0 else "    inf"


def print_sizes(rows: list[dict]) -> None:
    print(
        "\nCold device load, milliseconds (x memcpy bound)  [GB/s]; paired and interleaved: "
        "ms = best repetition, x = median of per-repetition ratios to memcpy"
    )
    names = {"system_wm": "system/WM", "unpinned_disk": "unp/disk"}
    print(f"{'MiB':>5} " + "".join(f"{names.get(c, c):>22}" for c in COLUMNS) + "  zero_copy")
    for r in rows:
        cells = []
        for c in COLUMNS:
            t = r[f"{c}_s"]
            x = 1.0 if c == "memcpy" else r[f"{c}_ratio"]
            cells.append(f"{t * 1e3:9.3f} ({x:6.2f}x){gbps(r['bytes'], t):>5}")
        print(f"{r['mib']:>5} " + "".join(f"{c:>22}" for c in cells) + f"  {r['zero_copy']}")
    print(
        "naive: per-tensor safetensors arrays, "
        + ", ".join(
            f"{r['mib']} MiB {r['naive_aligned_bytes'] / r['bytes']:.0%} aligned" for r in rows
        )
    )


def print_prefetch(p: dict) -> None:
    print(
        f"\nPrefetch: {p['requests']} requests, unpinned models of {p['weight_mib']:.0f} MiB; "
        f"one execution {p['execute_s'] * 1e3:.1f} ms, one cold load "
        f"{p['unpinned_load_s'] * 1e3:.1f} ms; {p['runs']} pairs of runs"
    )
    print(
        f"{'case':<24}{'total without':>14}{'with':>8}{'speedup':>9}{'(pairs)':>13}"
        f"{'lease wait without':>20}{'with':>8}{'hidden':>8}{'loads':>7}{'prefetches':>12}"
    )
    for c in p["cases"]:
        name = f"{c['models']} models, budget {c['budget_models']}"
        wo, w = c["without"], c["with"]
        lo, hi = min(c["pair_speedups"]), max(c["pair_speedups"])
        print(
            f"{name:<24}{wo['total_s']:>13.3f}s{w['total_s']:>7.3f}s{c['speedup']:>8.2f}x"
            f"{f'{lo:.2f}-{hi:.2f}':>13}"
            f"{wo['lease_wait_s']:>19.3f}s{w['lease_wait_s']:>7.3f}s{w['hidden']:>8.0%}"
            f"{wo['loads']:>4}/{w['loads']:<3}{w['prefetch_calls']:>10}"
        )
    print(
        "paired: the two variants back to back in each pair (first one alternating). "
        "speedup: median of the per-pair ratios\n(total without / total with), lowest-highest "
        "in (pairs). totals, lease wait (time executions waited for their weights) and\n"
        "hidden (share of the load time no execution waited for; 0% without prefetch by "
        "construction): medians over the runs; loads, prefetches: the most in one run"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 64 MiB (< 60 s)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cold_load.json")
    args = parser.parse_args(argv)
    from rsrv.runtime import configure
    from rsrv.runtime import device as device_of

    configure("cpu")
    device = device_of()
    sizes = QUICK_SIZES if args.quick else SIZES
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="rsrv-cold-load-"))
    try:
        rows = []
        for mib in sizes:
            rows.append(measure_size(mib, workdir, device))
            print(f"  {mib} MiB measured ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        # 64 MiB models: one execution (memory bound: it reads every weight) takes
        # about as long as one cold load, the case where overlap can save the most
        prefetch = trio.run(
            prefetch_bench, workdir, 4096, 16, 12 if args.quick else 24, 3 if args.quick else 7
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_sizes(rows)
    print_prefetch(prefetch)
    elapsed = time.perf_counter() - started
    print(f"\n{elapsed:.0f} s in all")
    report = {
        "quick": args.quick,
        "seconds": elapsed,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "cpus": os.cpu_count(),
            "device": str(device),
        },
        "method": {
            "sizes": "paired and interleaved: every column once per repetition, back to back, "
            "the order rotating; ratio = median of per-repetition ratios to memcpy; time = "
            "best repetition; unp/disk after fsync + posix_fadvise(DONTNEED), others with the "
            "file in the page cache",
            "prefetch": "paired runs: without and with prefetch back to back (first one "
            "alternating); speedup = median of per-pair ratios (lowest-highest); totals = "
            "medians",
        },
        "sizes": rows,
        "prefetch": prefetch,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
