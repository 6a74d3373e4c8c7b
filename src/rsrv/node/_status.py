"""``rsrv node status``: what a running node reports about itself, as a table."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from rsrv.config import ConfigError, join_address, load_node, plan_node
from rsrv.node._specs import dialled

__all__ = ["status_main"]


def status_main(node_file: str | None, timeout: float = 5.0) -> int:
    """Print the node's children from its ``/healthz``. Exit status: 0 when the node
    is ready, 1 when it runs but is not ready, 2 when it cannot be reached."""
    try:
        node = load_node(node_file)
        source = None if node_file is None else Path(node_file)
        host = dialled(plan_node(node, source=source, detect=False).host)
    except ConfigError as e:
        print(f"rsrv: {e}", file=sys.stderr)
        return 2
    url = f"http://{join_address(host, node.metrics_port)}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            report = json.load(answer)
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        print(f"rsrv: no node answers at {url}: {reason}", file=sys.stderr)
        return 2
    state = "stopping" if report["stopping"] else "ready" if report["ready"] else "not ready"
    front = f"public port {report['port']}" if report["port"] else "no gateway"
    print(f"node pid {report['pid']}: {state}, {front}, up {report['uptime_seconds']:.0f} s")
    rows = [("NAME", "KIND", "STATE", "READY", "PID", "PORT", "DEVICE", "RESTARTS", "LAST EXIT")]
    for c in report["children"]:
        rows.append(
            (
                c["name"],
                c["kind"],
                c["state"],
                "yes" if c["ready"] else "no",
                str(c["pid"] or "-"),
                str(c["port"]),
                c["device"] or "-",
                str(c["restarts"]),
                c["last_exit"] or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return 0 if report["ready"] else 1
