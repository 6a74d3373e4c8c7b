"""The accelerator weight path, measured on one GPU in one run.

    just bench gpu [--quick] [--drop-caches] [--cpu-smoke]
    python benchmarks/gpu.py [--quick] [--drop-caches] [--cpu-smoke] [--only 1,2]

Where JAX sees no accelerator it prints that there is none, measures nothing and exits
0. ``--cpu-smoke`` runs every step on the CPU device instead, with the ``pinned``
staging route selected and tiny sizes: it checks that the script works, and its figures
describe nothing. The figures below have never been taken: no GPU was available to this
repository (README, specs/weights.md §8).

On a GPU it measures, each figure saying how in its output:

G1. **Cold load against the pinned host-to-device bound**, 1 MiB to 1 GiB. The bound:
    ``jax.device_put`` of one contiguous ``pinned_host`` buffer of that size into device
    memory. rsrv: a model whose weights have that size (five tensors), staged on the
    ``pinned`` route (its floor in ``pinned_host`` memory), loaded cold: evicted, then
    ``WeightManager.lease`` (what a dispatch waits for: the transfer task, a worker
    thread, the copy, the cache bookkeeping), and ``to_device`` of the staged floor
    alone. Paired and interleaved: each repetition times one bound copy, one lease and
    one ``to_device`` back to back, the order rotating; a ratio is the median of the
    per-repetition ratios (lowest and highest in parentheses); times are the best
    repetition.

G2. **Many models**: MLPs whose weights total 8x the weight cache budget, Zipf(1.0)
    traffic from closed-loop ``tritonclient`` clients, ``rsrv serve`` on the GPU in three
    configurations, each its own process (``preallocate = false``, a quarter of the GPU's
    memory at most): the weight cache (budget = total / 8, ``system`` floors in pinned
    memory), all resident (``weight_cache_fraction = 0``), and reload from disk (every
    model ``unpinned``: a miss reads its weights file) with the page cache dropped. The
    three run side by side and the load goes to one at a time, in rounds whose order
    rotates (interleaved); values in parentheses are the lowest and highest per-round
    ratios. Page cache: during the unpinned server's rounds, a driver thread calls
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every weights file every 20 ms (no
    privileges needed; a read between two passes can still hit the cache); with
    ``--drop-caches`` (root only) it writes ``1`` to /proc/sys/vm/drop_caches instead.
    The output says which was used.

Prints a summary table in the README's format and one table per figure, and writes them
to results/gpu.md and the figures to results/gpu.json (``gpu_cpu_smoke.*`` for
``--cpu-smoke``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    PageCacheDropper,
    cpu_model,
    log,
    rounds,
    save_json,
    spread,
    start_rsrv,
    table,
    wait_ready,
)

MIB = 2**20
START_TIMEOUT = 600.0


@dataclass(frozen=True)
class Plan:
    sizes_mib: tuple[int, ...]
    zoo_models: int
    zoo_width: int
    zoo_depth: int
    concurrency: int
    seconds: float
    rounds: int
    warmup: float


FULL = Plan((1, 4, 16, 64, 256, 1024), 20, 2048, 4, 8, 6.0, 3, 1.5)  # 64 MiB per model
QUICK = Plan((1, 16, 256, 1024), 12, 2048, 4, 8, 3.0, 1, 1.0)
SMOKE = Plan((1, 4), 8, 128, 2, 4, 1.0, 1, 0.5)


def reps_for(nbytes: int) -> int:
    return 21 if nbytes <= 16 * MIB else 11 if nbytes <= 256 * MIB else 5


# -- the device ----------------------------------------------------------------------------


def accelerator(smoke: bool):
    """The device to measure, or None when JAX sees no accelerator (and not ``smoke``).

    The driver's own allocator grows on demand and is capped, so the servers of G2 find
    the GPU's memory free."""
    from rsrv.runtime import configure, device

    configure("cuda", mem_fraction=0.25, preallocate=False, allow_cpu_fallback=True)
    dev = device()
    if dev.platform == "cpu" and not smoke:
        return None
    return dev


# -- G1: cold load against the pinned bound -------------------------------------------------


