"""1. Serving overhead: the `classifier` bundle (256 -> 64 -> 10 MLP), one row per request.

Servers, each in its own process on 127.0.0.1, started once and measured side by side:

  rsrv            ``rsrv serve`` (a node file under results/nodes/).
  Triton          PyTriton 0.7.0's bundled tritonserver, Python backend, the same numpy
                  function, ``@batch``, dynamic batcher with max batch 8
                  (benchmarks/triton_server.py), when results/triton-venv is set up (a full
                  run sets it up once; quick mode never does). Otherwise skipped, saying why.
  purerpc echo    benchmarks/echo_server.py: stock purerpc answering ModelInfer with a
                  canned response (parses the request, builds the response).
  transport echo  benchmarks/echo_server.py --transport rsrv: rsrv's own transport
                  (``rsrv.transport.GrpcServer``) answering ModelInfer with prebuilt bytes:
                  the ceiling of the transport ``rsrv serve`` listens with.

Two load generators, one after the other; each measures every server at c = 1, 8, 32 in
interleaved rounds (per concurrency, one run per server per round, the order rotating
every round); ratios are of req/s over all rounds, with the lowest and highest per-round
ratio in parentheses:

  a. tritonclient closed loop: c threads in the driver, each with its own
     ``tritonclient.grpc`` client and connection (benchmarks/common.py). The clients
     share the driver's interpreter lock and the machine's cores with the servers.
  b. h2load (C; benchmarks/h2load.py): c connections, one stream each (``-m 1``), the same
     ModelInfer body. Per round and server: a short warm-up run, then a run of N requests
     (N sized from the last rate to take about ``h2_seconds``). Latencies are h2load's
     per-request times (``--log-file``). h2load counts HTTP 200, not grpc-status, so every
     counted request is checked: for rsrv and Triton, ModelStatistics of ``classifier``
     is read before the warm-up and after the run, and its success count must have grown
     by exactly the requests h2load completed, its fail count not at all; a server that
     fails this has its h2load ratios refused (shown as "-", with the reason). The echoes
     keep no statistics: their answer is checked once with tritonclient (as is rsrv's
     and Triton's, whose logits must agree). Skipped, saying how to install h2load,
     when it is not on PATH.

and, for the KServe V2 REST protocol (the REST column):

  c. tritonclient.http closed loop: rsrv's REST endpoint (``endpoints.http_port``, the
     same ``rsrv serve`` process) against Triton's own HTTP endpoint (the same Triton
     process), as in a (c threads, each its own ``tritonclient.http`` client and
     connection; the input and the output as binary data, tritonclient's default),
     interleaved rounds at c = 1, 8, 32. The echoes speak gRPC only. Each REST answer is
     checked once with tritonclient.http: the same logits as over gRPC.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import h2load
import numpy as np
from common import (
    COMPILE_CACHE,
    RESULTS,
    START_TIMEOUT,
    LoadResult,
    ModelCounts,
    ServerProcess,
    closed_loop,
    free_port,
    interleave,
    load_cell,
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

NUMBER = 1
TRITON_VENV = RESULTS / "triton-venv"
SYSTEM_PYTHON = Path("/usr/bin/python3.11")
ECHOES = {"purerpc echo": "purerpc", "transport echo": "rsrv"}  # name -> --transport
MODEL = "classifier"


@dataclass(frozen=True)
class Params:
    concurrency: tuple[int, ...]
    seconds: float  # a: per round and server
    rounds: int
    warmup: float
    h2_seconds: float  # b: per measured run
    h2_rounds: int


FULL = Params((1, 8, 32), 3.0, 3, 0.75, 2.5, 3)
QUICK = Params((1, 8, 32), 1.5, 1, 0.5, 1.0, 1)


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    repo = bundles.classifier()
    notes: list[str] = []
    servers: dict[str, ServerProcess] = {}
    rest: dict[str, str] = {}  # name -> HTTP address (REST)
    closed_rest = {}
    try:
        _start(repo, quick, notes, servers, rest)
        x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
        checked = _check_answers(servers, x, notes)
        checked.update(_check_rest(rest, x, notes))
        log(f"fig 1a: tritonclient closed loop: {', '.join(servers)}")
        closed = {}
        for c in p.concurrency:
            log(f"fig 1a: concurrency {c}")
            closed[c] = interleave(
                servers,
                p.rounds,
                lambda n, s, c=c: closed_loop(
                    s.url, {MODEL: {"x": x}}, c, p.seconds, warmup=p.warmup
                ),
            )
        log(f"fig 1c: tritonclient.http (REST) closed loop: {', '.join(rest)}")
        for c in p.concurrency:
            log(f"fig 1c: concurrency {c}")
            closed_rest[c] = interleave(
                {n: servers[n] for n in rest},
                p.rounds,
                lambda n, s, c=c: closed_loop(
                    rest[n], {MODEL: {"x": x}}, c, p.seconds, warmup=p.warmup, http=True
                ),
            )
        try:
            h2, refused = _h2load_part(servers, x, p, notes)
        except Exception as e:  # part a stands on its own
            h2, refused = None, set()
            notes.append(f"b (h2load) FAILED: {type(e).__name__}: {e}"[:600])
            log(notes[-1])
    finally:
        stop_all(servers.values())
    for part, points in (("a", closed), ("c", closed_rest)):
        for c, by in points.items():
            for name, r in by.items():
                if r.errors:
                    notes.append(f"{part}: {name} c={c}: {r.errors} errors, first: {r.first_error}")
    data = {
        "figure": NUMBER,
        "title": "Serving overhead: classifier (256->64->10 MLP), 1 row",
        "method": "servers side by side, each its own process; per concurrency, interleaved "
        "rounds whose order rotates; ratios of req/s over all rounds (per-round lowest-highest)",
        "servers": list(servers),
        "described": {
            "rsrv": "rsrv serve (own process)",
            "Triton": "PyTriton 0.7.0 tritonserver, Python backend, @batch, dynamic batcher "
            "max_batch_size 8 (own process)",
            "purerpc echo": "stock purerpc + trio, request parsed, canned response built "
            "(benchmarks/echo_server.py)",
            "transport echo": "rsrv.transport.GrpcServer answering prebuilt bytes "
            "(benchmarks/echo_server.py --transport rsrv): rsrv's transport ceiling",
        },
        "answers_checked": checked,
        "tritonclient": {
            "load": "closed loop, one tritonclient.grpc client (own connection) per thread, "
            "threads in the driver process",
            "rounds": p.rounds,
            "seconds_per_round": p.seconds,
            "rows": _rows(closed),
        },
        "rest": {
            "load": "closed loop, one tritonclient.http client (own connection) per thread, "
            "threads in the driver process; binary tensor data both ways",
            "servers": list(rest),
            "rounds": p.rounds,
            "seconds_per_round": p.seconds,
            "rows": _rows(closed_rest),
        },
        "h2load": h2,
        "h2load_skipped": None
        if h2 is not None
        else next(n for n in notes if n.startswith("b (h2load)")),
        "notes": notes,
    }
    if h2 is not None:
        h2["rows"] = _rows(h2.pop("points"), refused)
    save_json("fig1_overhead", data)
    save_plot("fig1_overhead", _draw, data)
    return data


# -- the servers ----------------------------------------------------------------------------


def _start(
    repo: Path,
    quick: bool,
    notes: list[str],
    servers: dict[str, ServerProcess],
    rest: dict[str, str],
) -> None:
    """Start the servers into ``servers`` (each as it starts: the caller stops them all,
    whatever fails), and the HTTP (REST) address of those that speak it into ``rest``."""
    http_port = free_port()
    servers["rsrv"] = start_rsrv(
        "overhead", repo, COMPILE_CACHE, endpoints={"http_port": http_port}
    )
    rest["rsrv"] = f"127.0.0.1:{http_port}"
    py, why = triton_python(quick)
    if py is not None:
        ports = [free_port() for _ in range(3)]
        rest["Triton"] = f"127.0.0.1:{ports[1]}"
        weights = repo / MODEL / "weights.safetensors"
        servers["Triton"] = ServerProcess(
            "triton",
            [str(py), "benchmarks/triton_server.py", str(weights), *map(str, ports)],
            ports[0],
        )
    else:
        notes.append(f"Triton skipped: {why}")
        log(notes[-1])
    for name, transport in ECHOES.items():
        port = free_port()
        servers[name] = ServerProcess(
            f"echo-{transport}",
            [sys.executable, "benchmarks/echo_server.py", "--transport", transport, str(port)],
            port,
        )
    for name, server in list(servers.items()):
        try:
            wait_ready(server, START_TIMEOUT, [MODEL] if name in ("rsrv", "Triton") else [])
        except RuntimeError as e:
            if name != "Triton":
                raise
            notes.append(f"Triton skipped: it did not start: {str(e)[:400]}")
            log(notes[-1])
            servers.pop("Triton").stop()
            rest.pop("Triton")


def triton_python(quick: bool) -> tuple[Path | None, str]:
    """The Triton venv's interpreter, set up on first use in a full run (cached under
    results/); or None and why not."""
    py = TRITON_VENV / "bin" / "python"
    ok = TRITON_VENV / ".bench-ready"
    if ok.is_file() and py.is_file():
        return py, ""
    probe = [str(py), "-c", "import pytriton.triton"]
    if py.is_file() and subprocess.run(probe, capture_output=True, timeout=120).returncode == 0:
        ok.write_text("nvidia-pytriton\n")
        return py, ""
    if quick:
        return None, (
            "the Triton environment is not set up yet and quick mode does not "
            "install it; run `just bench` (full) once"
        )
    if not SYSTEM_PYTHON.is_file():
        return None, f"{SYSTEM_PYTHON} not found (PyTriton's Python backend needs the system 3.11)"
    log("setting up the Triton environment in results/triton-venv (once; about a minute)")
    try:
        if not py.is_file():
            subprocess.run(
                [str(SYSTEM_PYTHON), "-m", "venv", str(TRITON_VENV)],
                check=True,
                capture_output=True,
                timeout=180,
            )
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "nvidia-pytriton", "numpy"],
            check=True,
            capture_output=True,
            timeout=900,
        )
        subprocess.run(probe, check=True, capture_output=True, timeout=120)
    except subprocess.CalledProcessError as e:
        output = (e.stderr or b"") + (e.stdout or b"")  # venv reports on stdout
        tail = output.decode(errors="replace").strip().splitlines()[-3:]
        return None, f"Triton setup failed ({' '.join(map(str, e.cmd[:4]))}): {' | '.join(tail)}"
    except subprocess.TimeoutExpired as e:
        return None, f"Triton setup timed out: {e.cmd}"
    ok.write_text("nvidia-pytriton\n")
    return py, ""


def _check_answers(servers: dict[str, ServerProcess], x: np.ndarray, notes: list[str]) -> dict:
    """One ModelInfer per server with tritonclient: the echoes answer FP32 [1, 10]; rsrv
    and Triton compute the same logits."""
    import tritonclient.grpc as grpcclient

    outs, checked = {}, {}
    for name, server in servers.items():
        client = grpcclient.InferenceServerClient(server.url)
        try:
            t = grpcclient.InferInput("x", list(x.shape), "FP32")
            t.set_data_from_numpy(x)
            out = client.infer(MODEL, [t]).as_numpy("logits")
        except Exception as e:
            out, checked[name] = None, f"FAILED: {type(e).__name__}: {e}"[:300]
        finally:
            client.close()
        if out is not None:
            outs[name] = out
            good = out.shape == (1, 10) and out.dtype == np.float32
            checked[name] = "logits FP32 [1, 10]" if good else f"WRONG: {out.dtype} {out.shape}"
    if "Triton" in outs and "rsrv" in outs:
        same = np.allclose(outs["rsrv"], outs["Triton"], atol=1e-4)
        checked["Triton"] += ", same logits as rsrv" if same else ", logits DIFFER from rsrv"
    notes += [f"answer of {n}: {v}" for n, v in checked.items() if not v.startswith("logits")]
    notes += [f"answer of {n}: {v}" for n, v in checked.items() if "DIFFER" in v]
    return checked


def _check_rest(rest: dict[str, str], x: np.ndarray, notes: list[str]) -> dict:
    """One inference per REST endpoint with tritonclient.http: the logits of rsrv's and
    Triton's must agree."""
    import tritonclient.http as httpclient

    outs, checked = {}, {}
    for name, url in rest.items():
        client = httpclient.InferenceServerClient(url)
        try:
            t = httpclient.InferInput("x", list(x.shape), "FP32")
            t.set_data_from_numpy(x)
            outs[name] = client.infer(MODEL, [t]).as_numpy("logits")
            good = outs[name].shape == (1, 10) and outs[name].dtype == np.float32
            checked[f"{name} REST"] = "logits FP32 [1, 10]" if good else "WRONG"
        except Exception as e:
            checked[f"{name} REST"] = f"FAILED: {type(e).__name__}: {e}"[:300]
        finally:
            client.close()
    if "Triton" in outs and "rsrv" in outs:
        same = np.allclose(outs["rsrv"], outs["Triton"], atol=1e-4)
        checked["Triton REST"] += ", same logits as rsrv" if same else ", logits DIFFER"
    notes += [f"answer of {n}: {v}" for n, v in checked.items() if v != "logits FP32 [1, 10]"]
    return checked


