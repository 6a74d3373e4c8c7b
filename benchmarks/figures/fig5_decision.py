"""5. Dispatch decision time at 10 / 1,000 / 10,000 registered models:
benchmarks/scheduler_decision.py (decisions timed one by one, one configuration after
another; a time, not a ratio between configurations)."""

from __future__ import annotations

from common import table

from figures._script import printed, run_script

NUMBER = 5
FULL, QUICK = 180.0, 60.0  # time limits (s)


def run(quick: bool) -> dict:
    return run_script(
        NUMBER, "scheduler_decision.py", "scheduler_decision", quick, QUICK if quick else FULL
    )


def _cell(v: dict) -> str:
    return f"{v['mean_us']:.1f} / {v['median_us']:.1f}"


def report(d: dict) -> tuple[list[str], list[list]]:
    j = d.get("json")
    head = f"## 5. Dispatch decision time ({d['script']}: {d['status']})"
    if not j:
        return [head, "", *printed(d), ""], [["5 decision", "see table", d["status"], "-"]]
    rows = j["rows"]
    disciplines = list(dict.fromkeys(r["discipline"] for r in rows))
    counts = list(dict.fromkeys(r["models"] for r in rows))
    by = {(r["discipline"], r["models"]): r for r in rows}
    out = [
        head,
        "",
        f"Measured: {j['method']}. µs per select + plan, mean / median, all models "
        "backlogged; last column: one pass over every registered model, for contrast.",
        "",
        table(
            [
                [
                    f"{n:,}",
                    *(_cell(by[(dsc, n)]["backlogged_100"]) for dsc in disciplines),
                    f"{by[(disciplines[0], n)]['full_scan_us']:,.1f}",
                ]
                for n in counts
            ],
            ["models", *disciplines, "one pass over all"],
        ),
        "",
    ]
    fair = [f"{by[('fair', n)]['backlogged_100']['median_us']:.1f}" for n in counts]
    summary = [
        [
            "5 decision",
            "fair, median µs at " + " / ".join(f"{n:,}" for n in counts) + " models "
            "(all backlogged)",
            " / ".join(fair),
            f"one configuration after another; {j['decisions']:,} decisions each",
        ]
    ]
    return out, summary
