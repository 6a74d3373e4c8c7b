"""8. Scale: 100 and 1,000 registered bundles in one ``rsrv serve``.

The bundles are tiny MLPs of one shape with distinct weights (benchmarks/bundles.py
``scale``; about 9 KiB of weights each), so the compilation cache holds their two
executables before anything is timed: an untimed start with one of them fills it, and
every timed start finds it warm (each model still deserializes its own executables).
Per start:

  time to ready  from spawning ``rsrv serve`` until ServerReady and every model READY
                 (one RepositoryIndex per poll, every 20 ms).
  RSS            the server's resident set (VmRSS) after the latency calls below.
                 Per registered model beyond its weights:
                 (RSS with N models - RSS with an empty repository - N models' weights
                 file bytes) / N; the weights are subtracted because a ``system`` model
                 keeps its staged host floor (on CPU the device arrays alias it).
  latency        client-side wall time of RepositoryIndex (tritonclient, one connection)
                 and of GET /metrics (admin HTTP, one keep-alive connection), p50 and p99
                 over repeated calls after a few untimed ones.

The configurations (empty repository, 100, 1,000) each start once per round, in rounds
whose order rotates; values are medians over rounds (lowest-highest). Quick mode runs
100 models only (1,000 skipped) in one round.
"""

from __future__ import annotations

import http.client
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from common import (
    COMPILE_CACHE,
    HOST,
    RESULTS,
    START_TIMEOUT,
    free_port,
    log,
    ms,
    percentile,
    rotated,
    rounds,
    rss_bytes,
    save_json,
    save_plot,
    start_rsrv,
    table,
    wait_ready,
)

import bundles

NUMBER = 8
MIB = 2**20


@dataclass(frozen=True)
class Params:
    counts: tuple[int, ...]  # registered models (0: the baseline, an empty repository)
    rounds: int
    calls: int  # timed RepositoryIndex and /metrics calls per start


FULL = Params((0, 100, 1000), 2, 40)
QUICK = Params((0, 100), 1, 20)


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    repos = {n: _repo(n) for n in p.counts}
    log("fig 8: an untimed start fills the compilation cache")
    _start(bundles.scale(1), calls=0, label="warmup")
    got: dict[int, list[dict]] = {n: [] for n in p.counts}
    for r in range(p.rounds):
        for n in rotated(p.counts, r):
            log(f"fig 8: {n} models (round {r + 1})")
            got[n].append(_start(repos[n], calls=p.calls, label=f"round{r}"))
    base = statistics.median(s["rss_bytes"] for s in got[0]) if 0 in got else None
    rows = []
    for n, starts in got.items():
        row = {"models": n, "starts": starts}
        for key in ("ready_s", "rss_bytes", "index_p50_ms", "metrics_p50_ms"):
            values = [s[key] for s in starts]
            row[key] = statistics.median(values)
            row[f"{key}_range"] = [min(values), max(values)]
        row["weights_bytes"] = starts[0]["weights_bytes"]
        row["metrics_bytes"] = starts[0]["metrics_bytes"]
        row["rss_per_model_bytes"] = (
            (row["rss_bytes"] - base - row["weights_bytes"]) / n if n and base else None
        )
        rows.append(row)
    data = {
        "figure": NUMBER,
        "title": "Scale: registered bundles in one rsrv serve",
        "method": f"each configuration started once per round, {rounds(p.rounds)} whose "
        "order rotates; medians over rounds (lowest-highest); warm compilation cache; RSS "
        "per model = (RSS(N) - RSS(empty) - weights of N) / N; latency p50 over "
        f"{p.calls} calls",
        "rounds": p.rounds,
        "calls": p.calls,
        "skipped": [] if 1000 in p.counts else ["1,000 models (quick mode)"],
        "rows": rows,
    }
    save_json("fig8_scale", data)
    save_plot("fig8_scale", _draw, data)
    return data


def _repo(n: int) -> Path:
    if n:
        return bundles.scale(n)
    empty = RESULTS / "bundles" / "empty"
    empty.mkdir(parents=True, exist_ok=True)
    return empty