# -- b. h2load ------------------------------------------------------------------------------


def _h2load_part(servers, x, p: Params, notes: list[str]) -> tuple[dict | None, set]:
    exe = h2load.find()
    if exe is None:
        notes.append(
            f"b (h2load) skipped: h2load is not installed; install it with {h2load.INSTALL}"
        )
        log(notes[-1])
        return None, set()
    body = RESULTS / "h2load" / "classifier_1row.bin"
    body.parent.mkdir(parents=True, exist_ok=True)
    body.write_bytes(h2load.model_infer_body(MODEL, {"x": x}))
    stats = {n: ModelCounts(s.url, MODEL) for n, s in servers.items() if n in ("rsrv", "Triton")}
    if "Triton" in stats:  # optional for Triton (an older PyTriton guards its statistics)
        try:
            stats["Triton"].read()
        except Exception as e:
            stats.pop("Triton").close()
            notes.append(f"b: Triton's ModelStatistics cannot be read ({e}); answer checked once")
    counts = {n: s.read for n, s in stats.items()}
    runs = h2load.CheckedRuns(exe, body, p.h2_seconds, counts, notes, "b")

    points = {}
    try:
        for c in p.concurrency:
            log(f"fig 1b: h2load, concurrency {c}")
            points[c] = interleave(
                servers, p.h2_rounds, lambda n, s, c=c: runs.measure(n, s.port, c)
            )
    finally:
        for s in stats.values():
            s.close()
    checked = runs.checked("ModelStatistics delta == h2load's count")
    return {
        "load": f"h2load ({exe}): -c C -m 1 -t 1, one length-prefixed ModelInferRequest "
        "body; per round and server a warm-up run, then N requests (~h2_seconds); "
        "latencies from --log-file; req/s = 200 answers / (last end - first start)",
        "rounds": p.h2_rounds,
        "seconds_per_run": p.h2_seconds,
        "checked": checked,
        "points": points,
    }, runs.refused


