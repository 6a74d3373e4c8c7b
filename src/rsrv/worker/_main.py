"""The ``rsrv serve`` process: configuration, logging, the device, signals, then the worker.

Exit status: 0 after a graceful shutdown; 1 when the gRPC or admin port cannot be
bound; 2 when the configuration is invalid or the backend has no usable device (a fault
a restart cannot mend, which ``rsrv node`` reads as such).

SIGINT and SIGTERM start a graceful shutdown (:meth:`Worker.shutdown`); the process
exits 0 once every accepted request has been answered.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import msgspec

from rsrv.config import ConfigError, WorkerConfig, effective_config_dict, load_worker
from rsrv.lifeline import ChildStatus, handed_down_config, serve_process, supervised
from rsrv.logsetup import configure_logging
from rsrv.runtime import DeviceUnavailable, configure, open_device
from rsrv.worker._worker import Worker

log = logging.getLogger("rsrv.worker")


def serve_main(node_file: str | None, worker_name: str | None) -> int:
    """Entry point of ``rsrv serve``: configure, then run the worker under trio."""
    try:
        config = load_worker(node_file, worker_name, data=handed_down_config(node_file))
    except (ConfigError, ValueError) as e:
        print(f"rsrv: {e}", file=sys.stderr)
        return 2
    configure_logging(
        config.name, config.logging.level, config.logging.format, tag=not supervised()
    )
    if node_file is None:
        config = _default_repo(config)  # (it says so in the log)
    log.info("effective configuration: %s", json.dumps(effective_config_dict(config)))
    rt = config.runtime
    configure(
        rt.backend,
        mem_fraction=rt.mem_fraction,
        preallocate=rt.preallocate,
        allow_cpu_fallback=rt.allow_cpu_fallback,
        visible_device=config.gpu,
    )
    try:
        device = open_device()
    except DeviceUnavailable as e:
        print(f"rsrv: worker {config.name}: {e}", file=sys.stderr)
        return 2
    if device.fallback:
        log.warning(
            "backend 'cuda' found no usable GPU: running on the CPU "
            "(runtime.allow_cpu_fallback); %s",
            device.describe(),
        )
    else:
        log.info("device: %s", device.describe())
    try:
        worker = Worker(config, device=device)
    except ConfigError as e:
        print(f"rsrv: {e}", file=sys.stderr)
        return 2
    # What a supervising `rsrv node` is told.
    return serve_process(
        f"worker {config.name}",
        worker,
        lambda: ChildStatus(ready=worker.ready, port=worker.port),
    )


def _default_repo(config: WorkerConfig) -> WorkerConfig:
    """The embedded default serves ./bundles. When there is no such directory, no
    INFERENCE_SERVER_MODEL_REPO, and rsrv runs from a source checkout (an editable
    install), it serves that checkout's example bundles instead, and says so."""
    checkout = Path(__file__).resolve().parents[3] / "bundles"
    if (
        not Path(config.model_repo).is_dir()
        and checkout.is_dir()
        and "INFERENCE_SERVER_MODEL_REPO" not in " ".join(config.overrides)
    ):
        log.info(
            "no %s directory: serving the example bundles of the rsrv checkout, %s "
            "(a node file or INFERENCE_SERVER_MODEL_REPO chooses the repository)",
            config.model_repo,
            checkout,
        )
        return msgspec.structs.replace(config, model_repo=str(checkout))
    return config
