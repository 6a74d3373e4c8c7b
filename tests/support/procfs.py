"""This process's TCP sockets, read from /proc (Linux)."""

from __future__ import annotations

import os


def tcp_sockets() -> list[tuple[int, bool]]:
    """(local port, listening) of every TCP socket this process holds: /proc/net/tcp*
    joined with our own descriptors."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            ours.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in ours:  # the socket's inode
                    port = int(fields[1].rsplit(":", 1)[1], 16)
                    found.append((port, fields[3] == "0A"))  # 0A: LISTEN
    return found


def listening_ports() -> set[int]:
    """TCP ports this process listens on."""
    return {port for port, listening in tcp_sockets() if listening}


def accepted_connections(port: int) -> int:
    """Descriptors of this process that are accepted connections on ``port``."""
    return sum(1 for local, listening in tcp_sockets() if local == port and not listening)