# -- output ---------------------------------------------------------------------------------


def _rows(points: dict[int, dict[str, LoadResult]], refused: set = frozenset()) -> list[dict]:
    """Per concurrency: each server's summary, and rsrv / each other server (req/s over
    all rounds, per-round ratios, p50 latency); None where either side was refused."""
    rows = []
    for c, by in points.items():
        rsrv = by["rsrv"]
        row = {"concurrency": c, "servers": {n: r.summary() for n, r in by.items()}}
        row["rsrv_over"] = {}
        for name, other in by.items():
            if name == "rsrv":
                continue
            ok = (c, "rsrv") not in refused and (c, name) not in refused
            mine, theirs = row["servers"]["rsrv"]["p50_ms"], row["servers"][name]["p50_ms"]
            row["rsrv_over"][name] = {
                "req_s": ratio(rsrv.rps, other.rps) if ok else None,
                "rounds": round_ratios(rsrv, other) if ok else [],
                "p50": ratio(mine, theirs) if ok else None,
            }
        rows.append(row)
    return rows


def _table(part: dict, servers: list[str]) -> str:
    others = [n for n in servers if n != "rsrv"]
    cells = []
    for r in part["rows"]:
        line = [r["concurrency"]]
        for n in servers:
            line.append(load_cell(r["servers"].get(n)))
        for n in others:
            o = r["rsrv_over"].get(n, {})
            line.append(times(o.get("req_s"), o.get("rounds", [])))
        cells.append(line)
    return table(cells, ["clients", *servers, *(f"rsrv / {n}" for n in others)])


