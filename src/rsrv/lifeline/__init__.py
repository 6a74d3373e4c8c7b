"""A server process's life: signals and graceful stop (``serve_process``), and its link
to the ``rsrv node`` supervisor that started it: status reports up, and a graceful stop
when the supervisor dies (``_lifeline``); the configuration it hands down
(``_handed_down``)."""

from rsrv.lifeline._handed_down import (
    CONFIG_FD_VARIABLE,
    CONFIG_PATH_VARIABLE,
    ConfigCopy,
    HandedDownConfig,
    handed_down_config,
)
from rsrv.lifeline._lifeline import (
    LINK_FD_VARIABLE,
    LINK_GRACE_VARIABLE,
    ChildStatus,
    SupervisorLink,
    read_status,
    supervised,
)
from rsrv.lifeline._process import (
    Server,
    first_error,
    hold_stop_signals,
    release_stop_signals,
    serve_process,
    stop_signals,
)

__all__ = [
    "CONFIG_FD_VARIABLE",
    "CONFIG_PATH_VARIABLE",
    "LINK_FD_VARIABLE",
    "LINK_GRACE_VARIABLE",
    "ChildStatus",
    "ConfigCopy",
    "HandedDownConfig",
    "Server",
    "SupervisorLink",
    "first_error",
    "handed_down_config",
    "hold_stop_signals",
    "release_stop_signals",
    "read_status",
    "serve_process",
    "stop_signals",
    "supervised",
]