def _start(repo: Path, calls: int, label: str) -> dict:
    """One ``rsrv serve`` of ``repo``: seconds to ready, then (``calls`` > 0) the
    latencies, RSS and weight bytes. ``label`` names its log (one per start)."""
    names = sorted(q.name for q in repo.iterdir() if q.is_dir())
    metrics_port = free_port()
    server = start_rsrv(
        f"scale_{len(names)}_{label}", repo, COMPILE_CACHE, endpoints={"metrics_port": metrics_port}
    )
    try:
        ready = wait_ready(server, START_TIMEOUT, names)
        out = {"ready_s": ready}
        if calls:
            out.update(_latencies(server.url, metrics_port, calls))
            time.sleep(0.5)
            out["rss_bytes"] = rss_bytes(server.proc.pid)
            out["weights_bytes"] = sum(
                (repo / m / "weights.safetensors").stat().st_size for m in names
            )
        return out
    finally:
        server.stop()


def _latencies(url: str, metrics_port: int, calls: int) -> dict:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    conn = http.client.HTTPConnection(HOST, metrics_port, timeout=30)

    def index():
        client.get_model_repository_index(client_timeout=30)

    def metrics():
        conn.request("GET", "/metrics")
        answer = conn.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"/metrics answered {answer.status}")
        return len(body)

    try:
        out = {}
        for key, call in (("index", index), ("metrics", metrics)):
            for _ in range(3):  # untimed
                size = call()
            seconds = []
            for _ in range(calls):
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
            out[f"{key}_p50_ms"] = ms(percentile(seconds, 50))
            out[f"{key}_p99_ms"] = ms(percentile(seconds, 99))
            if key == "metrics":
                out["metrics_bytes"] = size
        return out
    finally:
        client.close()
        conn.close()


def _mid(row: dict, key: str, fmt: str) -> str:
    lo, hi = row[f"{key}_range"]
    text = format(row[key], fmt)
    return text if lo == hi else f"{text} ({format(lo, fmt)}-{format(hi, fmt)})"


def report(d: dict) -> tuple[list[str], list[list]]:
    out = [
        "## 8. Scale: registered bundles in one `rsrv serve`",
        "",
        f"Measured: {d['method']}."
        + (f" Skipped: {', '.join(d['skipped'])}." if d["skipped"] else ""),
        "",
        table(
            [
                [
                    f"{r['models']:,}",
                    _mid(r, "ready_s", ".2f"),
                    f"{r['rss_bytes'] / MIB:,.0f}",
                    f"{r['rss_per_model_bytes'] / 1024:,.0f}"
                    if r["rss_per_model_bytes"] is not None
                    else "-",
                    _mid(r, "index_p50_ms", ".2f"),
                    _mid(r, "metrics_p50_ms", ".2f"),
                    f"{r['metrics_bytes'] / 1024:,.0f}",
                ]
                for r in d["rows"]
            ],
            [
                "models",
                "ready s (warm cache)",
                "RSS MiB",
                "RSS KiB / model beyond weights",
                "RepositoryIndex p50 ms",
                "/metrics p50 ms",
                "/metrics KiB",
            ],
        ),
        "",
    ]
    how = f"{rounds(d['rounds'])}, rotating; medians"
    rows = []
    counted = [r for r in d["rows"] if r["models"]]
    label = " / ".join(f"{r['models']:,}" for r in counted)
    for what, fmt in (
        ("time to ready, warm cache (s)", lambda r: f"{r['ready_s']:.2f}"),
        ("RSS per model beyond weights (KiB)", lambda r: f"{r['rss_per_model_bytes'] / 1024:.0f}"),
        ("RepositoryIndex p50 (ms)", lambda r: f"{r['index_p50_ms']:.2f}"),
        ("/metrics p50 (ms)", lambda r: f"{r['metrics_p50_ms']:.2f}"),
    ):
        rows.append(
            [
                "8 scale",
                f"{what} at {label} models",
                " / ".join(fmt(r) for r in counted),
                how,
            ]
        )
    return out, rows


def _draw(plt, data: dict):
    rows = [r for r in data["rows"] if r["models"]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    labels = [f"{r['models']:,}" for r in rows]
    axes[0].bar(labels, [r["ready_s"] for r in rows], color="C0")
    axes[0].set_ylabel("seconds to ready (warm cache)")
    axes[1].bar(labels, [(r["rss_per_model_bytes"] or 0) / 1024 for r in rows], color="C1")
    axes[1].set_ylabel("RSS KiB per model beyond weights")
    xs = range(len(rows))
    axes[2].bar([i - 0.2 for i in xs], [r["index_p50_ms"] for r in rows], 0.4, label="index")
    axes[2].bar([i + 0.2 for i in xs], [r["metrics_p50_ms"] for r in rows], 0.4, label="metrics")
    axes[2].set_xticks(list(xs), labels)
    axes[2].set_ylabel("p50 latency (ms)")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("registered models")
    fig.suptitle(data["title"])
    return fig
