"""How many connections one server holds at once, and which one gives way at the cap
(the gRPC server's, ``_server``, and the HTTP ports', ``rsrv.asgi``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["ConnectionCap"]

C = TypeVar("C")


class ConnectionCap(Generic[C]):
    """The connections a server holds (``open``, oldest first) and those accepted but
    not yet among them (``starting``: a TLS handshake), at most ``limit`` in all.

    At the cap, a connection just accepted takes the place of the one that has waited
    longest on its client: ``quiet_since`` gives the moment a connection started
    waiting on its client (idle; or every call waiting for its request, the rest of
    one, its end, a stream's next message, or the client's reading or flow-control
    window), or None while the server owes it an answer (see the gRPC server's
    ``ServerCall._reowe``). When every connection is owed one, the new connection is
    refused. Refusing the newest instead would let
    one client holding the cap with silent connections (or calls that never send
    their request) lock every other client out, probes included. Each connection
    closed or refused at the cap is counted (``closed``) and logged now and then (the
    1st, 10th, 100th, then every 1,000th) to ``log``, naming ``setting``.
    """

    def __init__(
        self,
        limit: int,
        quiet_since: Callable[[C], float | None],
        log: logging.Logger,
        setting: str,
    ):
        self.limit = limit
        self.open: dict[C, None] = {}  # (oldest first: ties go to the oldest)
        self.starting = 0
        self.closed = 0
        self._quiet_since = quiet_since
        self._log = log
        self._setting = setting

    def make_room(self) -> tuple[bool, C | None]:
        """For a connection just accepted, before it is counted: whether it may stay,
        and the connection it replaces (no longer counted: the caller closes it)."""
        if len(self.open) + self.starting < self.limit:
            return True, None
        oldest, since = None, math.inf
        for conn in self.open:
            quiet = self._quiet_since(conn)
            if quiet is not None and quiet < since:
                oldest, since = conn, quiet
        self.closed += 1
        if self.closed in (1, 10, 100) or self.closed % 1000 == 0:
            self._log.warning(
                "%s: %d open, the limit (%s); %d so far",
                "closed the connection waiting longest on its client"
                if oldest is not None
                else "refused a connection",
                len(self.open) + self.starting,
                self._setting,
                self.closed,
            )
        if oldest is None:
            return False, None
        del self.open[oldest]
        return True, oldest