def measure_size(mib: int, device, workdir: Path) -> dict:
    import jax
    import trio
    from cold_load import write_weights
    from jax.sharding import SingleDeviceSharding

    from rsrv.bundle._safetensors import read_weights_header
    from rsrv.runtime import Staging, WeightManager, free, to_device

    nbytes = mib * MIB
    path = workdir / f"g1_{mib}.safetensors"
    write_weights(path, nbytes)
    wf = read_weights_header(path)
    src = jax.device_put(
        np.ones(nbytes, np.uint8), SingleDeviceSharding(device, memory_kind="pinned_host")
    )
    src.block_until_ready()
    to_device_memory = SingleDeviceSharding(device)
    reps = reps_for(nbytes)

    def bound() -> float:
        start = time.perf_counter()
        copy = jax.device_put(src, to_device_memory)
        copy.block_until_ready()
        seconds = time.perf_counter() - start
        copy.delete()
        return seconds

    async def run() -> dict:
        manager = WeightManager(wf.nbytes, device, staging=Staging.PINNED)
        times: dict[str, list[float]] = {"bound": [], "lease": [], "to_device": []}
        async with trio.open_nursery() as nursery:
            await nursery.start(manager.run)
            await manager.add("m", wf, "system")
            floor = manager.placements["m"].host
            kinds = {a.sharding.memory_kind for a in floor.arrays}

            async def lease() -> tuple[float, bool]:
                manager.cache.evict("m")
                start = time.perf_counter()
                async with manager.lease("m") as arrays:
                    seconds = time.perf_counter() - start
                    copied = all(
                        a.sharding.memory_kind == "device"
                        and a.unsafe_buffer_pointer() != h.unsafe_buffer_pointer()
                        for a, h in zip(arrays, floor.arrays, strict=True)
                    )
                return seconds, copied

            def direct() -> float:
                start = time.perf_counter()
                arrays = to_device(floor, device)
                seconds = time.perf_counter() - start
                free(arrays)
                return seconds

            bound()  # each path once before anything is timed
            _, copied = await lease()
            direct()
            steps = ["bound", "lease", "to_device"]
            for rep in range(reps):
                for step in steps[rep % 3 :] + steps[: rep % 3]:
                    if step == "lease":
                        times[step].append((await lease())[0])
                    else:
                        times[step].append(bound() if step == "bound" else direct())
            manager.remove("m")
            nursery.cancel_scope.cancel()
        return {"times": times, "floor_memory": sorted(kinds), "copied": copied}

    try:
        got = trio.run(run)
    finally:
        src.delete()
        path.unlink()
    times = got["times"]
    row = {
        "mib": mib,
        "bytes": nbytes,
        "reps": reps,
        "floor_memory": got["floor_memory"],
        "copied": got["copied"],
        "bound_s": min(times["bound"]),
        "lease_s": min(times["lease"]),
        "to_device_s": min(times["to_device"]),
    }
    for step in ("lease", "to_device"):
        per_rep = [t / b for t, b in zip(times[step], times["bound"], strict=True)]
        row[f"{step}_ratio"] = statistics.median(per_rep)
        row[f"{step}_ratios"] = per_rep
    row["bound_gbps"] = nbytes / row["bound_s"] / 1e9
    return row


def g1(plan: Plan, device) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="rsrv-gpu-g1-"))
    rows = []
    try:
        for mib in plan.sizes_mib:
            rows.append(measure_size(mib, device, workdir))
            log(f"G1: {mib} MiB measured")
    finally:
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()
    return {
        "figure": "G1",
        "method": "paired and interleaved: each repetition times one bound copy, one cold "
        "lease and one to_device back to back, the order rotating; ratios: median of the "
        "per-repetition ratios (lowest-highest); times: best repetition",
        "rows": rows,
    }


def g1_table(data: dict) -> str:
    rows = []
    for r in data["rows"]:
        rows.append(
            [
                r["mib"],
                f"{r['bound_s'] * 1e3:.3f} ({r['bound_gbps']:.1f} GB/s)",
                f"{r['lease_s'] * 1e3:.3f}",
                f"{r['lease_ratio']:.2f}x{spread(r['lease_ratios'])}",
                f"{r['to_device_s'] * 1e3:.3f}",
                f"{r['to_device_ratio']:.2f}x{spread(r['to_device_ratios'])}",
                r["reps"],
            ]
        )
    return table(
        rows,
        [
            "MiB",
            "pinned copy ms",
            "rsrv lease ms",
            "lease / copy",
            "to_device ms",
            "to_device / copy",
            "reps",
        ],
    )


