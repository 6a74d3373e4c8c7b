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
(``scheduler.max_queue_delay_seconds``) and a dense model compiled at [1, 8], and two
gateways in front of the same two workers, one round robin and one lpt_packing (two
replicas, fill routing); 16 closed-loop clients through each gateway in interleaved
rounds. Rows per execution from the workers' ModelControlStatus (rows served over
dispatches, summed over both workers, read when each window opens and closes).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
from common import (
    COMPILE_CACHE,
    RESULTS,
    START_TIMEOUT,
    ServerProcess,
    closed_loop,
    control_status,
    cpu_seconds,
    free_port,
    interleave,
    log,
    ratio,
    round_ratios,
    rounds,
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
MODES = {
    "round_robin": 'mode = "round_robin"',
    "lpt_packing": 'mode = "lpt_packing"\ndefault_replicas = "all"',
}


@dataclass(frozen=True)
class Params:
    concurrency: tuple[int, ...]
    seconds: float
    rounds: int
    warmup: float
    fill_clients: int


FULL = Params((1, 8, 32), 2.5, 3, 0.75, 16)
QUICK = Params((1, 8, 32), 1.5, 1, 0.5, 16)


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


def overhead(p: Params) -> list[dict]:
    servers: dict[str, ServerProcess] = {}
    try:
        worker = start_rsrv("gw_direct", bundles.classifier(), COMPILE_CACHE)
        wait_ready(worker, START_TIMEOUT, ["classifier"])
        gateway = start_gateway("gw_front", [worker], MODES["round_robin"])
        wait_ready(gateway, START_TIMEOUT, ["classifier"])
        servers = {"direct": worker, "gateway": gateway}
        x = np.random.default_rng(2).random((1, 256), dtype=np.float32)
        rows = []
        pids = {"client": None, "worker": worker.proc.pid, "gateway": gateway.proc.pid}
        for c in p.concurrency:
            log(f"fig 9a: concurrency {c}")
            cpu = {n: dict.fromkeys(pids, 0.0) for n in servers}
            completed = dict.fromkeys(servers, 0)

            def measure(name, server, c=c, cpu=cpu, completed=completed):
                marks = []

                def mark():
                    marks.append({k: cpu_seconds(pid) for k, pid in pids.items()})

                r = closed_loop(
                    server.url,
                    {"classifier": {"x": x}},
                    c,
                    p.seconds,
                    warmup=p.warmup,
                    at_start=mark,
                    at_end=mark,
                )
                for k in pids:
                    cpu[name][k] += marks[1][k] - marks[0][k]
                completed[name] += r.completed
                return r

            by = interleave(servers, p.rounds, measure)
            rows.append(
                {
                    "concurrency": c,
                    "direct": by["direct"].summary(),
                    "gateway": by["gateway"].summary(),
                    "ratio": ratio(by["gateway"].rps, by["direct"].rps),
                    "rounds_ratio": round_ratios(by["gateway"], by["direct"]),
                    "cpu_us_per_request": {
                        n: {k: round(v * 1e6 / max(completed[n], 1)) for k, v in cpu[n].items()}
                        for n in servers
                    },
                }
            )
        return rows
    finally:
        stop_all(servers.values())


def coalescing(p: Params) -> dict:
    repo = bundles.dense("dense_b1_8", WIDTH, DEPTH, [1, 8])
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

        def measure(mode, gateway):
            snaps = []

            def snap():
                models = [control_status(w.port).models[0] for w in workers]
                snaps.append(
                    (sum(m.dispatches for m in models), sum(m.rows_served for m in models))
                )

            r = closed_loop(
                gateway.url,
                {"dense": {"x": x}},
                p.fill_clients,
                p.seconds,
                warmup=p.warmup,
                at_start=snap,
                at_end=snap,
            )
            counts[mode].append((snaps[1][0] - snaps[0][0], snaps[1][1] - snaps[0][1]))
            return r

        log("fig 9b: fill routing vs round robin")
        by = interleave(gateways, p.rounds, measure)
    finally:
        stop_all([*gateways.values(), *workers])
    per_dispatch = {}
    for mode, pairs in counts.items():
        dispatches, served = sum(a for a, _ in pairs), sum(b for _, b in pairs)
        per_dispatch[mode] = served / dispatches if dispatches else None
    return {
        "clients": p.fill_clients,
        "rows_per_execution": per_dispatch,
        "ratio": ratio(per_dispatch["lpt_packing"], per_dispatch["round_robin"]),
        "req_s": {m: r.summary()["req_s"] for m, r in by.items()},
    }


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    data = {
        "figure": NUMBER,
        "title": "Gateway: one hop's cost, and fill routing's batches",
        "method": f"(a) a worker and a gateway in front of it side by side, tritonclient "
        f"closed loop in interleaved rounds whose order rotates ({rounds(p.rounds)} of "
        f"{p.seconds} s per concurrency); (b) two gateways (round robin, lpt_packing) in "
        f"front of the same two fifo workers (queue delay {QUEUE_DELAY * 1e3:g} ms), "
        f"{p.fill_clients} closed-loop clients, "
        "interleaved rounds; rows per execution from the workers' ModelControlStatus",
        "overhead": overhead(p),
        "coalescing": coalescing(p),
        "rounds": p.rounds,
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
        table(
            [
                [
                    r["concurrency"],
                    *[
                        f"{r[k]['req_s']:,.0f} ({r[k]['p50_ms']:.2f} / {r[k]['p99_ms']:.2f})"
                        for k in ("direct", "gateway")
                    ],
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
        table(
            [
                [m, f"{c['rows_per_execution'][m]:.2f}", f"{c['req_s'][m]:,.0f}"]
                for m in MODES
                if c["rows_per_execution"][m] is not None
            ],
            ["gateway mode", "rows per execution", "req/s"],
        ),
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
        [
            "9 gateway",
            f"rows per execution, lpt_packing / round_robin ({c['clients']} clients)",
            times(c["ratio"]),
            f"interleaved, {rounds(d['rounds'])}",
        ],
    ]
    return out, rows
