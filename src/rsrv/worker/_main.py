"""The ``rsrv serve`` process: configuration, logging, signals, then the worker.

SIGINT and SIGTERM start a graceful shutdown (:meth:`Worker.shutdown`); the process
exits 0 once every accepted request has been answered.
"""

from __future__ import annotations

import json
import logging
import resource
import signal
import sys
from pathlib import Path

import msgspec
import trio

from rsrv.config import ConfigError, WorkerConfig, effective_config_dict, load_worker
from rsrv.runtime import configure
from rsrv.worker._worker import Worker

log = logging.getLogger("rsrv.worker")


def serve_main(node_file: str | None, worker_name: str | None) -> int:
    """Entry point of ``rsrv serve``: configure, then run the worker under trio."""
    try:
        config = load_worker(node_file, worker_name)
        if node_file is None:
            config = _default_repo(config)
    except ConfigError as e:
        print(f"rsrv: {e}", file=sys.stderr)
        return 2
    _configure_logging(config)
    log.info("effective configuration: %s", json.dumps(effective_config_dict(config)))
    rt = config.runtime
    configure(
        rt.backend,
        mem_fraction=rt.mem_fraction,
        preallocate=rt.preallocate,
        allow_cpu_fallback=rt.allow_cpu_fallback,
    )
    _raise_descriptor_limit()
    try:
        worker = Worker(config)
    except ConfigError as e:
        print(f"rsrv: {e}", file=sys.stderr)
        return 2
    trio.run(_serve_until_signal, worker)
    return 0


def _raise_descriptor_limit() -> None:
    """Raise the soft limit on open descriptors to the hard one: every connection
    holds one (see endpoints.max_connections), and 1024 is a common soft default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return
        log.info("open descriptor limit raised from %d to %d", soft, hard)


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


async def _serve_until_signal(worker: Worker) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            async for signum in signals:
                log.info("received %s: shutting down gracefully", signal.Signals(signum).name)
                await worker.shutdown()
                nursery.cancel_scope.cancel()
                return


def _configure_logging(config: WorkerConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.logging.format == "json":
        handler.setFormatter(_JsonFormatter(config.name))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s [{config.name}] %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.logging.level.upper())


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, worker, logger, message[, exception]."""

    def __init__(self, worker: str):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "worker": self.worker,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)
