"""3. Many models: Zipf(1.0) traffic over M MLPs whose weights total 8x the weight cache
budget, against all resident and against reloading from disk on every miss.

Three ``rsrv serve`` processes side by side, the load (tritonclient closed loop, each
request to a model drawn with Zipf(1.0) popularity) on one at a time, in interleaved
rounds whose order rotates; ratios of req/s over all rounds, per-round lowest and highest
in parentheses. Loads and evictions from ModelControlStatus when the window opens and
closes.

  weight cache      ``weight_cache_bytes`` = total weights / 8.
  all resident      no budget.
  reload from disk  the same budget, every model ``residency = "unpinned"``: a miss reads
                    its weights file. During this server's rounds a driver thread drops
                    every weights file from the page cache every 20 ms
                    (``posix_fadvise(POSIX_FADV_DONTNEED)``, common.PageCacheDropper), so
                    a miss reads the disk, not memory (a read between two passes can
                    still find pages the previous miss brought in).

benchmarks/gpu.py (G2) measures the same figure on a GPU with :func:`measure`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from common import (
    COMPILE_CACHE,
    START_TIMEOUT,
    PageCacheDropper,
    ServerProcess,
    closed_loop_reading,
    control_status,
    interleave,
    log,
    ratio,
    round_ratios,
    rounds,
    save_json,
    save_plot,
    start_rsrv,
    stop_all,
    table,
    times,
    wait_ready,
)

import bundles

NUMBER = 3
WIDTH, DEPTH = 768, 3  # ~6.8 MiB of weights each
CACHED = "weight cache (8x over budget)"
RESIDENT = "all resident"
RELOAD = "reload from disk (unpinned, page cache dropped)"


@dataclass(frozen=True)
class Params:
    models: int
    concurrency: int
    seconds: float
    rounds: int
    warmup: float


FULL = Params(24, 8, 6.0, 3, 1.5)
QUICK = Params(16, 8, 3.0, 1, 1.0)


def zoo(models: int, width: int, depth: int) -> tuple[list[str], list, int]:
    """The zoo repository: (model names, weights files, total weight bytes)."""
    repo = bundles.zoo(models, width, depth, [1, 4])
    names = sorted(p.name for p in repo.iterdir() if p.is_dir())
    files = [repo / n / "weights.safetensors" for n in names]
    return names, files, sum(f.stat().st_size for f in files)


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    names, files, total = zoo(p.models, WIDTH, DEPTH)
    repo = files[0].parent.parent
    budget = total // 8
    configs = {
        CACHED: dict(runtime={"weight_cache_bytes": budget}),
        RESIDENT: {},
        RELOAD: dict(
            runtime={"weight_cache_bytes": budget},
            models={n: {"residency": "unpinned"} for n in names},
        ),
    }
    servers = {}
    try:
        for i, (label, node) in enumerate(configs.items()):
            servers[label] = start_rsrv(f"zoo_{i}", repo, COMPILE_CACHE, **node)
        for s in servers.values():
            wait_ready(s, START_TIMEOUT, names)
        budgets = {k: control_status(s.port).weight_cache_budget_bytes for k, s in servers.items()}
        dropper = PageCacheDropper(files, 0.02)
        log(
            f"fig 3: {len(names)} models, {total / 2**20:.0f} MiB of weights, budget "
            f"{budget / 2**20:.1f} MiB; page cache: {dropper.method}"
        )
        rows, errors = measure(servers, names, WIDTH, p, dropper)
    finally:
        stop_all(servers.values())
    for row in rows:
        row["budget_bytes"] = budgets[row["config"]]
    data = {
        "figure": NUMBER,
        "title": f"Many models: {len(names)} MLPs ({DEPTH}x{WIDTH}), Zipf(1.0), "
        "weights = 8x budget",
        "models": len(names),
        "model_bytes": total // len(names),
        "total_weight_bytes": total,
        "budget_bytes": budget,
        "concurrency": p.concurrency,
        "rounds": p.rounds,
        "seconds_per_round": p.seconds,
        "page_cache": dropper.method,
        "page_cache_passes": dropper.passes,
        "method": METHOD,
        "rows": rows,
        "errors": errors,
    }
    save_json("fig3_many_models", data)
    save_plot("fig3_many_models", _draw, data)
    return data


METHOD = (
    "three servers side by side, the load on one at a time in rounds whose order rotates "
    "(interleaved); ratios of req/s over all rounds, per-round lowest-highest in parentheses"
)


def measure(
    servers: dict[str, ServerProcess], names: list[str], width: int, p, dropper
) -> tuple[list[dict], dict]:
    """Zipf(1.0) closed-loop load on each of ``servers`` (labelled CACHED, RESIDENT and
    RELOAD; ``dropper`` open during RELOAD's rounds) in interleaved rounds. ``p`` has
    concurrency, seconds, rounds and warmup. Returns the rows and the first error of each
    server that had errors."""
    zipf = np.array([1.0 / (i + 1) for i in range(len(names))])
    cum = list(np.cumsum(zipf / zipf.sum()))
    x = np.random.default_rng(2).random((1, width), dtype=np.float32)
    inputs = {n: {"x": x} for n in names}
    deltas: dict[str, list] = {k: [] for k in servers}

    def one(label: str, s: ServerProcess):
        def read() -> tuple[int, int]:
            st = control_status(s.port)
            return st.weight_cache_loads, st.weight_cache_evictions

        def load():
            return closed_loop_reading(
                read,
                s.url,
                inputs,
                p.concurrency,
                p.seconds,
                warmup=p.warmup,
                choose=lambda rng, _i: rng.choices(names, cum_weights=cum)[0],
                seed=len(deltas[label]),
            )

        if label == RELOAD:
            with dropper:
                result, before, after = load()
        else:
            result, before, after = load()
        deltas[label].append((after[0] - before[0], after[1] - before[1]))
        return result

    results = interleave(servers, p.rounds, one)
    cached = results[CACHED]
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
                "rounds_cache_over_this": round_ratios(cached, r),
            }
        )
    return rows, {k: v.first_error for k, v in results.items() if v.errors}


def rows_table(rows: list[dict]) -> str:
    return table(
        [
            [
                r["config"],
                r["req_s"],
                r["p50_ms"],
                r["p99_ms"],
                r["loads"],
                r["evictions"],
                r["loads_per_1k_requests"],
                times(r["cache_over_this"], r["rounds_cache_over_this"]),
            ]
            for r in rows
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


def report(d: dict) -> tuple[list[str], list[list]]:
    out = [
        f"## 3. Many models ({d['models']} models, {d['total_weight_bytes'] / 2**20:.0f} MiB "
        f"of weights, budget {d['budget_bytes'] / 2**20:.1f} MiB, {d['concurrency']} "
        "clients, Zipf(1.0))",
        "",
        f"Measured: {d['method']}; {rounds(d['rounds'])} of {d['seconds_per_round']} s. "
        f"Page cache of the reload server: {d['page_cache']} ({d['page_cache_passes']} "
        "passes).",
        "",
        rows_table(d["rows"]),
        "",
    ]
    if d["errors"]:
        out += [f"Errors: {d['errors']}", ""]
    how = f"interleaved, {rounds(d['rounds'])}"
    rows = [
        ["3 many models", f"req/s: weight cache / {r['config']}", times(r["cache_over_this"]), how]
        for r in d["rows"]
        if r["config"] != CACHED
    ]
    return out, rows


def _draw(plt, data: dict):
    rows = data["rows"]
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
        ax.tick_params(axis="x", labelsize=7, rotation=10)
    fig.suptitle(data["title"])
    return fig
