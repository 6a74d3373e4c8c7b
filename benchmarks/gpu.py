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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    ServerProcess,
    closed_loop,
    control_status,
    free_port,
    merge,
    ratio,
    save_json,
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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spread(values: list[float]) -> str:
    return f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""


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


class PageCacheDropper:
    """Drops the weights files from the page cache, over and over, while it is open."""

    def __init__(self, paths: list[Path], interval: float, proc: bool):
        self.paths, self.interval, self.proc = paths, interval, proc
        self.passes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drop-page-cache", daemon=True)

    @property
    def method(self) -> str:
        if self.proc:
            return f"1 written to /proc/sys/vm/drop_caches every {self.interval * 1e3:.0f} ms"
        return (
            f"posix_fadvise(POSIX_FADV_DONTNEED) on every weights file every "
            f"{self.interval * 1e3:.0f} ms"
        )

    def drop_once(self) -> None:
        if self.proc:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
        else:
            for path in self.paths:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        self.passes += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.drop_once()

    def __enter__(self):
        self.drop_once()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="drop-page-cache", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def node_toml(repo: Path, port: int, cache_dir: Path, backend: str, **runtime) -> str:
    """A one-worker node file: static model set, the GPU's memory grown on demand."""
    models = runtime.pop("models", {})
    lines = [
        f'model_repo = "{repo}"',
        "",
        "[global]",
        f'cache_dir = "{cache_dir}"',
        'model_control_mode = "static"',
        "",
        "[global.runtime]",
        f'backend = "{backend}"',
        "mem_fraction = 0.25",
        "preallocate = false",
    ]
    for key, value in runtime.items():
        lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value!r}")
    lines += ["", "[global.scheduler]", "max_queue_depth = 8192"]
    for name, residency in models.items():
        lines += ["", f"[global.scheduler.models.{name}]", f'residency = "{residency}"']
    lines += [
        "",
        "[global.endpoints]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "max_concurrent_requests = 0",
        "shutdown_grace_seconds = 2.0",
        "",
        "[global.logging]",
        'level = "warning"',
        "",
    ]
    return "\n".join(lines)


def start(name: str, repo: Path, cache_dir: Path, backend: str, **runtime) -> ServerProcess:
    port = free_port()
    path = RESULTS / "nodes" / f"gpu_{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_toml(repo, port, cache_dir, backend, **runtime))
    return ServerProcess(
        f"rsrv-gpu-{name}", [sys.executable, "-m", "rsrv.cli", "serve", str(path)], port
    )


