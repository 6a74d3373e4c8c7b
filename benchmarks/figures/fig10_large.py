"""10. Large tensors: a request of SIZE bytes answered with SIZE bytes, unary and on a
stream, and how long the worker's event loop is held meanwhile.

One worker serves the ``blob`` bundle (benchmarks/bundles.py: model.py hooks around a
trivial module), so the wire and the codec are the work. One client (grpcio, through
tritonclient's generated stub, messages up to 2 GiB) sends a request and waits for its
answer, again and again for ``seconds``: unary ModelInfer, or ModelStreamInfer (a stream
per request). Meanwhile another process calls ServerLive in a loop; its latencies show
how long the loop is held, which every other client of the worker waits too. The probe
runs first on the idle worker for the baseline. Interleaved rounds: unary then stream,
the order alternating; per mode, answers/s over all rounds, the worker's CPU time per
answer (user + system, all its threads, from /proc; less the probe's calls, at what each
cost the idle worker), and the probe's p99 and worst
latency over all its calls (the probe runs from 0.1 s before each loop to 0.1 s after
it, so its p99 includes a little idle time; its worst does not depend on that).
answers/s is the whole loop's, the client's own work
(grpcio and protobuf in Python, on the same 2 cores) included: the worker's CPU per
answer is the server's part. Not compared with another server: the figure shows what a
large tensor costs the worker and how long it holds its loop (specs/protocol.md, Limits).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

from common import (
    HOST,
    START_TIMEOUT,
    ServerProcess,
    cpu_seconds,
    log,
    rotated,
    rounds,
    save_json,
    start_rsrv,
    stop_all,
    table,
    wait_ready,
)

import bundles

NUMBER = 10
MODES = ("unary", "stream")

#: The probe: once connected (one ServerLive answered), prints "ready", then ServerLive
#: in a loop for argv[2] seconds on argv[1], every call timed; prints its latencies (ms)
#: as JSON.
PROBE = """
import json, sys, time
import grpc
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pbg
stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(sys.argv[1]))
stub.ServerLive(pb.ServerLiveRequest())
print("ready", flush=True)
latencies, end = [], time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end:
    t = time.perf_counter()
    stub.ServerLive(pb.ServerLiveRequest())
    latencies.append((time.perf_counter() - t) * 1e3)
