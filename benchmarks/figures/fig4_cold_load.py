"""4. Cold load vs the host memcpy bound, and prefetch: benchmarks/cold_load.py (its
docstring says how each column is measured: paired and interleaved repetitions for the
sizes, paired runs for prefetch)."""

from __future__ import annotations

from common import table

from figures._script import printed, run_script

NUMBER = 4
FULL, QUICK = 480.0, 90.0  # time limits (s)
COLUMNS = {
    "system": "system",
    "system_wm": "system via WeightManager",
    "unpinned": "unpinned (page cache)",
    "unpinned_disk": "unpinned (disk)",
    "naive": "naive `device_put`",
}


def run(quick: bool) -> dict:
    return run_script(NUMBER, "cold_load.py", "cold_load", quick, QUICK if quick else FULL)


def _x(value: float, lohi=None) -> str:
    text = f"{value:.3g}x"
    return text + (f" ({lohi[0]:.3g}-{lohi[1]:.3g})" if lohi else "")


def report(d: dict) -> tuple[list[str], list[list]]:
    j = d.get("json")
    head = f"## 4. Cold load vs the host memcpy bound ({d['script']}: {d['status']})"
    if not j:
        return [head, "", *printed(d), ""], [["4 cold load", "see table", d["status"], "-"]]
    sizes, pre = j["sizes"], j["prefetch"]
    reps = sorted({r["reps"] for r in sizes})
    reps_text = f"{reps[0]}" if len(reps) == 1 else f"{reps[0]}-{reps[-1]}"
    out = [
        head,
        "",
        f"Measured: {j['method']['sizes']} ({reps_text} repetitions). Each value: load "
        "time / memcpy time for the same bytes, median (lowest-highest).",
        "",
        table(
            [[r["mib"], *(_x(r[f"{c}_ratio"], r[f"{c}_ratios"]) for c in COLUMNS)] for r in sizes],
            ["MiB", *COLUMNS.values()],
        ),
        "",
        f"Prefetch ({pre['requests']} requests, unpinned {pre['weight_mib']:.0f} MiB models; "
        f"{j['method']['prefetch']}; {pre['runs']} pairs):",
        "",
        table(
            [
                [
                    f"{c['models']} models, budget {c['budget_models']}",
                    f"{c['without']['total_s']:.3f}",
                    f"{c['with']['total_s']:.3f}",
                    _x(c["speedup"], (min(c["pair_speedups"]), max(c["pair_speedups"]))),
                    f"{c['without']['lease_wait_s']:.3f}",
                    f"{c['with']['lease_wait_s']:.3f}",
                    f"{c['with']['hidden']:.0%}",
                ]
                for c in pre["cases"]
            ],
            [
                "case",
                "total without (s)",
                "with (s)",
                "without / with",
                "lease wait without (s)",
                "with (s)",
                "load time hidden",
            ],
        ),
        "",
    ]
    big = max(sizes, key=lambda r: r["bytes"])
    three = pre["cases"][-1]
    lo, hi = min(three["pair_speedups"]), max(three["pair_speedups"])
    rows = [
        [
            "4 cold load",
            f"{big['mib']} MiB load / memcpy: `system` floor, `unpinned` (page cache), "
            "`unpinned` (disk)",
            ", ".join(_x(big[f"{c}_ratio"]) for c in ("system", "unpinned", "unpinned_disk")),
            f"paired, interleaved; median of {big['reps']} repetitions",
        ],
        [
            "4 prefetch",
            f"total time without / with prefetch ({three['models']} models, budget "
            f"{three['budget_models']})",
            f"{three['speedup']:.2f}x ({lo:.2f}-{hi:.2f})",
            f"paired runs; median of {pre['runs']} pairs",
        ],
    ]
    return out, rows
