"""rsrv benchmarks: `just bench` (full, < 15 min on 2 cores) or `just bench quick` (< 3 min).

    python benchmarks/run.py [quick] [--only 1,2,...]
    python benchmarks/run.py gpu [--quick] ...   # benchmarks/gpu.py: the GPU weight path

Each figure is a ratio measured side by side in this one run: the servers compared run at
the same time, each in its own process on 127.0.0.1, and the load alternates between
them in short rounds (the round order rotating), so background load on the machine hits
all sides alike. Nothing here asserts an absolute time.

Writes results/figN_*.json and results/figN_*.png (matplotlib, Agg), results/summary.md
(and summary-full.md / summary-quick.md), server logs under results/logs/, and prints a
summary table at the end.

1. Serving overhead: the `classifier` bundle under tritonclient load at c = 1, 8, 32:
   rsrv vs NVIDIA Triton (PyTriton's bundled tritonserver, same numpy function, dynamic
   batching) vs a bare purerpc echo server (the transport ceiling).
2. Coalescing: a compute-bound MLP compiled at [1, 8, 32] vs the same at [1].
3. Many models: Zipf(1.0) load over M models whose weights are 8x the cache budget,
   vs all resident, vs reloading from disk on every miss (residency unpinned).
4. Cold load vs the host memcpy bound (benchmarks/cold_load.py).
5. Dispatch decision time at 10 / 1,000 / 10,000 models (benchmarks/scheduler_decision.py).
6. Restart with many small bundles: cold vs warm compilation cache.
7. Fairness under overload: device-time shares vs configured weights 1 : 2 : 4.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    ROOT,
    LoadResult,
    ServerProcess,
    closed_loop,
    control_status,
    free_port,
    merge,
    pyplot,
    ratio,
    save_json,
    start_rsrv,
    table,
    wait_ready,
)

import bundles  # noqa: E402

COMPILE_CACHE = RESULTS / "cache"  # shared by the figures that do not time compilation
TRITON_VENV = RESULTS / "triton-venv"
SYSTEM_PYTHON = Path("/usr/bin/python3.11")
START_TIMEOUT = 240.0


@dataclass(frozen=True)
class Mode:
    quick: bool
    # 1. serving overhead
    overhead_concurrency: tuple[int, ...]
    overhead_seconds: float
    overhead_rounds: int
    # 2. coalescing
    coalesce_concurrency: tuple[int, ...]
    coalesce_seconds: float
    coalesce_rounds: int
    # 3. many models
    zoo_models: int
    zoo_concurrency: int
    zoo_seconds: float
    zoo_rounds: int
    # 6. restart
    restart_bundles: int
    restart_rounds: int
    # 7. fairness
    fair_seconds: float
    # 4, 5: colleagues' scripts (time limits)
    cold_load_timeout: float
    decision_timeout: float
    warmup: float


FULL = Mode(
    quick=False,
    overhead_concurrency=(1, 8, 32),
    overhead_seconds=3.0,
    overhead_rounds=4,
    coalesce_concurrency=(1, 2, 4, 8, 16, 32, 64),
    coalesce_seconds=2.5,
    coalesce_rounds=3,
    zoo_models=24,
    zoo_concurrency=8,
    zoo_seconds=6.0,
    zoo_rounds=3,
    restart_bundles=100,
    restart_rounds=2,
    fair_seconds=20.0,
    cold_load_timeout=480.0,
    decision_timeout=180.0,
    warmup=0.75,
)
QUICK = Mode(
    quick=True,
    overhead_concurrency=(1, 8, 32),
    overhead_seconds=2.0,
    overhead_rounds=1,
    coalesce_concurrency=(1, 8, 32),
    coalesce_seconds=2.0,
    coalesce_rounds=1,
    zoo_models=16,
    zoo_concurrency=8,
    zoo_seconds=3.0,
    zoo_rounds=1,
    restart_bundles=25,
    restart_rounds=1,
    fair_seconds=6.0,
    cold_load_timeout=90.0,
    decision_timeout=60.0,
    warmup=0.5,
)

# the compute-bound model of figures 2 and 7, and the zoo of figure 3
DENSE_WIDTH, DENSE_DEPTH = 1024, 4  # 16 MiB of weights
ZOO_WIDTH, ZOO_DEPTH = 768, 3  # ~6.8 MiB of weights each
FAIR_WIDTH, FAIR_DEPTH = 512, 4
FAIR_WEIGHTS = {"fair_w1": 1.0, "fair_w2": 2.0, "fair_w4": 4.0}
FAIR_CLIENTS = 8  # per model: more than its largest batch (4)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def interleave(servers: dict[str, ServerProcess], rounds: int, run) -> dict[str, LoadResult]:
    """``run(name, server)`` for every server, ``rounds`` times, the order rotating each
    round; the results of one server are merged (``.rounds`` keeps each round's req/s)."""
    names = list(servers)
    got: dict[str, list[LoadResult]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            got[name].append(run(name, servers[name]))
    merged = {}
    for n, v in got.items():
        merged[n] = merge(v)
        merged[n].rounds = [x.rps for x in v]
    return merged


def round_ratios(a: LoadResult, b: LoadResult) -> list[float]:
    """Throughput ratio a / b of each round (the two ran next to each other in time)."""
    return [x / y for x, y in zip(a.rounds, b.rounds, strict=False) if y]


def spread(values: list[float]) -> str:
    """' (lo-hi)' over rounds, or '' for a single round."""
    return f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""


def stop_all(servers) -> None:
    for s in servers:
        if s is not None:
            s.stop()


# -- 1. serving overhead ---------------------------------------------------------------


def triton_python(mode: Mode) -> tuple[Path | None, str]:
    """The Triton venv's interpreter, set up on first use (cached under results/)."""
    py = TRITON_VENV / "bin" / "python"
    ok = TRITON_VENV / ".bench-ready"
    if ok.is_file() and py.is_file():
        return py, ""
    if (
        py.is_file()
        and subprocess.run(
            [str(py), "-c", "import pytriton.triton"], capture_output=True, timeout=120
        ).returncode
        == 0
    ):
        ok.write_text("nvidia-pytriton\n")
        return py, ""
    if mode.quick:
        return None, (
            "the Triton environment is not set up yet and quick mode does not "
            "install it; run `just bench` (full) once"
        )
    if not SYSTEM_PYTHON.is_file():
        return None, f"{SYSTEM_PYTHON} not found (PyTriton's Python backend needs the system 3.11)"
    log("setting up the Triton environment in results/triton-venv (once; about a minute)")
    try:
        if not py.is_file():
            subprocess.run(
                [str(SYSTEM_PYTHON), "-m", "venv", str(TRITON_VENV)],
                check=True,
                capture_output=True,
                timeout=180,
            )
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "nvidia-pytriton", "numpy"],
            check=True,
            capture_output=True,
            timeout=900,
        )
        subprocess.run(
            [str(py), "-c", "import pytriton.triton"], check=True, capture_output=True, timeout=120
        )
    except subprocess.CalledProcessError as e:
        output = (e.stderr or b"") + (e.stdout or b"")  # venv reports on stdout
        tail = output.decode(errors="replace").strip().splitlines()[-3:]
        return None, f"Triton setup failed ({' '.join(map(str, e.cmd[:4]))}): {' | '.join(tail)}"
    except subprocess.TimeoutExpired as e:
        return None, f"Triton setup timed out: {e.cmd}"
    ok.write_text("nvidia-pytriton\n")
    return py, ""


