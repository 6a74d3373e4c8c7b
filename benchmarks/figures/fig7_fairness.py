"""7. Fairness under overload: three copies of a 4x512 MLP (compiled at [1, 4]) with
node-file weights 1, 2 and 4, each driven by 8 closed-loop tritonclient clients (more than
its largest batch), so all three are always backlogged.

One server, one configuration: nothing is compared side by side, so there are no
rotating rounds. The load runs in consecutive windows (each after a short warm-up with
the same clients); per window two shares per model:

  device share  the model's ``compute_seconds`` delta (ModelControlStatus) over the sum:
                the very seconds the policy charges, so this checks its bookkeeping.
  client share  requests answered to that model's clients, counted by the load generator,
                over all answered: what each model's users got.

Shares are pooled over the windows; the lowest and highest per-window share / target are
kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from common import (
    COMPILE_CACHE,
    START_TIMEOUT,
    closed_loop_reading,
    control_status,
    log,
    ratio,
    save_json,
    save_plot,
    start_rsrv,
    table,
    times,
    wait_ready,
)

import bundles

NUMBER = 7
WIDTH, DEPTH = 512, 4
WEIGHTS = {"fair_w1": 1.0, "fair_w2": 2.0, "fair_w4": 4.0}
CLIENTS = 8  # per model: more than its largest batch (4)


@dataclass(frozen=True)
class Params:
    windows: int
    seconds: float  # per window
    warmup: float


FULL = Params(4, 5.0, 1.5)
QUICK = Params(2, 3.0, 1.0)


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    names = list(WEIGHTS)
    repo = bundles.dense("fair", WIDTH, DEPTH, [1, 4], copies=names, seed=20)
    server = start_rsrv(
        "fairness", repo, COMPILE_CACHE, models={n: {"weight": w} for n, w in WEIGHTS.items()}
    )
    windows = []
    try:
        wait_ready(server, START_TIMEOUT, names)
        x = np.random.default_rng(3).random((1, WIDTH), dtype=np.float32)
        log(
            f"fig 7: {CLIENTS} closed-loop clients per model, weights "
            f"{', '.join(f'{n}={w:g}' for n, w in WEIGHTS.items())}, {p.windows} windows"
        )
        for w in range(p.windows):
            result, before, after = closed_loop_reading(
                lambda: {m.name: m.compute_seconds for m in control_status(server.port).models},
                server.url,
                {n: {"x": x} for n in names},
                CLIENTS * len(names),
                p.seconds,
                warmup=p.warmup * (2 if w == 0 else 1),
                choose=lambda rng, i: names[i % len(names)],
            )
            windows.append(
                {
                    "device_seconds": {n: after[n] - before[n] for n in names},
                    "answered": {n: result.per_model.get(n, 0) for n in names},
                    "errors": result.errors,
                    "first_error": result.first_error,
                }
            )
    finally:
        server.stop()
    total_weight = sum(WEIGHTS.values())

    def shares(values: dict[str, float]) -> dict[str, float]:
        total = sum(values.values())
        return {n: v / total if total else float("nan") for n, v in values.items()}

    pooled_device = shares({n: sum(w["device_seconds"][n] for w in windows) for n in names})
    pooled_client = shares({n: sum(w["answered"][n] for w in windows) for n in names})
    per_window = [
        (shares(w["device_seconds"]), shares({n: float(v) for n, v in w["answered"].items()}))
        for w in windows
    ]
    seconds = p.seconds * p.windows
    rows = []
    for n in names:
        target = WEIGHTS[n] / total_weight
        rows.append(
            {
                "model": n,
                "weight": WEIGHTS[n],
                "target_share": round(target, 4),
                "device_share": round(pooled_device[n], 4),
                "device_over_target": ratio(pooled_device[n], target),
                "windows_device_over_target": [d[n] / target for d, _ in per_window],
                "client_share": round(pooled_client[n], 4),
                "client_over_target": ratio(pooled_client[n], target),
                "windows_client_over_target": [c[n] / target for _, c in per_window],
                "device_seconds": round(sum(w["device_seconds"][n] for w in windows), 3),
                "client_req_s": round(sum(w["answered"][n] for w in windows) / seconds, 1),
            }
        )
    busy = sum(sum(w["device_seconds"].values()) for w in windows) / seconds
    data = {
        "figure": NUMBER,
        "title": "Fairness under overload: device-time and client throughput shares vs weights",
        "model": f"{DEPTH} dense layers of {WIDTH}, compiled at [1, 4]",
        "clients_per_model": CLIENTS,
        "windows": p.windows,
        "seconds_per_window": p.seconds,
        "device_busy_fraction": round(busy, 3),
        "method": f"one server, one configuration (no rotating rounds): {p.windows} "
        f"consecutive windows of {p.seconds} s under constant load; device share from "
        "compute_seconds (what the policy charges), client share from requests answered per "
        "model counted by the load generator; pooled over windows (per-window lowest-highest)",
        "rows": rows,
        "errors": sum(w["errors"] for w in windows),
        "first_error": next((w["first_error"] for w in windows if w["first_error"]), ""),
    }
    save_json("fig7_fairness", data)
    save_plot("fig7_fairness", _draw, data)
    return data


def report(d: dict) -> tuple[list[str], list[list]]:
    out = [
        f"## 7. Fairness under overload ({d['clients_per_model']} clients per model, device "
        f"busy {d['device_busy_fraction']:.0%})",
        "",
        f"Measured: {d['method']}.",
        "",
        table(
            [
                [
                    r["model"],
                    r["weight"],
                    f"{r['target_share']:.3f}",
                    f"{r['device_share']:.3f}",
                    times(r["device_over_target"], r["windows_device_over_target"]),
                    f"{r['client_share']:.3f}",
                    times(r["client_over_target"], r["windows_client_over_target"]),
                    r["client_req_s"],
                ]
                for r in d["rows"]
            ],
            [
                "model",
                "weight",
                "target share",
                "device share",
                "device / target",
                "client share",
                "client / target",
                "req/s",
            ],
        ),
        "",
    ]
    if d["errors"]:
        out += [f"Errors: {d['errors']}, first: {d['first_error']}", ""]
    how = f"one run, {d['windows']} windows"
    rows = [
        [
            "7 fairness",
            f"{kind} share / weight share, weights 1 : 2 : 4",
            ", ".join(times(r[f"{key}_over_target"]) for r in d["rows"]),
            how,
        ]
        for kind, key in (("device-time", "device"), ("client throughput", "client"))
    ]
    return out, rows


def _draw(plt, data: dict):
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    for offset, key, label in (
        (-0.27, "target_share", "configured weight share"),
        (0.0, "device_share", "device-time share (charged)"),
        (0.27, "client_share", "client throughput share"),
    ):
        ax.bar([i + offset for i in xs], [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(list(xs), [f"{r['model']} (w={r['weight']:g})" for r in rows])
    ax.set_ylabel("share")
    ax.legend(fontsize=8)
    ax.set_title(data["title"], fontsize=9)
    return fig