# -- G2: many models -----------------------------------------------------------------------


def g2(plan: Plan, backend: str, drop_caches: bool) -> dict:
    from figures.fig3_many_models import CACHED, METHOD, RELOAD, RESIDENT, measure, zoo

    names, files, total = zoo(plan.zoo_models, plan.zoo_width, plan.zoo_depth)
    repo = files[0].parent.parent
    budget = total // 8
    # the GPU's memory grown on demand, a quarter at most; "pinned": the GPU's own default,
    # and on --cpu-smoke the route under test
    runtime = {
        "backend": backend,
        "mem_fraction": 0.25,
        "preallocate": False,
        "weight_staging": "pinned",
    }
    configs = {
        CACHED: dict(runtime={**runtime, "weight_cache_bytes": budget}),
        RESIDENT: dict(runtime={**runtime, "weight_cache_fraction": 0.0}),
        RELOAD: dict(
            runtime={**runtime, "weight_cache_bytes": budget},
            models={n: {"residency": "unpinned"} for n in names},
        ),
    }
    dropped = PageCacheDropper(files, 0.02)
    if drop_caches:
        if os.access("/proc/sys/vm/drop_caches", os.W_OK):
            dropped.proc = True
        else:
            log("G2: /proc/sys/vm/drop_caches is not writable; using posix_fadvise instead")
    servers = {}
    try:
        for i, (label, node) in enumerate(configs.items()):
            servers[label] = start_rsrv(f"gpu_zoo_{i}", repo, RESULTS / "cache", **node)
        for s in servers.values():
            wait_ready(s, START_TIMEOUT, names)
        log(
            f"G2: {len(names)} models, {total / MIB:.0f} MiB of weights, budget "
            f"{budget / MIB:.1f} MiB; page cache: {dropped.method}"
        )
        rows, errors = measure(servers, names, plan.zoo_width, plan, dropped)
    finally:
        for s in servers.values():
            s.stop()
    return {
        "figure": "G2",
        "models": len(names),
        "model_bytes": total // len(names),
        "total_weight_bytes": total,
        "budget_bytes": budget,
        "concurrency": plan.concurrency,
        "rounds": plan.rounds,
        "seconds_per_round": plan.seconds,
        "page_cache": dropped.method,
        "page_cache_passes": dropped.passes,
        "method": METHOD,
        "rows": rows,
        "errors": errors,
    }


# -- report --------------------------------------------------------------------------------