def fig1_overhead(mode: Mode) -> dict:
    repo = bundles.classifier()
    weights = repo / "classifier" / "weights.safetensors"
    servers: dict[str, ServerProcess] = {}
    notes = []
    try:
        servers["rsrv"] = start_rsrv("overhead", repo, COMPILE_CACHE)
        py, why = triton_python(mode)
        if py is not None:
            ports = [free_port() for _ in range(3)]
            servers["triton"] = ServerProcess(
                "triton",
                [str(py), "benchmarks/triton_server.py", str(weights), *map(str, ports)],
                ports[0],
            )
        else:
            notes.append(f"Triton column skipped: {why}")
            log(notes[-1])
        port = free_port()
        servers["echo"] = ServerProcess(
            "echo", [sys.executable, "benchmarks/echo_server.py", str(port)], port
        )
        for name, server in list(servers.items()):
            try:
                wait_ready(server, START_TIMEOUT, ["classifier"] if name != "echo" else [])
            except RuntimeError as e:
                if name != "triton":
                    raise
                notes.append(f"Triton column skipped: it did not start: {str(e)[:400]}")
                log(notes[-1])
                servers.pop("triton").stop()

        x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
        check = _same_outputs({n: s.url for n, s in servers.items() if n != "echo"}, x)
        if check:
            notes.append(check)
        inputs = {"classifier": {"x": x}}
        points = {}
        for c in mode.overhead_concurrency:
            log(f"fig 1: concurrency {c}: {', '.join(servers)}")
            points[c] = interleave(
                servers,
                mode.overhead_rounds,
                lambda n, s, c=c: closed_loop(
                    s.url, inputs, c, mode.overhead_seconds, warmup=mode.warmup
                ),
            )
    finally:
        stop_all(servers.values())

    rows = []
    for c, by in points.items():
        row = {"concurrency": c}
        for name, r in by.items():
            row[name] = r.summary()
            if r.errors:
                notes.append(f"{name} c={c}: {r.errors} errors, first: {r.first_error}")
        rsrv = by["rsrv"].rps
        row["rsrv_over_triton"] = ratio(rsrv, by["triton"].rps) if "triton" in by else None
        row["rsrv_over_echo"] = ratio(rsrv, by["echo"].rps)
        row["rounds_rsrv_over_triton"] = (
            round_ratios(by["rsrv"], by["triton"]) if "triton" in by else []
        )
        row["rounds_rsrv_over_echo"] = round_ratios(by["rsrv"], by["echo"])
        rows.append(row)
    data = {
        "figure": 1,
        "title": "Serving overhead: classifier (256->64->10 MLP)",
        "servers": list(servers),
        "rounds": mode.overhead_rounds,
        "seconds_per_round": mode.overhead_seconds,
        "rsrv": "rsrv serve (own process)",
        "triton": "PyTriton 0.7.0 tritonserver, Python backend, @batch, dynamic batcher "
        "max_batch_size 8 (own process)",
        "echo": "bare purerpc + trio, canned ModelInfer response (own process)",
        "load": "closed loop, one tritonclient.grpc client (own connection) per thread",
        "rows": rows,
        "notes": notes,
    }
    save_json("fig1_overhead", data)
    _plot_fig1(data)
    return data


