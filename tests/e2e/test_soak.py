"""Memory under sustained load: the ``rsrv serve`` process must not grow per request.

Eight closed-loop tritonclient clients drive classifier (1 and 8 rows), severity_grader
and the region_pipeline meta model on the example bundles. After a warm-up, the server's
resident memory is sampled; growth per 1,000 requests must stay under a small bound
(before the fix every answered request stayed in memory: about 4 KB per 1-row
classifier request, 14 KB at 8 rows, 30 KB per region_pipeline request).

``test_rss_flat_short`` runs in ``just test`` (10,000 requests after a warm-up of 2,000,
however long they take: about 20 s on a 2-core machine); the ``slow`` one runs ten minutes
(``just test -m slow tests/e2e/test_soak.py``) and prints the figures.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from support.clients import connect, infer_input
from support.serving import examples_server
from support.waiting import wait_until

#: Allowed resident-memory growth per 1,000 requests after warm-up.
BOUND_PER_1000 = 256 * 1024


def _inputs(kind: int, rng: np.random.Generator):
    if kind == 0:
        return "classifier", [infer_input("x", rng.standard_normal((1, 256)).astype(np.float32))]
    if kind == 1:
        return "classifier", [infer_input("x", rng.standard_normal((8, 256)).astype(np.float32))]
    if kind == 2:
        images = rng.integers(0, 255, (2, 32, 32, 3), dtype=np.uint8)
        return "severity_grader", [infer_input("image", images)]
    image = rng.standard_normal((64, 64)).astype(np.float32)
    return "region_pipeline", [infer_input("image", image)]


class Load:
    """Closed-loop clients, each with its own connection, until stopped."""

    def __init__(self, server, clients: int = 8):
        self.server = server
        self.done = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with connect(self.server) as client:
            i = seed
            while not self._stop.is_set():
                model, inputs = _inputs(i % 4, rng)
                i += 1
                try:
                    client.infer(model, inputs)
                except Exception as e:  # every counted request must have succeeded
                    with self._lock:
                        self.errors.append(f"{model}: {e}")
                    continue
                with self._lock:
                    self.done += 1

    def wait_for(self, count: int, timeout: float = 300) -> None:
        """Until ``count`` requests have succeeded (and none failed)."""

        def reached() -> bool:
            assert not self.errors, self.errors[:3]
            return self.done >= count

        wait_until(reached, timeout, f"{count} requests (done: {self.done})", interval=0.05)


def measure(tmp_path, cache_dir, warmup: int, *, requests: int = 0, seconds: float = 0.0) -> dict:
    """Resident memory of ``rsrv serve`` under load, sampled after ``warmup`` requests:
    over ``requests`` more requests (ten samples), or for ``seconds``."""
    server = examples_server(tmp_path, cache_dir)
    try:
        with connect(server) as probe:
            server.wait_ready(probe)
        with Load(server) as load:
            load.wait_for(warmup)
            samples = [(load.done, server.rss())]
            if requests:
                for k in range(1, 11):
                    load.wait_for(samples[0][0] + requests * k // 10)
                    samples.append((load.done, server.rss()))
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(min(5.0, seconds / 10))
                samples.append((load.done, server.rss()))
            assert not load.errors, load.errors[:3]
        assert server.process.poll() is None
    finally:
        server.kill()
    (n0, r0), (n1, r1) = samples[0], samples[-1]
    # least-squares slope of RSS over requests: robust to one-off allocator jumps
    counts = np.array([s[0] for s in samples], float)
    rss = np.array([s[1] for s in samples], float)
    slope = float(np.polyfit(counts, rss, 1)[0]) if len(samples) > 2 else (r1 - r0) / (n1 - n0)
    return {
        "requests": n1 - n0,
        "rss_start": r0,
        "rss_end": r1,
        "growth_ratio": r1 / r0,
        "per_1000": slope * 1000,
    }


def test_rss_flat_short(tmp_path, cache_dir):
    result = measure(tmp_path, cache_dir, warmup=2000, requests=10_000)
    assert result["requests"] >= 10_000, result
    assert result["per_1000"] < BOUND_PER_1000, result


@pytest.mark.slow
def test_rss_flat_ten_minutes(tmp_path, cache_dir):
    result = measure(tmp_path, cache_dir, warmup=20_000, seconds=600)
    print(
        f"\nsoak: {result['requests']} requests in 600 s after 20,000 warm-up; RSS "
        f"{result['rss_start'] / 2**20:.1f} -> {result['rss_end'] / 2**20:.1f} MiB "
        f"({(result['growth_ratio'] - 1) * 100:+.2f}%), slope "
        f"{result['per_1000'] / 1024:.1f} KiB per 1,000 requests"
    )
    assert result["growth_ratio"] < 1.05, result
    assert result["per_1000"] < BOUND_PER_1000, result
