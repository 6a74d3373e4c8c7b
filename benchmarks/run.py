"""rsrv benchmarks: `just bench` (full, 12-15 min on 2 cores) or `just bench quick`
(about 3 min).

    python benchmarks/run.py [full|quick] [--only 1,2,...]
    python benchmarks/run.py gpu [--quick] ...   # benchmarks/gpu.py: the GPU weight path

The driver: it picks the mode and the figures, runs each figure's module
(benchmarks/figures/figN_*.py, whose docstring says exactly what it measures and how),
and prints and writes the summary. Nothing here asserts an absolute time.

1. Serving overhead (classifier, 1 row): rsrv vs Triton vs the stock purerpc echo vs an
   echo on rsrv's own transport, under a tritonclient closed loop and under h2load.
2. Coalescing: a compute-bound MLP compiled at [1, 8, 32] vs the same at [1].
3. Many models: Zipf(1.0) over weights 8x the cache budget, vs all resident, vs reload
   from disk with the page cache dropped.
4. Cold load vs the host memcpy bound, and prefetch (benchmarks/cold_load.py).
5. Dispatch decision time at 10 / 1,000 / 10,000 models (benchmarks/scheduler_decision.py).
6. Restart with many small bundles: cold vs warm compilation cache.
7. Fairness under overload: device-time and client throughput shares vs weights 1 : 2 : 4.
8. Scale: 100 and 1,000 registered bundles: time to ready, RSS per model, RepositoryIndex
   and /metrics latency.
9. Gateway: through `rsrv gateway` vs direct to one worker (tritonclient closed loops,
   and h2load beside a C proxy), and coalescing under lpt_packing vs round_robin.
10. Large tensors: 64 MiB each way, unary and streamed; the worker's CPU per answer
    and how long its event loop is held meanwhile.

Figures 1-3 and 9 compare servers side by side in interleaved rounds whose order rotates;
4 and 6 are paired; 5 and 7 are one configuration measured on its own; 8 rotates its
configurations over rounds; 10 is one worker, its two modes in interleaved rounds. Each
figure's JSON has a ``method`` saying so, and the summary repeats it.

Writes results/figN_*.json, results/figN_*.png (matplotlib, Agg; figures 1-3 and 6-8),
results/summary.md and summary-full.md / summary-quick.md (summary-MODE-only-N.md for a run
of some figures: it does not replace the whole run's), server logs under results/logs/,
and prints the summary at the end.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import figures  # noqa: E402
from common import COMPILE_CACHE, RESULTS, cpu_model, log, save_json, table  # noqa: E402

# benchmarks/figures/figN_*.py, by N
FIGURES = {
    m.NUMBER: m
    for m in sorted(
        (
            importlib.import_module(f"figures.{info.name}")
            for info in pkgutil.iter_modules(figures.__path__)
            if info.name.startswith("fig")
        ),
        key=lambda m: m.NUMBER,
    )
}
SUMMARY_HEADER = ["figure", "ratio (this run)", "value", "how measured"]


def summarize(
    figs: dict[int, dict], quick: bool, started: float, machine: dict, failed: list[str]
) -> str:
    """The summary of the figures ``figs`` (their reports); a report that fails is
    added to ``failed`` rather than losing the others'."""
    out = [
        f"# rsrv benchmarks ({'quick' if quick else 'full'} run)",
        "",
        f"Machine: {machine['description']}. Load average (1, 5, 15 min) at the start "
        f"{machine['loadavg_at_start']}, at the end {machine.get('loadavg_at_end')}. "
        f"Run took {time.time() - started:.0f} s.",
        "",
        "Values in parentheses: the lowest and highest per-round (or per-pair) ratio.",
        "",
    ]
    rows = []
    for n, data in figs.items():
        try:
            lines, summary = FIGURES[n].report(data)
        except Exception as e:
            failed.append(f"figure {n}'s report: {type(e).__name__}: {e}")
            continue
        out += lines
        rows += summary
    out += ["## Summary", "", table(rows, SUMMARY_HEADER), ""]
    return "\n".join(out)


def machine_info() -> dict:
    cpu = cpu_model()
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
        default=",".join(map(str, FIGURES)),
        help="comma-separated figure numbers to run (default: all)",
    )
    args = parser.parse_args(argv)
    quick = args.mode == "quick"
    only = {int(f) for f in args.only.split(",") if f.strip()}
    unknown = only - set(FIGURES)
    if unknown:
        parser.error(f"no figure {', '.join(map(str, sorted(unknown)))} (1-{max(FIGURES)})")
    RESULTS.mkdir(exist_ok=True)
    COMPILE_CACHE.mkdir(parents=True, exist_ok=True)
    started = time.time()
    machine = machine_info()
    log(
        f"rsrv bench ({args.mode}) on {machine['description']}; "
        f"load average {machine['loadavg_at_start']}"
    )
    done: dict[int, dict] = {}
    failed = []
    for n, module in FIGURES.items():
        if n not in only:
            continue
        t = time.time()
        try:
            data = done[n] = module.run(quick)
            if data.get("status", "ok") != "ok":  # (a script's figure: its run failed)
                raise RuntimeError(data["status"])
            log(f"fig {n} done in {time.time() - t:.0f} s")
        except Exception as e:  # one broken figure must not hide the others
            failed.append(f"figure {n}: {type(e).__name__}: {e}")
            log(f"fig {n} FAILED after {time.time() - t:.0f} s: {type(e).__name__}: {e}")
    machine["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    text = summarize(done, quick, started, machine, failed)
    if failed:
        text += "\nFailed:\n" + "\n".join(f"- {f}" for f in failed) + "\n"
    (RESULTS / "summary.md").write_text(text)
    # (a run of some figures does not replace the summary of a run of them all)
    some = "" if only == set(FIGURES) else "-only-" + "-".join(map(str, sorted(only)))
    (RESULTS / f"summary-{args.mode}{some}.md").write_text(text)
    save_json("machine", machine)
    print("\n" + text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