def machine(device) -> dict:
    import jax

    cpu = cpu_model()
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "platform_version": device.client.platform_version,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def report(figs: dict, m: dict, smoke: bool) -> str:
    out = [
        "## The accelerator weight path (benchmarks/gpu.py)",
        "",
        f"**Machine:** {m['device']} ({m['platform']}, {m['platform_version']}), "
        f"jax {m['jax']}, Python {m['python']}, {m['cpus']} CPUs ({m['cpu_model'] or '?'}), "
        f"{m['memory_gib']} GiB RAM.",
    ]
    if smoke:
        out += [
            "",
            "**CPU smoke run** (`--cpu-smoke`): the CPU device with the pinned staging "
            "route, tiny sizes. These numbers check the script; they describe no GPU.",
        ]
    summary = []
    if "G1" in figs:
        rows = figs["G1"]["rows"]
        summary.append(
            [
                "G1 cold load",
                "rsrv lease / pinned copy at " + ", ".join(f"{r['mib']}" for r in rows) + " MiB",
                ", ".join(f"{r['lease_ratio']:.2f}x" for r in rows),
            ]
        )
        big = rows[-1]
        summary.append(
            [
                "G1 bandwidth",
                f"pinned host-to-device copy of {big['mib']} MiB",
                f"{big['bound_gbps']:.1f} GB/s",
            ]
        )
    if "G2" in figs:
        rows = {r["config"]: r for r in figs["G2"]["rows"]}
        resident = rows["all resident"]
        disk = rows["reload from disk (unpinned, page cache dropped)"]
        for name, row in (("all resident", resident), ("reload from disk", disk)):
            summary.append(
                [
                    "G2 many models",
                    f"weight cache (8x over budget) / {name}",
                    f"{row['cache_over_this']:.2f}x" if row["cache_over_this"] else "-",
                ]
            )
    out += ["", table(summary, ["figure", "ratio (this run)", "value"])]
    if "G1" in figs:
        d = figs["G1"]
        out += [
            "",
            "**G1. Cold load vs the pinned host-to-device bound.** The bound: one "
            "contiguous pinned_host buffer to device memory (`jax.device_put`). rsrv: a "
            "model of that size (five tensors) on the pinned staging route, evicted, then "
            "`WeightManager.lease`; and `to_device` of its staged floor alone. Measured "
            f"{d['method']}. Floors in "
            + ", ".join(sorted({k for r in d["rows"] for k in r["floor_memory"]}))
            + " memory; every lease "
            + ("copied into device memory." if all(r["copied"] for r in d["rows"]) else "")
            + ("" if all(r["copied"] for r in d["rows"]) else "did NOT always copy."),
            "",
            g1_table(d),
        ]
    if "G2" in figs:
        from figures.fig3_many_models import rows_table

        d = figs["G2"]
        out += [
            "",
            f"**G2. Many models.** {d['models']} MLPs of {d['model_bytes'] / MIB:.1f} MiB "
            f"({d['total_weight_bytes'] / MIB:.0f} MiB in all) share a weight budget of "
            f"{d['budget_bytes'] / MIB:.1f} MiB, one eighth; {d['concurrency']} clients pick "
            f"models with Zipf(1.0) popularity; {rounds(d['rounds'])} of "
            f"{d['seconds_per_round']:.0f} s per configuration. Measured {d['method']}. "
            f"Page cache of the unpinned server: {d['page_cache']} ({d['page_cache_passes']} "
            "passes). Loads and evictions come from ModelControlStatus.",
            "",
            rows_table(d["rows"]),
        ]
        if d["errors"]:
            out += ["", f"Errors: {d['errors']}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter rounds")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache through /proc/sys/vm/drop_caches (root) instead of posix_fadvise",
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run every step on the CPU device (pinned route, tiny sizes) to check the "
        "script; the figures describe no GPU",
    )
    parser.add_argument("--only", default="1,2", help="figures to run: 1 (G1), 2 (G2)")
    args = parser.parse_args(argv)
    device = accelerator(args.cpu_smoke)
    if device is None:
        print(
            "benchmarks/gpu.py: no accelerator: JAX sees only the CPU device. The GPU "
            "figures need an NVIDIA GPU and the cuda extra (pip install -e '.[cuda,bench]'). "
            "Nothing was measured. (--cpu-smoke runs the script on the CPU to check it.)"
        )
        return 0
    plan = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    only = {s.strip() for s in args.only.split(",")}
    m = machine(device)
    log(f"rsrv GPU bench on {m['device']} ({m['platform']})")
    RESULTS.mkdir(exist_ok=True)
    figs: dict[str, dict] = {}
    failed = []
    for key, name, run in (
        ("1", "G1", lambda: g1(plan, device)),
        (
            "2",
            "G2",
            lambda: g2(plan, device.platform if args.cpu_smoke else "cuda", args.drop_caches),
        ),
    ):
        if key not in only:
            continue
        started = time.time()
        try:
            figs[name] = run()
            log(f"{name} done in {time.time() - started:.0f} s")
        except Exception as e:  # one broken figure must not hide the other
            failed.append(f"{name}: {type(e).__name__}: {e}")
            log(f"{name} FAILED: {type(e).__name__}: {e}")
    text = report(figs, m, args.cpu_smoke)
    if failed:
        text += "\nFailed:\n" + "\n".join(f"- {f}" for f in failed) + "\n"
    name = "gpu_cpu_smoke" if args.cpu_smoke else "gpu"
    save_json(name, {"machine": m, "smoke": args.cpu_smoke, "figures": figs, "failed": failed})
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