def report(d: dict) -> tuple[list[str], list[list]]:
    servers = d["servers"]
    out = [
        "## 1. Serving overhead (classifier, 1 row; req/s (p50 / p99 ms))",
        "",
        f"Measured: {d['method']}.",
        "",
        f"**a. tritonclient closed loop** ({d['tritonclient']['load']}; "
        f"{rounds(d['tritonclient']['rounds'])} of {d['tritonclient']['seconds_per_round']} s).",
        "",
        _table(d["tritonclient"], servers),
        "",
    ]
    if d.get("rest") is not None:
        r = d["rest"]
        out += [
            f"**c. KServe V2 REST, tritonclient.http closed loop** ({r['load']}; "
            f"{rounds(r['rounds'])} of {r['seconds_per_round']} s).",
            "",
            _table(r, r["servers"]),
            "",
        ]
    if d["h2load"] is not None:
        h = d["h2load"]
        out += [
            f"**b. h2load** ({h['load']}; {rounds(h['rounds'])}). Checked: "
            + "; ".join(f"{n}: {v}" for n, v in h["checked"].items())
            + ".",
            "",
            _table(h, servers),
            "",
        ]
    out += [f"- {n}" for n in d["notes"]]
    out.append("")
    rows = []
    if d["h2load"] is None:
        rows.append(["1 overhead (h2load)", "skipped", d["h2load_skipped"], "-"])
    cs = ", ".join(str(r["concurrency"]) for r in d["tritonclient"]["rows"])
    parts = [("tritonclient", d["tritonclient"])]
    if d.get("rest") is not None:
        parts.append(("REST", d["rest"]))
    if d["h2load"] is not None:
        parts.append(("h2load", d["h2load"]))
    for label, part in parts:
        how = f"interleaved, {rounds(part['rounds'])}"
        for n in part.get("servers", servers)[1:]:
            values = [r["rsrv_over"][n]["req_s"] for r in part["rows"]]
            rows.append(
                [
                    f"1 overhead ({label})",
                    f"rsrv / {n} req/s at c = {cs}",
                    ", ".join(times(v) for v in values),
                    how,
                ]
            )
        if label == "h2load" and "transport echo" in servers:
            first = part["rows"][0]
            rows.append(
                [
                    "1 overhead (h2load)",
                    f"p50 latency rsrv / transport echo at c = {first['concurrency']}",
                    times(first["rsrv_over"]["transport echo"]["p50"]),
                    how,
                ]
            )
    return out, rows


def _draw(plt, data: dict):
    parts = [("tritonclient closed loop", data["tritonclient"])]
    if data.get("rest") is not None:
        parts.append(("REST: tritonclient.http", data["rest"]))
    if data["h2load"] is not None:
        parts.append(("h2load", data["h2load"]))
    fig, axes = plt.subplots(1, len(parts) + 1, figsize=(5 * (len(parts) + 1), 4))
    for ax, (label, part), key in zip(
        axes, parts + [parts[-1]], ["req_s"] * len(parts) + ["p50_ms"], strict=True
    ):
        servers = part.get("servers", data["servers"])
        width = 0.8 / len(servers)
        cs = [r["concurrency"] for r in part["rows"]]
        for i, name in enumerate(servers):
            xs = [j + i * width for j in range(len(cs))]
            ax.bar(xs, [r["servers"][name][key] or 0 for r in part["rows"]], width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cs))], [f"c={c}" for c in cs])
        ax.set_ylabel("requests / s" if key == "req_s" else "p50 latency (ms)")
        ax.set_title(label if key == "req_s" else f"{label}: p50", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(data["title"])
    return fig