def _same_outputs(urls: dict[str, str], x: np.ndarray) -> str:
    """Both real servers compute the same logits for ``x`` (a sanity check)."""
    import tritonclient.grpc as grpcclient

    outs = {}
    for name, url in urls.items():
        client = grpcclient.InferenceServerClient(url)
        t = grpcclient.InferInput("x", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        outs[name] = client.infer("classifier", [t]).as_numpy("logits")
        client.close()
    if "triton" in outs and not np.allclose(outs["rsrv"], outs["triton"], atol=1e-4):
        return "WARNING: rsrv and Triton logits differ"
    return ""


def _plot_fig1(data: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    servers = data["servers"]
    cs = [r["concurrency"] for r in data["rows"]]
    width = 0.8 / len(servers)
    for i, name in enumerate(servers):
        xs = [j + i * width for j in range(len(cs))]
        a.bar(xs, [r[name]["req_s"] for r in data["rows"]], width, label=name)
        b.bar(xs, [r[name]["p50_ms"] or 0 for r in data["rows"]], width, label=name)
    for ax, label in ((a, "requests / s"), (b, "p50 latency (ms)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cs))], [f"c={c}" for c in cs])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(data["title"])
    fig.tight_layout()
    fig.savefig(RESULTS / "fig1_overhead.png", dpi=110)
    plt.close(fig)


# -- 2. coalescing -----------------------------------------------------------------------


def fig2_coalescing(mode: Mode) -> dict:
    repos = {
        "[1,8,32]": bundles.dense("dense_b1_8_32", DENSE_WIDTH, DENSE_DEPTH, [1, 8, 32]),
        "[1]": bundles.dense("dense_b1", DENSE_WIDTH, DENSE_DEPTH, [1]),
    }
    servers: dict[str, ServerProcess] = {}
    counters: dict[tuple[str, int], list] = {}
    try:
        for label, repo in repos.items():
            servers[label] = start_rsrv(
                f"coalesce_{'b1' if label == '[1]' else 'b1_8_32'}", repo, COMPILE_CACHE
            )
        for s in servers.values():
            wait_ready(s, START_TIMEOUT, ["dense"])
        x = np.random.default_rng(1).random((1, DENSE_WIDTH), dtype=np.float32)
        inputs = {"dense": {"x": x}}
        points = {}

        def run(label, s, c):
            snaps = []

            def snap():
                m = control_status(s.port).models[0]
                snaps.append((m.dispatches, m.rows_served))

            r = closed_loop(
                s.url,
                inputs,
                c,
                mode.coalesce_seconds,
                warmup=mode.warmup,
                at_start=snap,
                at_end=snap,
            )
            counters.setdefault((label, c), []).append(
                (snaps[1][0] - snaps[0][0], snaps[1][1] - snaps[0][1])
            )
            return r

        for c in mode.coalesce_concurrency:
            log(f"fig 2: concurrency {c}")
            points[c] = interleave(servers, mode.coalesce_rounds, lambda n, s, c=c: run(n, s, c))
    finally:
        stop_all(servers.values())

    rows = []
    for c, by in points.items():
        row = {"concurrency": c}
        for label, r in by.items():
            row[label] = r.summary()
            d = counters[(label, c)]
            dispatches, served = sum(a for a, _ in d), sum(b for _, b in d)
            row[label]["rows_per_dispatch"] = round(served / dispatches, 2) if dispatches else None
        row["speedup"] = ratio(by["[1,8,32]"].rps, by["[1]"].rps)
        row["rounds_speedup"] = round_ratios(by["[1,8,32]"], by["[1]"])
        rows.append(row)
    data = {
        "figure": 2,
        "title": f"Coalescing: {DENSE_DEPTH} dense layers of {DENSE_WIDTH} "
        "(16 MiB), compiled at [1,8,32] vs [1]",
        "rows": rows,
        "rounds": mode.coalesce_rounds,
        "seconds_per_round": mode.coalesce_seconds,
    }
    save_json("fig2_coalescing", data)
    _plot_fig2(data)
    return data


def _plot_fig2(data: dict) -> None:
    rows = data["rows"]
    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        cs = [r["concurrency"] for r in rows]
        for color, label in zip(("C0", "C1"), ("[1,8,32]", "[1]"), strict=True):
            a.plot(
                cs, [r[label]["req_s"] for r in rows], "o-", color=color, label=f"compiled {label}"
            )
            b.plot(cs, [r[label]["p50_ms"] for r in rows], "o-", color=color, label=f"p50 {label}")
            b.plot(cs, [r[label]["p99_ms"] for r in rows], "x--", color=color, label=f"p99 {label}")
        for ax, yl in ((a, "requests / s"), (b, "latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(yl)
            ax.legend()
        b.set_yscale("log")
        fig.suptitle(data["title"])
        fig.tight_layout()
        fig.savefig(RESULTS / "fig2_coalescing.png", dpi=110)
        plt.close(fig)


# -- 3. many models ----------------------------------------------------------------------


def fig3_many_models(mode: Mode) -> dict:
    repo = bundles.zoo(mode.zoo_models, ZOO_WIDTH, ZOO_DEPTH, [1, 4])
    names = sorted(p.name for p in repo.iterdir() if p.is_dir())
    total = sum(bundles.weight_bytes(repo / n) for n in names)
    budget = total // 8
    configs = {
        "cache (8x over budget)": dict(weight_cache_bytes=budget),
        "all resident": {},
        "reload from disk (unpinned)": dict(
            weight_cache_bytes=budget, models={n: {"residency": "unpinned"} for n in names}
        ),
    }
    zipf = np.array([1.0 / (i + 1) for i in range(len(names))])
    cum = list(np.cumsum(zipf / zipf.sum()))

    def choose(rng, _index):
        return rng.choices(names, cum_weights=cum)[0]

    x = np.random.default_rng(2).random((1, ZOO_WIDTH), dtype=np.float32)
    inputs = {n: {"x": x} for n in names}
    servers: dict[str, ServerProcess] = {}
    deltas: dict[str, list] = {k: [] for k in configs}
    budgets = {}
    try:
        for i, (label, node) in enumerate(configs.items()):
            servers[label] = start_rsrv(f"zoo_{i}", repo, COMPILE_CACHE, **node)
        for s in servers.values():
            wait_ready(s, START_TIMEOUT, names[:1])
        for label, s in servers.items():
            wait_ready(s, START_TIMEOUT, names)
            budgets[label] = control_status(s.port).weight_cache_budget_bytes

        def run(label, s):
            snaps = []

            def snap():
                st = control_status(s.port)
                snaps.append((st.weight_cache_loads, st.weight_cache_evictions))

            r = closed_loop(
                s.url,
                inputs,
                mode.zoo_concurrency,
                mode.zoo_seconds,
                warmup=mode.warmup * 2,
                choose=choose,
                at_start=snap,
                at_end=snap,
                seed=len(deltas[label]),
            )
            deltas[label].append((snaps[1][0] - snaps[0][0], snaps[1][1] - snaps[0][1]))
            return r

        log(
            f"fig 3: {len(names)} models, {total / 2**20:.0f} MiB of weights, "
            f"budget {budget / 2**20:.1f} MiB"
        )
        results = interleave(servers, mode.zoo_rounds, run)
    finally:
        stop_all(servers.values())

    rows = []
    cached = results["cache (8x over budget)"]
    base = cached.rps
    for label, r in results.items():
        loads = sum(a for a, _ in deltas[label])
        evictions = sum(b for _, b in deltas[label])
        row = {
            "config": label,
            **r.summary(),
            "budget_bytes": budgets.get(label),
            "loads": loads,
            "evictions": evictions,
            "loads_per_1k_requests": round(1000 * loads / r.completed, 1) if r.completed else None,
            "cache_over_this": ratio(base, r.rps),
            "rounds_cache_over_this": round_ratios(cached, r),
        }
        rows.append(row)
    data = {
        "figure": 3,
        "title": f"Many models: {len(names)} MLPs ({ZOO_DEPTH}x{ZOO_WIDTH}), "
        f"Zipf(1.0), weights = 8x budget",
        "models": len(names),
        "total_weight_bytes": total,
        "budget_bytes": budget,
        "concurrency": mode.zoo_concurrency,
        "rounds": mode.zoo_rounds,
        "seconds_per_round": mode.zoo_seconds,
        "rows": rows,
        "errors": {k: v.first_error for k, v in results.items() if v.errors},
    }
    save_json("fig3_many_models", data)
    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        labels = [r["config"] for r in rows]
        a.bar(labels, [r["req_s"] for r in rows], color=["C0", "C2", "C3"])
        a.set_ylabel("requests / s")
        for i, r in enumerate(rows):
            a.annotate(
                f"loads {r['loads']}\nevict {r['evictions']}",
                (i, r["req_s"]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        b.bar([j - 0.2 for j in range(len(rows))], [r["p50_ms"] for r in rows], 0.4, label="p50")
        b.bar([j + 0.2 for j in range(len(rows))], [r["p99_ms"] for r in rows], 0.4, label="p99")
        b.set_xticks(range(len(rows)), labels)
        b.set_ylabel("latency (ms)")
        b.legend()
        for ax in (a, b):
            ax.tick_params(axis="x", labelsize=8, rotation=10)
        fig.suptitle(data["title"])
        fig.tight_layout()
        fig.savefig(RESULTS / "fig3_many_models.png", dpi=110)
        plt.close(fig)
    return data


# -- 4, 5. colleagues' scripts -----------------------------------------------------------


def run_script(figure: int, script: str, result: str, mode: Mode, limit: float) -> dict:
    """Run benchmarks/SCRIPT (``--quick`` in quick mode) as a subprocess; collect its
    printed table and results/RESULT.json."""
    path = ROOT / "benchmarks" / script
    out = RESULTS / f"{result}.json"
    data = {
        "figure": figure,
        "script": f"benchmarks/{script}",
        "json": None,
        "stdout": "",
        "status": "",
    }
    if not path.is_file():
        data["status"] = f"skipped: benchmarks/{script} does not exist yet"
        log(f"fig {figure}: {data['status']}")
        return data
    argv = [sys.executable, str(path)] + (["--quick"] if mode.quick else [])
    started = time.time()
    log(f"fig {figure}: {' '.join(argv[1:])}")
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        data["stdout"] = proc.stdout
        data["status"] = (
            "ok"
            if proc.returncode == 0
            else f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
        )
    except subprocess.TimeoutExpired as e:
        data["stdout"] = (
            (e.stdout or b"").decode(errors="replace")
            if isinstance(e.stdout, bytes)
            else (e.stdout or "")
        )
        data["status"] = f"timed out after {limit:.0f} s"
    if out.is_file() and out.stat().st_mtime >= started:
        try:
            data["json"] = json.loads(out.read_text())
        except ValueError:
            pass
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    (RESULTS / "logs" / f"fig{figure}_{result}.txt").write_text(data["stdout"])
    print(data["stdout"].rstrip())
    save_json(f"fig{figure}_{result}", data)
    if data["status"] != "ok":
        log(f"fig {figure}: {data['status']}")
    return data


def script_table(data: dict) -> str:
    """The table a colleague's script reported: what it printed (its own table), else the
    rows of its JSON."""
    text = data.get("stdout", "").rstrip()
    if text:
        return "```\n" + text + "\n```"
    j = data.get("json")
    rows = (
        j
        if isinstance(j, list)
        else next(
            (
                v
                for v in (j or {}).values()
                if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)
            ),
            None,
        )
        if isinstance(j, dict)
        else None
    )
    if rows:
        header = list(
            dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list)))
        )
        return table([[r.get(k) for k in header] for r in rows], header)
    return f"({data.get('status')})"


# -- 6. restart --------------------------------------------------------------------------


def fig6_restart(mode: Mode) -> dict:
    repo = bundles.tiny(mode.restart_bundles)
    names = sorted(p.name for p in repo.iterdir() if p.is_dir())
    one = bundles.tiny(1)
    runs: dict[str, list[float]] = {"cold cache": [], "warm cache": [], "1 bundle, warm": []}
    caches = []
    try:
        for r in range(mode.restart_rounds):
            cache = RESULTS / f"restart-cache-{r}"
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
            caches.append(cache)
            for label in ("cold cache", "warm cache"):
                log(f"fig 6: {len(names)} bundles, {label} (round {r + 1})")
                runs[label].append(_time_start(f"restart_{r}", repo, cache, names))
            runs["1 bundle, warm"].append(_time_start(f"restart_one_{r}", one, cache, ["tiny000"]))
    finally:
        for cache in caches:
            shutil.rmtree(cache, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in runs.items()}
    data = {
        "figure": 6,
        "title": f"Restart with {len(names)} small bundles ({2 * len(names)} distinct modules)",
        "bundles": len(names),
        "rounds": mode.restart_rounds,
        "seconds": runs,
        "median_seconds": med,
        "cold_over_warm": ratio(med["cold cache"], med["warm cache"]),
        "measured": "process spawn -> ServerReady and every model READY (RepositoryIndex)",
    }
    save_json("fig6_restart", data)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(med), list(med.values()), color=["C3", "C2", "C7"])
        ax.set_ylabel("seconds to ready (median)")
        ax.set_title(data["title"], fontsize=10)
        fig.tight_layout()
        fig.savefig(RESULTS / "fig6_restart.png", dpi=110)
        plt.close(fig)
    return data


def _time_start(name: str, repo: Path, cache: Path, models: list[str]) -> float:
    """Seconds from spawning ``rsrv serve`` until it is ready with every model READY."""
    import tritonclient.grpc as grpcclient

    port = free_port()
    node = RESULTS / "nodes" / f"{name}.toml"
    node.parent.mkdir(parents=True, exist_ok=True)
    from common import node_toml

    node.write_text(node_toml(repo, port, COMPILE_CACHE))
    server = ServerProcess(
        f"rsrv-{name}",
        [sys.executable, "-m", "rsrv.cli", "serve", str(node)],
        port,
        env={"INFERENCE_SERVER_CACHE_DIR": str(cache)},
    )
    try:
        deadline = server.started_at + START_TIMEOUT
        client = None
        while time.perf_counter() < deadline:
            if not server.alive():
                raise RuntimeError(f"{server.name} exited:\n{server.log_tail()}")
            try:
                client = client or grpcclient.InferenceServerClient(server.url)
                if client.is_server_ready(client_timeout=2):
                    index = client.get_model_repository_index(client_timeout=5)
                    ready = sum(1 for m in index.models if m.state == "READY")
                    if ready >= len(models):
                        elapsed = time.perf_counter() - server.started_at
                        client.close()
                        return elapsed
            except Exception:
                pass
            time.sleep(0.05)
        raise RuntimeError(
            f"{server.name} not ready in {START_TIMEOUT:.0f} s:\n{server.log_tail()}"
        )
    finally:
        server.stop()


# -- 7. fairness -------------------------------------------------------------------------


def fig7_fairness(mode: Mode) -> dict:
    names = list(FAIR_WEIGHTS)
    repo = bundles.dense("fair", FAIR_WIDTH, FAIR_DEPTH, [1, 4], copies=names, seed=20)
    server = start_rsrv(
        "fairness", repo, COMPILE_CACHE, models={n: {"weight": w} for n, w in FAIR_WEIGHTS.items()}
    )
    snaps = []
    try:
        wait_ready(server, START_TIMEOUT, names)
        x = np.random.default_rng(3).random((1, FAIR_WIDTH), dtype=np.float32)
        inputs = {n: {"x": x} for n in names}

        def snap():
            st = control_status(server.port)
            snaps.append({m.name: (m.compute_seconds, m.requests_served) for m in st.models})

        log(
            f"fig 7: {FAIR_CLIENTS} closed-loop clients per model, weights "
            f"{', '.join(f'{n}={w:g}' for n, w in FAIR_WEIGHTS.items())}"
        )
        result = closed_loop(
            server.url,
            inputs,
            FAIR_CLIENTS * len(names),
            mode.fair_seconds,
            warmup=max(2.0, mode.warmup * 3),
            choose=lambda rng, i: names[i % len(names)],
            at_start=snap,
            at_end=snap,
        )
    finally:
        server.stop()
    device = {n: snaps[1][n][0] - snaps[0][n][0] for n in names}
    total_device = sum(device.values())
    total_weight = sum(FAIR_WEIGHTS.values())
    rows = []
    for n in names:
        share = device[n] / total_device if total_device else math.nan
        target = FAIR_WEIGHTS[n] / total_weight
        rows.append(
            {
                "model": n,
                "weight": FAIR_WEIGHTS[n],
                "target_share": round(target, 4),
                "device_share": round(share, 4),
                "share_over_target": ratio(share, target),
                "device_seconds": round(device[n], 3),
                "requests": snaps[1][n][1] - snaps[0][n][1],
                "client_req_s": round(result.per_model.get(n, 0) / result.seconds, 1),
            }
        )
    data = {
        "figure": 7,
        "title": "Fairness under overload: device-time shares vs weights",
        "model": f"{FAIR_DEPTH} dense layers of {FAIR_WIDTH}, compiled at [1, 4]",
        "clients_per_model": FAIR_CLIENTS,
        "seconds": mode.fair_seconds,
        "device_busy_fraction": round(total_device / mode.fair_seconds, 3),
        "max_abs_share_error": round(
            max(abs(r["device_share"] - r["target_share"]) for r in rows), 4
        ),
        "rows": rows,
        "errors": result.errors,
    }
    save_json("fig7_fairness", data)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = range(len(rows))
        ax.bar(
            [i - 0.2 for i in xs],
            [r["target_share"] for r in rows],
            0.4,
            label="configured weight share",
        )
        ax.bar(
            [i + 0.2 for i in xs],
            [r["device_share"] for r in rows],
            0.4,
            label="measured device-time share",
        )
        ax.set_xticks(list(xs), [f"{r['model']} (w={r['weight']:g})" for r in rows])
        ax.set_ylabel("share")
        ax.legend()
        ax.set_title(data["title"], fontsize=10)
        fig.tight_layout()
        fig.savefig(RESULTS / "fig7_fairness.png", dpi=110)
        plt.close(fig)
    return data


# -- summary -----------------------------------------------------------------------------


def summarize(figs: dict[int, dict], mode: Mode, started: float, machine: dict) -> str:
    def x(v):
        return f"{v:.2f}x" if v is not None else "-"

    out = [
        f"# rsrv benchmarks ({'quick' if mode.quick else 'full'} run)",
        "",
        f"Machine: {machine['description']}. Load average (1, 5, 15 min) at the start "
        f"{machine['loadavg_at_start']}, at the end {machine.get('loadavg_at_end')}. "
        f"Run took {time.time() - started:.0f} s.",
        "",
    ]
    rows = []
    if 1 in figs:
        d = figs[1]
        out += ["## 1. Serving overhead (classifier, req/s; p50 / p99 ms)", ""]
        names = d["servers"]
        out.append(
            table(
                [
                    [
                        r["concurrency"],
                        *[
                            f"{r[n]['req_s']:,.0f} ({r[n]['p50_ms']:.2f} / {r[n]['p99_ms']:.2f})"
                            if n in r and r[n]["p50_ms"] is not None
                            else "-"
                            for n in names
                        ],
                        x(r["rsrv_over_triton"]) + spread(r["rounds_rsrv_over_triton"]),
                        x(r["rsrv_over_echo"]) + spread(r["rounds_rsrv_over_echo"]),
                    ]
                    for r in d["rows"]
                ],
                ["clients", *names, "rsrv / Triton", "rsrv / echo"],
            )
        )
        out += ["", "(x.xx-y.yy): the lowest and highest ratio of the interleaved rounds"]
        out += [f"- {n}" for n in d["notes"]] + [""]
        for r in d["rows"]:
            rows.append(
                [
                    "1 overhead",
                    f"c={r['concurrency']}: rsrv / Triton, rsrv / echo (req/s)",
                    f"{x(r['rsrv_over_triton'])}, {x(r['rsrv_over_echo'])}",
                ]
            )
    if 2 in figs:
        d = figs[2]
        out += ["## 2. Coalescing (req/s; p50 / p99 ms; rows per dispatch)", ""]
        out.append(
            table(
                [
                    [
                        r["concurrency"],
                        *[
                            f"{r[k]['req_s']:,.0f} ({r[k]['p50_ms']:.2f} / {r[k]['p99_ms']:.2f}; "
                            f"{r[k]['rows_per_dispatch']})"
                            for k in ("[1,8,32]", "[1]")
                        ],
                        x(r["speedup"]) + spread(r["rounds_speedup"]),
                    ]
                    for r in d["rows"]
                ],
                ["clients", "compiled [1,8,32]", "compiled [1]", "speedup"],
            )
        )
        out.append("")
        best = max(d["rows"], key=lambda r: r["speedup"] or 0)
        rows.append(
            [
                "2 coalescing",
                "throughput [1,8,32] / [1], best (at c)",
                f"{x(best['speedup'])} (c={best['concurrency']})",
            ]
        )
        c1 = d["rows"][0]
        rows.append(
            [
                "2 coalescing",
                f"same at c={c1['concurrency']} (nothing to coalesce)",
                x(c1["speedup"]),
            ]
        )
    if 3 in figs:
        d = figs[3]
        out += [
            f"## 3. Many models ({d['models']} models, "
            f"{d['total_weight_bytes'] / 2**20:.0f} MiB of weights, budget "
            f"{d['budget_bytes'] / 2**20:.1f} MiB, {d['concurrency']} clients, Zipf(1.0))",
            "",
        ]
        out.append(
            table(
                [
                    [
                        r["config"],
                        f"{r['req_s']:,.0f}",
                        r["p50_ms"],
                        r["p99_ms"],
                        r["loads"],
                        r["evictions"],
                        r["loads_per_1k_requests"],
                        x(r["cache_over_this"]) + spread(r["rounds_cache_over_this"]),
                    ]
                    for r in d["rows"]
                ],
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
        )
        out.append("")
        for r in d["rows"][1:]:
            rows.append(
                ["3 many models", f"throughput: cache / {r['config']}", x(r["cache_over_this"])]
            )
    for n, title in (
        (4, "Cold load vs host memcpy bound"),
        (5, "Dispatch decision time vs registered models"),
    ):
        if n in figs:
            d = figs[n]
            out += [f"## {n}. {title} ({d['script']}: {d['status']})", "", script_table(d), ""]
            rows.append(
                [
                    f"{n} {'cold load' if n == 4 else 'decision'}",
                    f"see table ({d['script']})",
                    d["status"],
                ]
            )
            if n == 4:
                rows += _cold_load_ratios(d.get("json"))
    if 6 in figs:
        d = figs[6]
        med = d["median_seconds"]
        out += [
            f"## 6. Restart with {d['bundles']} small bundles (seconds to ready, median of "
            f"{d['rounds']})",
            "",
        ]
        out.append(table([[k, f"{v:.2f}"] for k, v in med.items()], ["start", "seconds"]))
        out += ["", f"cold / warm: {x(d['cold_over_warm'])}", ""]
        rows.append(
            [
                "6 restart",
                f"{d['bundles']} bundles: cold / warm compile cache",
                x(d["cold_over_warm"]),
            ]
        )
    if 7 in figs:
        d = figs[7]
        out += [
            f"## 7. Fairness under overload ({d['clients_per_model']} clients per model, "
            f"device busy {d['device_busy_fraction']:.0%})",
            "",
        ]
        out.append(
            table(
                [
                    [
                        r["model"],
                        r["weight"],
                        f"{r['target_share']:.3f}",
                        f"{r['device_share']:.3f}",
                        x(r["share_over_target"]),
                        r["client_req_s"],
                    ]
                    for r in d["rows"]
                ],
                ["model", "weight", "target share", "device share", "measured / target", "req/s"],
            )
        )
        out.append("")
        rows.append(
            [
                "7 fairness",
                "device share / weight share (w=1, 2, 4)",
                ", ".join(x(r["share_over_target"]) for r in d["rows"]),
            ]
        )
    out += ["## Summary", "", table(rows, ["figure", "ratio", "value"]), ""]
    return "\n".join(out)


def _cold_load_ratios(j) -> list[list]:
    """Best effort: system / unpinned cold load over memcpy at the largest size."""
    try:
        big = max(j["sizes"], key=lambda r: r["bytes"])
        return [
            [
                "4 cold load",
                f"{big['mib']} MiB: {k} load / memcpy",
                f"{big[f'{k}_s'] / big['memcpy_s']:.2g}x",
            ]
            for k in ("system", "unpinned")
        ]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return []


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import jax

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(mem, 1),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "loadavg_at_start": [round(v, 2) for v in load],
        "description": f"{os.cpu_count()}-core CPU VM ({cpu or 'unknown CPU'}), "
        f"{mem:.0f} GiB, no GPU, CPU PJRT (jax {jax.__version__}), "
        f"Python {platform.python_version()}",
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:  # `just bench gpu`: the accelerator weight path, on its own
        import gpu

        return gpu.main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="full", choices=["full", "quick"])
    parser.add_argument(
        "--only",
        default="1,2,3,4,5,6,7",
        help="comma-separated figure numbers to run (default: all)",
    )
    args = parser.parse_args(argv)
    mode = QUICK if args.mode == "quick" else FULL
    only = {int(f) for f in args.only.split(",") if f.strip()}
    RESULTS.mkdir(exist_ok=True)
    COMPILE_CACHE.mkdir(parents=True, exist_ok=True)
    started = time.time()
    machine = machine_info()
    log(
        f"rsrv bench ({args.mode}) on {machine['description']}; "
        f"load average {machine['loadavg_at_start']}"
    )
    figures = {
        1: fig1_overhead,
        2: fig2_coalescing,
        3: fig3_many_models,
        4: lambda m: run_script(4, "cold_load.py", "cold_load", m, m.cold_load_timeout),
        5: lambda m: run_script(
            5, "scheduler_decision.py", "scheduler_decision", m, m.decision_timeout
        ),
        6: fig6_restart,
        7: fig7_fairness,
    }
    done: dict[int, dict] = {}
    failed = []
    for n, fn in figures.items():
        if n not in only:
            continue
        t = time.time()
        try:
            done[n] = fn(mode)
            log(f"fig {n} done in {time.time() - t:.0f} s")
        except Exception as e:  # one broken figure must not hide the others
            failed.append(f"figure {n}: {type(e).__name__}: {e}")
            log(f"fig {n} FAILED after {time.time() - t:.0f} s: {type(e).__name__}: {e}")
    machine["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    text = summarize(done, mode, started, machine)
    if failed:
        text += "\nFailed:\n" + "\n".join(f"- {f}" for f in failed) + "\n"
    (RESULTS / "summary.md").write_text(text)
    (RESULTS / f"summary-{args.mode}.md").write_text(text)
    save_json("machine", machine)
    print("\n" + text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
