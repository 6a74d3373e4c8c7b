"""``rsrv gateway``: one gRPC endpoint in front of many workers (specs/gateway.md)."""

from rsrv.gateway._ctl import COMMANDS, CTL_OPTIONS, add_ctl_arguments, ctl_main
from rsrv.gateway._gateway import Gateway
from rsrv.gateway._main import gateway_main

__all__ = ["COMMANDS", "CTL_OPTIONS", "Gateway", "add_ctl_arguments", "ctl_main", "gateway_main"]
