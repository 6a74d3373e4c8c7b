"""``rsrv node``: the supervisor of one machine (see specs/node.md)."""

from rsrv.node._status import status_main
from rsrv.node._supervisor import Supervisor, node_main

__all__ = ["Supervisor", "node_main", "status_main"]
