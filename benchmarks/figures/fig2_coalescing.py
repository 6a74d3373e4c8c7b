"""2. Coalescing: a compute-bound MLP (4 dense layers of 1024, 16 MiB of weights) compiled
at [1, 8, 32] against the same model compiled at [1] only.

Two ``rsrv serve`` processes side by side; tritonclient closed loop at each concurrency,
in interleaved rounds whose order rotates; rows per execution from ModelControlStatus
(dispatches and rows served, read when the window opens and closes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from common import (
    COMPILE_CACHE,
    START_TIMEOUT,
    closed_loop_reading,
    control_status,
    interleave,
    load_cell,
    log,
    round_ratios,
    rounds,
    rps_ratio,
    save_json,
    save_plot,
    start_rsrv,
    stop_all,
    table,
    times,
    wait_ready,
)

import bundles

NUMBER = 2
WIDTH, DEPTH = 1024, 4  # 16 MiB of weights
CONFIGS = {"[1,8,32]": [1, 8, 32], "[1]": [1]}
SUMMARY_CONCURRENCY = (1, 8, 32, 64)  # the summary table's points (the figure has them all)


@dataclass(frozen=True)
class Params:
    concurrency: tuple[int, ...]
    seconds: float
    rounds: int
    warmup: float


FULL = Params((1, 2, 4, 8, 16, 32, 64), 2.5, 3, 0.75)
QUICK = Params((1, 8, 32), 2.0, 1, 0.5)


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    servers = {}
    counters: dict[tuple[str, int], list] = {}
    try:
        for label, sizes in CONFIGS.items():
            slug = "b" + "_".join(map(str, sizes))
            repo = bundles.dense(f"dense_{slug}", WIDTH, DEPTH, sizes)
            servers[label] = start_rsrv(f"coalesce_{slug}", repo, COMPILE_CACHE)
        for s in servers.values():
            wait_ready(s, START_TIMEOUT, ["dense"])
        x = np.random.default_rng(1).random((1, WIDTH), dtype=np.float32)

        def measure(label, s, c):
            def read() -> tuple[int, int]:
                m = control_status(s.port).models[0]
                return m.dispatches, m.rows_served

            r, before, after = closed_loop_reading(
                read, s.url, {"dense": {"x": x}}, c, p.seconds, warmup=p.warmup
            )
            counters.setdefault((label, c), []).append((after[0] - before[0], after[1] - before[1]))
            return r

        points = {}
        for c in p.concurrency:
            log(f"fig 2: concurrency {c}")
            points[c] = interleave(servers, p.rounds, lambda n, s, c=c: measure(n, s, c))
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
        row["speedup"] = rps_ratio(by["[1,8,32]"], by["[1]"])
        row["rounds_speedup"] = round_ratios(by["[1,8,32]"], by["[1]"])
        rows.append(row)
    data = {
        "figure": NUMBER,
        "title": f"Coalescing: {DEPTH} dense layers of {WIDTH} (16 MiB), compiled at "
        "[1,8,32] vs [1]",
        "method": f"two servers side by side; tritonclient closed loop, interleaved rounds "
        f"whose order rotates ({rounds(p.rounds)} of {p.seconds} s per concurrency); "
        "speedup: req/s over all rounds (per-round lowest-highest)",
        "rows": rows,
        "rounds": p.rounds,
        "seconds_per_round": p.seconds,
    }
    save_json("fig2_coalescing", data)
    save_plot("fig2_coalescing", _draw, data)
    return data


def report(d: dict) -> tuple[list[str], list[list]]:
    out = [
        "## 2. Coalescing (req/s; p50 / p99 ms; rows per execution)",
        "",
        f"Measured: {d['method']}.",
        "",
        table(
            [
                [
                    r["concurrency"],
                    *[load_cell(r[k], f"; {r[k]['rows_per_dispatch']}") for k in CONFIGS],
                    times(r["speedup"], r["rounds_speedup"]),
                ]
                for r in d["rows"]
            ],
            ["clients", *CONFIGS, "speedup"],
        ),
        "",
    ]
    shown = [r for r in d["rows"] if r["concurrency"] in SUMMARY_CONCURRENCY] or d["rows"]
    rows = [
        [
            "2 coalescing",
            "compiled [1,8,32] / [1] at c = " + ", ".join(str(r["concurrency"]) for r in shown),
            ", ".join(times(r["speedup"]) for r in shown),
            f"interleaved, {rounds(d['rounds'])}",
        ]
    ]
    return out, rows


def _draw(plt, data: dict):
    rows = data["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    cs = [r["concurrency"] for r in rows]
    for color, label in zip(("C0", "C1"), CONFIGS, strict=True):
        a.plot(cs, [r[label]["req_s"] for r in rows], "o-", color=color, label=f"compiled {label}")
        b.plot(cs, [r[label]["p50_ms"] for r in rows], "o-", color=color, label=f"p50 {label}")
        b.plot(cs, [r[label]["p99_ms"] for r in rows], "x--", color=color, label=f"p99 {label}")
    for ax, yl in ((a, "requests / s"), (b, "latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(yl)
        ax.legend()
    b.set_yscale("log")
    fig.suptitle(data["title"])
    return fig
