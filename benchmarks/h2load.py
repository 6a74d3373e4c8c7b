"""A C load generator for the transport figures: nghttp2's ``h2load``.

``h2load`` (Debian/Ubuntu: ``apt-get install nghttp2-client``) opens ``c`` HTTP/2
connections with one stream each (``-m 1``) and sends the same request body back to back
until ``n`` requests have been answered. The body here is one gRPC message: a 5-byte
length prefix and a serialized ``inference.ModelInferRequest``, POSTed to
``/inference.GRPCInferenceService/ModelInfer`` with ``content-type: application/grpc`` and
``te: trailers``. Unlike a Python client it shares no interpreter lock with anything.

h2load counts HTTP status 200, not ``grpc-status``: a gRPC error still answers 200. So a
run proves nothing about success on its own; the figure checks every counted request
against the server's own statistics (see ``fig1_overhead``).

Per-request times come from h2load's ``--log-file`` (start time, status, microseconds
until the end of the response): latency percentiles are over those, and req/s is the
number of 200 answers over the span from the first request's start to the last one's end
(connection setup before the first request is not in it).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import HOST, LoadResult, log, triton_dtype

INSTALL = "apt-get install nghttp2-client (Debian/Ubuntu; the nghttp2 package elsewhere)"
PATH = "/inference.GRPCInferenceService/ModelInfer"


def find() -> str | None:
    """The h2load executable, or None."""
    return shutil.which("h2load")


def model_infer_body(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    """One length-prefixed gRPC message: a ModelInferRequest carrying ``inputs`` as raw
    contents (what ``tritonclient.grpc`` sends for the same call)."""
    from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(
        model_name=model,
        inputs=[
            pb.ModelInferRequest.InferInputTensor(
                name=name, datatype=triton_dtype(a.dtype), shape=list(a.shape)
            )
            for name, a in inputs.items()
        ],
        raw_input_contents=[np.ascontiguousarray(a).tobytes() for a in inputs.values()],
    )
    message = request.SerializeToString()
    return struct.pack(">?I", False, len(message)) + message


@dataclass
class H2Run:
    """One h2load invocation: what it reported and what its log file says."""

    requests: int  # asked for (-n)
    succeeded: int  # h2load's count (HTTP 2xx)
    failed: int  # h2load's failed + errored + timeout
    result: LoadResult  # from the log: 200 answers, their latencies, their span


def run(
    exe: str,
    port: int,
    body: Path,
    concurrency: int,
    requests: int,
    log_file: Path,
    timeout: float = 120.0,
) -> H2Run:
    """``h2load -n REQUESTS -c CONCURRENCY -m 1`` against ModelInfer on ``port``."""
    log_file.unlink(missing_ok=True)  # h2load appends to it
    argv = [
        exe,
        "-n",
        str(max(requests, concurrency)),
        "-c",
        str(concurrency),
        "-m",
        "1",
        "-t",
        "1",
        "-d",
        str(body),
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        "--log-file",
        str(log_file),
        f"http://{HOST}:{port}{PATH}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"h2load exited {done.returncode}: {done.stderr.strip()[-400:]}")
    counts = _counts(done.stdout)
    return H2Run(
        max(requests, concurrency),
        counts["succeeded"],
        counts["failed"] + counts["errored"] + counts["timeout"],
        _from_log(log_file, concurrency),
    )


def _counts(stdout: str) -> dict[str, int]:
    """The 'requests: N total, N started, N done, N succeeded, N failed, ...' line."""
    for line in stdout.splitlines():
        if line.startswith("requests:"):
            out = {}
            for part in line.split(":", 1)[1].split(","):
                number, word = part.split()
                out[word] = int(number)
            return out
    raise RuntimeError(f"h2load printed no request counts:\n{stdout[-800:]}")


def _from_log(path: Path, concurrency: int) -> LoadResult:
    rows = np.loadtxt(path, dtype=np.int64, ndmin=2, usecols=(0, 1, 2))
    ok = rows[rows[:, 1] == 200] if len(rows) else rows
    latencies = (ok[:, 2] / 1e6).tolist() if len(ok) else []
    span = (ok[:, 0] + ok[:, 2]).max() - ok[:, 0].min() if len(ok) else 0
    return LoadResult(
        concurrency,
        span / 1e6,
        len(ok),
        len(rows) - len(ok),
        latencies,
        first_error="" if len(ok) == len(rows) else f"{len(rows) - len(ok)} answers not 200",
    )


class CheckedRuns:
    """h2load runs whose every counted request is checked.

    :meth:`measure` makes one measurement of a server at one concurrency: a short
    warm-up run, then a run of N requests, N sized from the last rate at that
    concurrency to take about ``seconds``. Where ``counts`` has a reader for the server
    (its (success, fail) counts of the model, e.g. from ModelStatistics), it is read
    before the warm-up and after the run: success must have grown by exactly the
    requests h2load completed, fail not at all. A measurement that fails this, or in
    which h2load saw a failure, is refused (``refused`` holds its (concurrency, server);
    ``notes`` says why). ``checks`` counts, per server, the measurements checked and
    refused; ``answered`` the requests each server answered over warm-ups and runs.
    """

    def __init__(
        self,
        exe: str,
        body: Path,
        seconds: float,
        counts: dict[str, Callable[[], tuple[int, int]]],
        notes: list[str],
        label: str,
    ):
        self.exe, self.body, self.seconds = exe, body, seconds
        self.counts, self.notes, self.label = counts, notes, label
        self.rate: dict[tuple[str, int], float] = {}
        self.checks: dict[str, list[int]] = {}  # name -> [measured, refused]
        self.answered: dict[str, int] = {}
        self.refused: set[tuple[int, str]] = set()

    def measure(self, name: str, port: int, c: int) -> LoadResult:
        logf = self.body.parent / f"{self.body.stem}-{name.replace(' ', '_')}-c{c}.log"
        count = self.counts.get(name)
        before = count() if count is not None else None
        warm_n = max(10 * c, 100, int(self.rate.get((name, c), 0) * 0.3))
        warm = run(self.exe, port, self.body, c, warm_n, logf)
        n = max(20 * c, int(self.rate.get((name, c), warm.result.rps) * self.seconds))
        got = run(self.exe, port, self.body, c, n, logf, timeout=max(60.0, 20 * self.seconds))
        self.rate[(name, c)] = got.result.rps
        self.answered[name] = self.answered.get(name, 0) + warm.succeeded + got.succeeded
        problems = []
        for what, r in (("warm-up", warm), ("run", got)):
            if r.succeeded != r.requests or r.failed or r.result.completed != r.requests:
                problems.append(
                    f"{what}: h2load asked {r.requests}, {r.succeeded} succeeded, "
                    f"{r.failed} failed, {r.result.completed} answered 200 in its log"
                )
        if before is not None:
            after = count()
            success, fail = after[0] - before[0], after[1] - before[1]
            expected = warm.succeeded + got.succeeded
            if success != expected or fail:
                problems.append(
                    f"success count +{success}, fail +{fail}; h2load completed {expected}"
                )
        tally = self.checks.setdefault(name, [0, 0])
        tally[0] += 1
        if problems:
            tally[1] += 1
            self.refused.add((c, name))
            self.notes.append(f"{self.label}: {name} c={c} REFUSED: " + "; ".join(problems))
            log(self.notes[-1])
        return got.result

    def checked(self, what: str) -> dict[str, str]:
        """Per server measured: how its requests were checked (``what``: the counts)."""
        return {
            name: f"{what}: {runs - bad} of {runs} runs"
            if name in self.counts
            else "no statistics read; answer checked once with tritonclient"
            for name, (runs, bad) in self.checks.items()
        }
