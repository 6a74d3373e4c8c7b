"""Helpers shared by the tests (no tests here; pytest finds this package through
``pythonpath = ["tests"]``, so every test module imports ``support.<module>``).

* :mod:`support.serving`: a worker in this process (:func:`~support.serving.running`) or
  a real ``rsrv serve`` process (:class:`~support.serving.ServerProcess`), and handles on
  a running worker (its loop, its scheduler, its device);
* :mod:`support.clients`: the tritonclient client factory, inputs, status assertions,
  the control client from synchronous code, a raw purerpc channel;
* :mod:`support.bundles`: the test bundles (exported once per session and copied),
  model repositories, weights files;
* :mod:`support.references`: numpy references of the example bundles in bundles/;
* :mod:`support.metrics`: the admin HTTP endpoint and a parsed /metrics scrape;
* :mod:`support.health`: grpcio's own gRPC health client (Check, and Watch in a thread);
* :mod:`support.k8s_schemas`: JSON Schemas of the KServe and Prometheus Operator custom
  resources, on Kubernetes' definitions (for the manifests under deploy/);
* :mod:`support.procfs`: this process's TCP sockets, from /proc;
* :mod:`support.rawh2`: an ill-behaved HTTP/2 gRPC client, frame by frame;
* :mod:`support.echo`: rsrv's own ``GrpcServer`` with raw-bytes test methods in the
  test's trio loop (for the transport's client), and ``wait_for``, its trio polling loop;
* :mod:`support.channel_bench`: the paired benchmark of rsrv's channel against
  purerpc's client (a script, not a fixture);
* :mod:`support.scheduler`: a fake executor and submit helpers for the scheduler tests;
* :mod:`support.gateway`: fake worker links (channels answering from this process) and a
  client call's envelope, for the gateway's unit tests;
* :mod:`support.waiting`: :func:`~support.waiting.wait_until`, the one polling loop;
* :mod:`support.assertions`: ``pytest.raises`` that also checks the message;
* :mod:`support.allocator`: GPU-shaped allocator statistics, replayed in order, for the
  weight budget and the scratch measurement.
"""

from __future__ import annotations

from pathlib import Path

#: The repository's root (the directory holding src/, tests/, bundles/).
ROOT = Path(__file__).resolve().parents[2]
#: The committed example model repository.
BUNDLES = ROOT / "bundles"
