"""6. Restart with many small bundles: cold vs warm compilation cache.

``tiny`` bundles (benchmarks/bundles.py: every width differs, so each of the 2 x N
modules is distinct and a cold start compiles each one). Timed from spawning
``rsrv serve`` until ServerReady and every model READY (one RepositoryIndex per poll,
every 20 ms). Paired rounds: each round makes a fresh compilation cache, starts cold
(compiling into it), then at once warm (reading it), then one bundle warm (the process
start floor); the ratio is the median of the per-round cold / warm ratios, lowest and
highest in parentheses. A warm start cannot run before its cold one, so the order within
a round is fixed.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import (
    RESULTS,
    START_TIMEOUT,
    log,
    rounds,
    save_json,
    save_plot,
    start_rsrv,
    table,
    times,
    wait_ready,
)

import bundles

NUMBER = 6
COLD, WARM, ONE = "cold cache", "warm cache", "1 bundle, warm"


@dataclass(frozen=True)
class Params:
    bundles: int
    rounds: int


FULL = Params(100, 3)
QUICK = Params(25, 1)


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    repo = bundles.tiny(p.bundles)
    names = sorted(q.name for q in repo.iterdir() if q.is_dir())
    one = bundles.tiny(1)
    runs: dict[str, list[float]] = {COLD: [], WARM: [], ONE: []}
    for r in range(p.rounds):
        cache = RESULTS / f"restart-cache-{r}"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        try:
            for label in (COLD, WARM):
                log(f"fig 6: {len(names)} bundles, {label} (round {r + 1})")
                runs[label].append(
                    time_to_ready(f"restart_{label.split()[0]}_{r}", repo, cache, names)
                )
            runs[ONE].append(time_to_ready(f"restart_one_{r}", one, cache, ["tiny000"]))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in runs.items()}
    pairs = [c / w for c, w in zip(runs[COLD], runs[WARM], strict=True)]
    data = {
        "figure": NUMBER,
        "title": f"Restart with {len(names)} small bundles ({2 * len(names)} distinct modules)",
        "bundles": len(names),
        "rounds": p.rounds,
        "seconds": runs,
        "median_seconds": med,
        "cold_over_warm": float(np.median(pairs)),
        "rounds_cold_over_warm": pairs,
        "method": "paired rounds, one after another (not interleaved with other servers): "
        "a fresh cache, a cold start, then a warm start; ratio = median of per-round "
        "cold / warm (lowest-highest); times = medians; each timed from spawning `rsrv "
        "serve` until ServerReady and every model READY (RepositoryIndex)",
    }
    save_json("fig6_restart", data)
    save_plot("fig6_restart", _draw, data)
    return data


def time_to_ready(name: str, repo: Path, cache: Path, models: list[str]) -> float:
    """Seconds from spawning ``rsrv serve`` until it is ready with every model READY."""
    server = start_rsrv(name, repo, cache)
    try:
        return wait_ready(server, START_TIMEOUT, models)
    finally:
        server.stop()


def report(d: dict) -> tuple[list[str], list[list]]:
    out = [
        f"## 6. Restart with {d['bundles']} small bundles (seconds to ready)",
        "",
        f"Measured: {d['method']}; {rounds(d['rounds'])}.",
        "",
        table(
            [
                [k, f"{v:.2f}", ", ".join(f"{s:.2f}" for s in d["seconds"][k])]
                for k, v in d["median_seconds"].items()
            ],
            ["start", "median s", "each round"],
        ),
        "",
        f"cold / warm: {times(d['cold_over_warm'], d['rounds_cold_over_warm'])}",
        "",
    ]
    rows = [
        [
            "6 restart",
            f"{d['bundles']} bundles: cold / warm compilation cache",
            times(d["cold_over_warm"], d["rounds_cold_over_warm"]),
            f"paired rounds; median of {d['rounds']}",
        ]
    ]
    return out, rows


def _draw(plt, data: dict):
    med = data["median_seconds"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(med), list(med.values()), color=["C3", "C2", "C7"])
    ax.set_ylabel("seconds to ready (median)")
    ax.set_title(data["title"], fontsize=10)
    return fig
