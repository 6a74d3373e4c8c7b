"""The ``rsrv gateway`` process: configuration, logging, then the gateway until a signal.

Exit status: 0 after a graceful stop; 1 when its port cannot be bound; 2 when the
gateway file or its environment overrides are invalid.
"""

from __future__ import annotations

import json
import logging
import sys

from rsrv.config import ConfigError, gateway_config_dict, load_gateway
from rsrv.gateway._gateway import Gateway
from rsrv.lifeline import ChildStatus, handed_down_config, serve_process, supervised
from rsrv.logsetup import configure_logging

__all__ = ["gateway_main"]

log = logging.getLogger("rsrv.gateway")


def gateway_main(gateway_file: str | None) -> int:
    """Entry point of ``rsrv gateway [GATEWAY_FILE]``."""
    try:
        config = load_gateway(gateway_file, data=handed_down_config(gateway_file))
    except (ConfigError, ValueError) as e:
        print(f"rsrv: {e}", file=sys.stderr)
        return 2
    configure_logging("gateway", config.logging.level, config.logging.format, tag=not supervised())
    log.info("effective configuration: %s", json.dumps(gateway_config_dict(config)))
    try:
        gateway = Gateway(config)
    except ConfigError as e:  # (a TLS file that cannot be used)
        print(f"rsrv: {e}", file=sys.stderr)
        return 2
    return serve_process(
        "gateway", gateway, lambda: ChildStatus(ready=gateway.ready, port=gateway.port)
    )