print(json.dumps(latencies))
"""


@dataclass(frozen=True)
class Params:
    size: int  # bytes each way
    seconds: float  # per mode and round
    rounds: int


FULL = Params(64 << 20, 4.0, 3)
QUICK = Params(16 << 20, 2.0, 1)


def run(quick: bool) -> dict:
    p = QUICK if quick else FULL
    servers: dict[str, ServerProcess] = {}
    try:
        worker = servers["rsrv"] = start_rsrv("large", bundles.blob())
        wait_ready(worker, START_TIMEOUT, ["blob"])
        stub, request = _client(worker, p.size)
        _infer(stub, request, "unary")  # (the first answer: untimed)
        before = cpu_seconds(worker.proc.pid)
        idle = _probed(worker, 2.0, lambda: None)[1]
        per_call = (cpu_seconds(worker.proc.pid) - before) / len(idle)  # a probe call's CPU
        answers = {m: 0 for m in MODES}
        seconds = {m: 0.0 for m in MODES}
        cpu = {m: 0.0 for m in MODES}
        probes: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(p.rounds):
            for mode in rotated(MODES, r):
                log(f"fig 10: {p.size >> 20} MiB each way, {mode} (round {r + 1})")
                before = cpu_seconds(worker.proc.pid)
                (count, took), latencies = _probed(
                    worker, p.seconds, lambda mode=mode: _loop(stub, request, mode, p.seconds)
                )
                # (the probe's calls taken out, at what they cost the idle worker)
                cpu[mode] += cpu_seconds(worker.proc.pid) - before - len(latencies) * per_call
                answers[mode] += count
                seconds[mode] += took
                probes[mode] += latencies
    finally:
        stop_all(servers.values())
    rows = [_row("idle", None, None, idle, p.size)]
    rows += [
        _row(m, answers[m] / seconds[m], cpu[m] / answers[m], probes[m], p.size) for m in MODES
    ]
    data = {
        "figure": NUMBER,
        "title": f"Large tensors: {p.size >> 20} MiB each way",
        "size_bytes": p.size,
        "rounds": p.rounds,
        "seconds_per_run": p.seconds,
        "rows": rows,
        "method": f"one configuration on its own; unary and stream in interleaved rounds "
        f"({rounds(p.rounds)} of {p.seconds:g} s each), a closed loop of one client; "
        "ServerLive latencies from another process, idle first",
    }
    save_json("fig10_large", data)
    return data


def _client(worker: ServerProcess, size: int):
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    options = [("grpc.max_receive_message_length", 2**31 - 1)]
    options += [("grpc.max_send_message_length", 2**31 - 1)]
    stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(worker.url, options=options))
    request = pb.ModelInferRequest(model_name="blob")
    request.inputs.add(name="blob", datatype="UINT8", shape=[1, size])
    request.raw_input_contents.append(bytes(size))
    return stub, request


def _infer(stub, request, mode: str) -> None:
    if mode == "unary":
        answer = stub.ModelInfer(request)
    else:
        (streamed,) = stub.ModelStreamInfer(iter([request]))
        if streamed.error_message:
            raise RuntimeError(streamed.error_message)
        answer = streamed.infer_response
    if len(answer.raw_output_contents[0]) != request.inputs[0].shape[1]:
        raise RuntimeError("the answer is not the size asked for")


def _loop(stub, request, mode: str, seconds: float) -> tuple[int, float]:
    """Answers in ``seconds`` (the last one finished), and the time they took."""
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        _infer(stub, request, mode)
        count += 1
    return count, time.perf_counter() - start


def _probed(worker: ServerProcess, seconds: float, work):
    """``work()``'s result, and the probe's latencies (ms) from 0.1 s before it began
    to about 0.1 s after it ended (the probe's timing starts once it is connected)."""
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, f"{HOST}:{worker.port}", str(seconds + 0.2)],
        stdout=subprocess.PIPE,
        text=True,
    )
    if probe.stdout.readline().strip() != "ready":
        probe.kill()
        raise RuntimeError(f"the ServerLive probe of {worker.url} did not start")
    time.sleep(0.1)
    result = work()
    out, _ = probe.communicate(timeout=seconds + 60)
    return result, json.loads(out)


def _row(
    mode: str, rate: float | None, cpu: float | None, latencies: list[float], size: int
) -> dict:
    ordered = sorted(latencies)
    return {
        "mode": mode,
        "answers_s": rate,
        "mb_s": None if rate is None else rate * size / 1e6,
        "worker_cpu_ms": None if cpu is None else cpu * 1e3,
        "probe_calls": len(ordered),
        "probe_p99_ms": ordered[int(0.99 * (len(ordered) - 1))],
        "probe_max_ms": ordered[-1],
    }


def report(d: dict) -> tuple[list[str], list[list]]:
    rows = d["rows"]
    lines = [
        f"## 10. {d['title']}",
        "",
        f"Measured: {d['method']}.",
        "",
        table(
            [
                [
                    r["mode"],
                    "-" if r["answers_s"] is None else f"{r['answers_s']:.2f}",
                    "-" if r["mb_s"] is None else f"{r['mb_s']:,.0f}",
                    "-" if r["worker_cpu_ms"] is None else f"{r['worker_cpu_ms']:.0f}",
                    f"{r['probe_p99_ms']:.1f} / {r['probe_max_ms']:.0f}",
                ]
                for r in rows
            ],
            [
                "mode",
                "answers/s",
                "MB/s each way",
                "worker CPU ms / answer",
                "ServerLive p99 / max (ms)",
            ],
        ),
        "",
    ]
    by = {r["mode"]: r for r in rows}
    summary = [
        [
            "10 large tensors",
            f"worst ServerLive during {d['size_bytes'] >> 20} MiB answers, unary / stream "
            f"(idle p99 {by['idle']['probe_p99_ms']:.1f} ms)",
            f"{by['unary']['probe_max_ms']:.0f} / {by['stream']['probe_max_ms']:.0f} ms",
            f"interleaved, {rounds(d['rounds'])}",
        ]
    ]
    return lines, summary
