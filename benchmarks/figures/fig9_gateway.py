"""9. The gateway: what a hop through ``rsrv gateway`` costs, and what lpt_packing's fill
routing does to batches.

(a) Overhead: one ``rsrv serve`` worker (the example ``classifier``) and an
``rsrv gateway`` in front of it; tritonclient closed loop at each concurrency, straight
to the worker and through the gateway, in interleaved rounds whose order rotates.
Ratio: gateway / direct req/s over all rounds (per-round lowest-highest), p50 of each;
and the CPU each process spent per request (user + system from /proc over the measured
windows: the load generator, the worker, the gateway), which on a machine whose cores
they share sets the throughput.

(b) Coalescing: two workers on fifo with a 2 ms queue delay
(``scheduler.max_queue_delay_seconds``) and a dense model compiled at [1, 8], and three
gateways in front of the same two workers: round robin, lpt_packing (two replicas, fill
routing) with its default run hold, and lpt_packing without one; 16 closed-loop clients
through each gateway in interleaved rounds. Rows per execution from the workers'
ModelControlStatus (rows served over dispatches, summed over both workers, read when each
window opens and closes).

(c) The same hop with a C load generator: h2load (benchmarks/h2load.py; c connections,
one stream each, the same ModelInfer body) straight to the worker, through the gateway,
through a trio byte relay (benchmarks/trio_relay.py: one connection upstream per client
connection, bytes passed through unparsed: with one client, the least any proxy
written on trio does), and
through nghttpx (nghttp2's C HTTP/2 reverse proxy, one worker thread in one process,
one HTTP/2 connection to the worker) when it is installed: what any proxy in that place
costs on this machine. Interleaved rounds whose order rotates; per round and path a
warm-up run, then about ``h2_seconds`` of requests. Every request h2load counts is
checked against the worker's ModelStatistics (every path ends at the same worker).
CPU per request of the worker and the proxy over the warm-ups and runs. Skipped, saying
how to install h2load, when it is not on PATH.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import h2load
import numpy as np
from common import (
    COMPILE_CACHE,
    RESULTS,
    START_TIMEOUT,
    ModelCounts,
    ServerProcess,
    closed_loop_reading,
    control_status,
    cpu_seconds,
    free_port,
    interleave,
    load_cell,
    log,
    ratio,
    round_ratios,
    rounds,
    rps_ratio,
    save_json,
    start_rsrv,
    stop_all,
    table,
    times,
    wait_ready,
)

import bundles

NUMBER = 9
QUEUE_DELAY = 0.002  # seconds a batch may wait to fill (b)
WIDTH, DEPTH = 1024, 4
SIZES = [1, 8]  # the dense model's compiled batch sizes (b)
PACKING = 'mode = "lpt_packing"\ndefault_replicas = "all"'
MODES = {  # (b): lpt_packing with its default run hold, and without any
    "round_robin": 'mode = "round_robin"',
    "lpt_packing": PACKING,
    "lpt_packing_no_hold": PACKING + "\nrouting_fill_hold_seconds = 0",
}


@dataclass(frozen=True)
class Params:
    concurrency: tuple[int, ...]
    seconds: float
    rounds: int
    warmup: float
    fill_clients: int
    h2_seconds: float  # c: per measured run
    h2_rounds: int


FULL = Params((1, 8, 32), 2.5, 3, 0.75, 16, 2.0, 3)
QUICK = Params((1, 8, 32), 1.5, 1, 0.5, 16, 1.0, 1)
PROXIES = {  # (c): what each path other than the gateway goes through
    "trio relay": "benchmarks/trio_relay.py: bytes relayed on trio, nothing parsed",
    "nghttpx": "nghttpx (nghttp2), one process, HTTP/2 to the worker",
}
NGHTTPX_INSTALL = "apt-get install nghttp2-proxy (Debian/Ubuntu; the nghttp2 package elsewhere)"


def start_gateway(name: str, workers: list[ServerProcess], scheduling: str) -> ServerProcess:
    port = free_port()
    path = RESULTS / "nodes" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    endpoints = ", ".join(f'"{w.url}"' for w in workers)
    path.write_text(
        f'endpoints = [{endpoints}]\n\n[listen]\ngrpc = "127.0.0.1:{port}"\n'
        f'metrics = "127.0.0.1:{free_port()}"\n\n[discovery]\ninterval_seconds = 0.5\n\n'
        f'[scheduling]\n{scheduling}\n\n[logging]\nlevel = "warning"\n'
    )
    return ServerProcess(
        f"gateway-{name}", [sys.executable, "-m", "rsrv.cli", "gateway", str(path)], port
    )


def start_nghttpx(exe: str, worker: ServerProcess) -> ServerProcess:
    """nghttpx in front of ``worker``: cleartext HTTP/2 in, one HTTP/2 connection out."""
    port = free_port()
    argv = [
        exe,
        "--conf=/dev/null",
        f"--frontend=127.0.0.1,{port};no-tls",
        f"--backend=127.0.0.1,{worker.port};;proto=h2",
        "--single-process",  # one process, whose CPU /proc reports
        "--workers=1",
        "--log-level=WARN",
    ]
    return ServerProcess("gw_nghttpx", argv, port)


def start_trio_relay(worker: ServerProcess) -> ServerProcess:
    """benchmarks/trio_relay.py in front of ``worker``: bytes relayed, nothing parsed."""
    port = free_port()
    relay = str(Path(__file__).resolve().parent.parent / "trio_relay.py")
    argv = [sys.executable, relay, str(port), str(worker.port)]
    return ServerProcess("gw_trio_relay", argv, port)


def overhead(p: Params, notes: list[str]) -> tuple[list[dict], dict | None]:
    """Parts (a) and (c), on one worker and one gateway."""
    servers: dict[str, ServerProcess] = {}  # (each as it starts: all stopped, whatever fails)
    try:
        worker = servers["direct"] = start_rsrv("gw_direct", bundles.classifier(), COMPILE_CACHE)
        wait_ready(worker, START_TIMEOUT, ["classifier"])
        gateway = servers["gateway"] = start_gateway("gw_front", [worker], MODES["round_robin"])
        wait_ready(gateway, START_TIMEOUT, ["classifier"])
        x = np.random.default_rng(2).random((1, 256), dtype=np.float32)
        rows = closed_loop_overhead(p, servers, x)
        try:
            h2 = h2load_overhead(p, servers, x, notes)
        except Exception as e:  # part a stands on its own
            h2 = None
            notes.append(f"c (h2load) FAILED: {type(e).__name__}: {e}"[:600])
            log(notes[-1])
        return rows, h2
    finally:
        stop_all(servers.values())


def closed_loop_overhead(p: Params, servers: dict[str, ServerProcess], x) -> list[dict]:
    worker, gateway = servers["direct"], servers["gateway"]
    rows = []
    pids = {"client": None, "worker": worker.proc.pid, "gateway": gateway.proc.pid}
    for c in p.concurrency:
        log(f"fig 9a: concurrency {c}")
        cpu = {n: dict.fromkeys(pids, 0.0) for n in servers}
        completed = dict.fromkeys(servers, 0)

        def measure(name, server, c=c, cpu=cpu, completed=completed):
            r, before, after = closed_loop_reading(
                lambda: {k: cpu_seconds(pid) for k, pid in pids.items()},
                server.url,
                {"classifier": {"x": x}},
                c,
                p.seconds,
                warmup=p.warmup,
            )
            for k in pids:
                cpu[name][k] += after[k] - before[k]
            completed[name] += r.completed
            return r

        by = interleave(servers, p.rounds, measure)
        rows.append(
            {
                "concurrency": c,
                "direct": by["direct"].summary(),
                "gateway": by["gateway"].summary(),
                "ratio": rps_ratio(by["gateway"], by["direct"]),
                "rounds_ratio": round_ratios(by["gateway"], by["direct"]),
                "cpu_us_per_request": {
                    n: {k: round(v * 1e6 / max(completed[n], 1)) for k, v in cpu[n].items()}
                    for n in servers
                },
            }
        )
    return rows


def h2load_overhead(p: Params, servers: dict[str, ServerProcess], x, notes) -> dict | None:
    exe = h2load.find()
    if exe is None:
        notes.append(
            f"c (h2load) skipped: h2load is not installed; install it with {h2load.INSTALL}"
        )
        log(notes[-1])
        return None
    worker = servers["direct"]
    proxies = {"trio relay": start_trio_relay(worker)}
    try:
        proxy = shutil.which("nghttpx")
        if proxy is None:
            notes.append(f"c: nghttpx is not installed (install it with {NGHTTPX_INSTALL})")
        else:
            proxies["nghttpx"] = start_nghttpx(proxy, worker)
        for server in proxies.values():
            wait_ready(server, START_TIMEOUT, ["classifier"])
        return _h2load_paths(p, {**servers, **proxies}, x, notes, exe)
    finally:
        stop_all(proxies.values())


def _h2load_paths(p: Params, paths: dict[str, ServerProcess], x, notes, exe: str) -> dict:
    """h2load on each of ``paths`` ("direct": the worker), interleaved."""
    worker = paths["direct"]
    body = RESULTS / "h2load" / "gateway_classifier_1row.bin"
    body.parent.mkdir(parents=True, exist_ok=True)
    body.write_bytes(h2load.model_infer_body("classifier", {"x": x}))
    counts = ModelCounts(worker.url, "classifier")
    runs = h2load.CheckedRuns(
        exe, body, p.h2_seconds, dict.fromkeys(paths, counts.read), notes, "c"
    )
    pids = {("worker" if n == "direct" else n): server.proc.pid for n, server in paths.items()}
    rows = []
    try:
        for c in p.concurrency:
            log(f"fig 9c: h2load, concurrency {c}")
            cpu = {n: dict.fromkeys(pids, 0.0) for n in paths}
            answered = dict(runs.answered)

            def measure(name, server, c=c, cpu=cpu):
                before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                result = runs.measure(name, server.port, c)
                for k, pid in pids.items():
                    cpu[name][k] += cpu_seconds(pid) - before[k]
                return result

            by = interleave(paths, p.h2_rounds, measure)
            row = {"concurrency": c, "paths": {n: r.summary() for n, r in by.items()}}
            for name in paths:
                n = max(runs.answered[name] - answered.get(name, 0), 1)
                row["paths"][name]["cpu_us_per_request"] = {
                    k: round(v * 1e6 / n) for k, v in cpu[name].items() if k in ("worker", name)
                }
                if name != "direct":
                    ok = not {(c, name), (c, "direct")} & runs.refused
                    row["paths"][name]["over_direct"] = (
                        ratio(by[name].rps, by["direct"].rps) if ok else None
                    )
                    row["paths"][name]["rounds_over_direct"] = (
                        round_ratios(by[name], by["direct"]) if ok else []
                    )
            rows.append(row)
    finally:
        counts.close()
    return {
        "load": f"h2load ({exe}): -c C -m 1 -t 1, one length-prefixed ModelInferRequest body",
        "proxies": {n: PROXIES[n] for n in paths if n in PROXIES},
        "rounds": p.h2_rounds,
        "seconds_per_run": p.h2_seconds,
        "checked": runs.checked("the worker's ModelStatistics delta == h2load's count"),
        "rows": rows,
    }


def coalescing(p: Params) -> dict:
    repo = bundles.dense("dense_b1_8", WIDTH, DEPTH, SIZES)
    workers, gateways = [], {}
    try:
        for i in range(2):
            workers.append(
                start_rsrv(
                    f"gw_fill{i}",
                    repo,
                    COMPILE_CACHE,
                    scheduler={"discipline": "fifo", "max_queue_delay_seconds": QUEUE_DELAY},
                )
            )
        for w in workers:
            wait_ready(w, START_TIMEOUT, ["dense"])
        for mode, scheduling in MODES.items():
            gateways[mode] = start_gateway(f"gw_{mode}", workers, scheduling)
        for g in gateways.values():
            wait_ready(g, START_TIMEOUT, ["dense"])
        time.sleep(1.5)  # a few discovery rounds: both workers known, placement done
        x = np.random.default_rng(3).random((1, WIDTH), dtype=np.float32)
        counts: dict[str, list[tuple[int, int]]] = {m: [] for m in MODES}

        def totals() -> tuple[int, int]:  # (dispatches, rows served) over both workers
            models = [control_status(w.port).models[0] for w in workers]
            return sum(m.dispatches for m in models), sum(m.rows_served for m in models)

        def measure(mode, gateway):
            r, before, after = closed_loop_reading(
                totals,
                gateway.url,
                {"dense": {"x": x}},
                p.fill_clients,
                p.seconds,
                warmup=p.warmup,
            )
            counts[mode].append((after[0] - before[0], after[1] - before[1]))
            return r

        log("fig 9b: fill routing vs round robin")
        by = interleave(gateways, p.rounds, measure)
    finally:
        stop_all([*gateways.values(), *workers])
    per_dispatch = {}
    for mode, pairs in counts.items():
        dispatches, served = sum(a for a, _ in pairs), sum(b for _, b in pairs)
        # (no figure from a mode whose requests failed: its batches say nothing)
        per_dispatch[mode] = served / dispatches if dispatches and not by[mode].errors else None
    return {
        "clients": p.fill_clients,
        "rows_per_execution": per_dispatch,
        "ratio": ratio(per_dispatch["lpt_packing"], per_dispatch["round_robin"]),
        "ratio_no_hold": ratio(per_dispatch["lpt_packing_no_hold"], per_dispatch["round_robin"]),
        # the ratio if every lpt_packing execution ran a full batch: no routing does better
        "ceiling": ratio(max(SIZES), per_dispatch["round_robin"]),
        "req_s": {m: r.summary()["req_s"] for m, r in by.items()},
        "errors": {m: r.errors for m, r in by.items()},
        "first_error": {m: r.first_error for m, r in by.items() if r.errors},
    }


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    notes: list[str] = []
    closed, h2 = overhead(p, notes)
    data = {
        "figure": NUMBER,
        "title": "Gateway: one hop's cost, and fill routing's batches",
        "method": f"(a) a worker and a gateway in front of it side by side, tritonclient "
        f"closed loop in interleaved rounds whose order rotates ({rounds(p.rounds)} of "
        f"{p.seconds} s per concurrency); (b) three gateways (round robin; lpt_packing with "
        "its default run hold, and without) in "
        f"front of the same two fifo workers (queue delay {QUEUE_DELAY * 1e3:g} ms), "
        f"{p.fill_clients} closed-loop clients, "
        "interleaved rounds; rows per execution from the workers' ModelControlStatus; "
        "(c) h2load straight to the worker, through the gateway, through a trio byte relay "
        "and through nghttpx (a C HTTP/2 proxy), interleaved rounds "
        f"({rounds(p.h2_rounds)} of about {p.h2_seconds} s per path and concurrency), "
        "each request checked against the worker's statistics",
        "overhead": closed,
        "h2load": h2,
        "coalescing": coalescing(p),
        "rounds": p.rounds,
        "notes": notes,
    }
    save_json("fig9_gateway", data)
    return data


def report(d: dict) -> tuple[list[str], list[list]]:
    c = d["coalescing"]
    out = [
        "## 9. Gateway (req/s; p50 / p99 ms)",
        "",
        f"Measured: {d['method']}.",
        "",
        "**a. tritonclient closed loop**",
        "",
        table(
            [
                [
                    r["concurrency"],
                    *[load_cell(r[k]) for k in ("direct", "gateway")],
                    times(r["ratio"], r["rounds_ratio"]),
                ]
                for r in d["overhead"]
            ],
            ["clients", "direct", "through the gateway", "gateway / direct"],
        ),
        "",
        "CPU per request (µs; the load generator's threads, the worker, the gateway; "
        "user + system, over the measured windows):",
        "",
        table(
            [
                [
                    r["concurrency"],
                    "{client} + {worker}".format(**r["cpu_us_per_request"]["direct"]),
                    "{client} + {worker} + {gateway}".format(**r["cpu_us_per_request"]["gateway"]),
                ]
                for r in d["overhead"]
                if "cpu_us_per_request" in r
            ],
            ["clients", "direct: client + worker", "through: client + worker + gateway"],
        ),
        "",
        *_h2load_report(d.get("h2load")),
        "**b. Coalescing**",
        "",
        table(
            [
                [
                    m,
                    _or_dash(c["rows_per_execution"][m]),
                    f"{c['req_s'][m]:,.0f}",
                    c.get("errors", {}).get(m, 0),
                ]
                for m in MODES
            ],
            ["gateway mode", "rows per execution", "req/s", "failed requests"],
        ),
        "",
        f"lpt_packing / round robin: {times(c['ratio'])} (without a run hold: "
        f"{times(c.get('ratio_no_hold'))}); {times(c.get('ceiling'))} if every "
        f"lpt_packing execution held {max(SIZES)} rows (the most any routing could reach "
        "against these round-robin batches).",
        "",
    ]
    rows = [
        [
            "9 gateway",
            "through the gateway / direct at c = "
            + ", ".join(str(r["concurrency"]) for r in d["overhead"]),
            ", ".join(times(r["ratio"]) for r in d["overhead"]),
            f"interleaved, {rounds(d['rounds'])}",
        ],
        *_h2load_rows(d.get("h2load"), d.get("notes", [])),
        [
            "9 gateway",
            f"rows per execution, lpt_packing / round_robin ({c['clients']} clients)",
            times(c["ratio"]),
            f"interleaved, {rounds(d['rounds'])}",
        ],
    ]
    out += [f"- {n}" for n in d.get("notes", [])]
    out += [f"- 9b {m}: first error: {e}" for m, e in c.get("first_error", {}).items()]
    return out, rows


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _h2load_report(h: dict | None) -> list[str]:
    if h is None:
        return []
    names = list(h["rows"][0]["paths"])
    proxies = names[1:]

    return [
        f"**c. h2load** ({h['load']}; {rounds(h['rounds'])} of about "
        f"{h['seconds_per_run']} s per path). Checked: "
        + "; ".join(f"{n}: {v}" for n, v in h["checked"].items())
        + ".",
        "",
        table(
            [
                [
                    r["concurrency"],
                    *[load_cell(r["paths"][n]) for n in names],
                    *[
                        times(r["paths"][n]["over_direct"], r["paths"][n]["rounds_over_direct"])
                        for n in proxies
                    ],
                ]
                for r in h["rows"]
            ],
            ["clients", *names, *(f"{n} / direct" for n in proxies)],
        ),
        "",
        "CPU per request (µs; user + system over the warm-ups and runs):",
        "",
        table(
            [
                [
                    r["concurrency"],
                    *[
                        " + ".join(
                            f"{k} {v}" for k, v in r["paths"][n]["cpu_us_per_request"].items()
                        )
                        for n in names
                    ],
                ]
                for r in h["rows"]
            ],
            ["clients", *names],
        ),
        "",
    ]


def _h2load_rows(h: dict | None, notes: list[str]) -> list[list]:
    if h is None:  # (skipped or failed: the summary says so, and why)
        why = next((n for n in notes if n.startswith("c (h2load) ")), "c (h2load) not run")
        why = " ".join(why.removeprefix("c (h2load) ").split())[:200]  # (one table line)
        return [["9 gateway (h2load)", "-", why, "-"]]
    cs = ", ".join(str(r["concurrency"]) for r in h["rows"])
    return [
        [
            "9 gateway (h2load)",
            f"through {n} / direct at c = {cs}",
            ", ".join(times(r["paths"][n]["over_direct"]) for r in h["rows"]),
            f"interleaved, {rounds(h['rounds'])}",
        ]
        for n in list(h["rows"][0]["paths"])[1:]
    ]