def g2(plan: Plan, backend: str, drop_caches: bool) -> dict:
    import bundles

    repo = bundles.zoo(plan.zoo_models, plan.zoo_width, plan.zoo_depth, [1, 4])
    names = sorted(p.name for p in repo.iterdir() if p.is_dir())
    total = sum(bundles.weight_bytes(repo / n) for n in names)
    budget = total // 8
    staging = "pinned"  # the GPU's own default, and on --cpu-smoke the route under test
    configs = {
        "weight cache (8x over budget)": dict(weight_cache_bytes=budget, weight_staging=staging),
        "all resident": dict(weight_cache_fraction=0.0, weight_staging=staging),
        "reload from disk (unpinned, page cache dropped)": dict(
            weight_cache_bytes=budget,
            weight_staging=staging,
            models={n: "unpinned" for n in names},
        ),
    }
    dropped = PageCacheDropper([repo / n / "weights.safetensors" for n in names], 0.02, False)
    if drop_caches:
        if os.access("/proc/sys/vm/drop_caches", os.W_OK):
            dropped.proc = True
        else:
            log("G2: /proc/sys/vm/drop_caches is not writable; using posix_fadvise instead")
    zipf = np.array([1.0 / (i + 1) for i in range(len(names))])
    cum = list(np.cumsum(zipf / zipf.sum()))
    x = np.random.default_rng(2).random((1, plan.zoo_width), dtype=np.float32)
    inputs = {n: {"x": x} for n in names}
    cache_dir = RESULTS / "cache"
    servers: dict[str, ServerProcess] = {}
    deltas: dict[str, list] = {k: [] for k in configs}
    got: dict[str, list] = {k: [] for k in configs}
    try:
        for i, (label, runtime) in enumerate(configs.items()):
            servers[label] = start(f"zoo_{i}", repo, cache_dir, backend, **runtime)
        for s in servers.values():
            wait_ready(s, START_TIMEOUT, names)
        log(
            f"G2: {len(names)} models, {total / MIB:.0f} MiB of weights, budget "
            f"{budget / MIB:.1f} MiB; page cache: {dropped.method}"
        )
        labels = list(configs)
        for r in range(plan.rounds):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                s = servers[label]
                snaps = []

                def snap(port=s.port, snaps=snaps):
                    st = control_status(port)
                    snaps.append((st.weight_cache_loads, st.weight_cache_evictions))

                def load(label=label, s=s, snap=snap):
                    return closed_loop(
                        s.url,
                        inputs,
                        plan.concurrency,
                        plan.seconds,
                        warmup=plan.warmup,
                        choose=lambda rng, _i: rng.choices(names, cum_weights=cum)[0],
                        at_start=snap,
                        at_end=snap,
                        seed=len(got[label]),
                    )

                if label.startswith("reload"):
                    with dropped:
                        result = load()
                else:
                    result = load()
                got[label].append(result)
                deltas[label].append((snaps[1][0] - snaps[0][0], snaps[1][1] - snaps[0][1]))
    finally:
        for s in servers.values():
            s.stop()
    results = {}
    for label, rounds in got.items():
        results[label] = merge(rounds)
        results[label].rounds = [r.rps for r in rounds]
    cached = results["weight cache (8x over budget)"]
    rows = []
    for label, r in results.items():
        loads = sum(a for a, _ in deltas[label])
        rows.append(
            {
                "config": label,
                **r.summary(),
                "loads": loads,
                "evictions": sum(b for _, b in deltas[label]),
                "loads_per_1k_requests": round(1000 * loads / r.completed, 1)
                if r.completed
                else None,
                "cache_over_this": ratio(cached.rps, r.rps),
                "rounds_cache_over_this": [
                    a / b for a, b in zip(cached.rounds, r.rounds, strict=True) if b
                ],
            }
        )
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
        "method": "three servers side by side, the load on one at a time in rounds whose "
        "order rotates (interleaved); ratios of req/s, per-round lowest-highest in "
        "parentheses",
        "rows": rows,
        "errors": {k: v.first_error for k, v in results.items() if v.errors},
    }


def g2_table(data: dict) -> str:
    rows = []
    for r in data["rows"]:
        rows.append(
            [
                r["config"],
                r["req_s"],
                r["p50_ms"],
                r["p99_ms"],
                r["loads"],
                r["evictions"],
                r["loads_per_1k_requests"],
                f"{r['cache_over_this']:.2f}x{spread(r['rounds_cache_over_this'])}"
                if r["cache_over_this"]
                else "-",
            ]
        )
    return table(
        rows,
        [
            "config",
            "req/s",
            "p50 ms",
            "p99 ms",
            "loads",
            "evictions",
            "loads / 1k req",
            "cache / this",
        ],
    )


# -- report --------------------------------------------------------------------------------


def machine(device) -> dict:
    import jax

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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
        d = figs["G2"]
        out += [
            "",
            f"**G2. Many models.** {d['models']} MLPs of {d['model_bytes'] / MIB:.1f} MiB "
            f"({d['total_weight_bytes'] / MIB:.0f} MiB in all) share a weight budget of "
            f"{d['budget_bytes'] / MIB:.1f} MiB, one eighth; {d['concurrency']} clients pick "
            f"models with Zipf(1.0) popularity; {d['rounds']} round(s) of "
            f"{d['seconds_per_round']:.0f} s per configuration. Measured {d['method']}. "
            f"Page cache of the unpinned server: {d['page_cache']} ({d['page_cache_passes']} "
            "passes). Loads and evictions come from ModelControlStatus.",
            "",
            g2_table(d),
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
