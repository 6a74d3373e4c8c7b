"""A deliberately ill-behaved HTTP/2 gRPC client for hardening tests.

Blocking, one socket, frame by frame: it can stop half-way through a message, reset a
stream, say nothing at all, or drop the connection with a TCP reset, which polite
clients (grpcio, purerpc) never do.
"""

from __future__ import annotations

import socket
import struct
import time
import urllib.parse

import h2.config
import h2.connection
import h2.events

INFER = "/inference.GRPCInferenceService/ModelInfer"


def message(payload: bytes, *, compressed: bool = False, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message (``length`` overrides the declared size)."""
    return struct.pack(">?I", compressed, len(payload) if length is None else length) + payload


class RawH2:
    def __init__(self, port: int, host: str = "127.0.0.1", *, preface: bool = True):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.events: list = []
        self.closed = False
        if preface:
            self.conn.initiate_connection()
            self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def start(self, path: str = INFER, *, headers: list | None = None) -> int:
        """Open a call; returns its stream id."""
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "localhost"),
                ("te", "trailers"),
                ("content-type", "application/grpc"),
                *(headers or []),
            ],
        )
        self.flush()
        return sid

    def send(self, sid: int, data: bytes, *, end: bool = False) -> None:
        """Send ``data`` on ``sid`` in frames the peer accepts (window permitting)."""
        view = memoryview(data)
        while view:
            size = min(len(view), self.conn.max_outbound_frame_size)
            while self.conn.local_flow_control_window(sid) < size:
                self.read(0.5)
            self.conn.send_data(sid, view[:size])
            view = view[size:]
        if end:
            self.conn.end_stream(sid)
        self.flush()

    def call(self, payload: bytes, path: str = INFER, **kw) -> int:
        sid = self.start(path, **kw)
        self.send(sid, message(payload), end=True)
        return sid

    def reset(self, sid: int) -> None:
        self.conn.reset_stream(sid, 8)  # CANCEL, as grpcio sends it
        self.flush()

    def read(self, timeout: float) -> bool:
        """Read for up to ``timeout`` s; False once the server has closed the connection."""
        if self.closed:
            return False
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return True
        except ConnectionResetError:
            data = b""
        if not data:
            self.closed = True
            return False
        self.events.extend(self.conn.receive_data(data))
        self.flush()
        return True

    def status(self, sid: int, timeout: float = 10.0) -> tuple[int, str] | None:
        """(grpc-status, grpc-message) of call ``sid`` once it ends; None if it does not
        end within ``timeout`` s or the connection closes first."""
        deadline = time.monotonic() + timeout
        while True:
            found = self._trailers(sid)
            if found is not None:
                return found
            if time.monotonic() > deadline or not self.read(0.1):
                return self._trailers(sid)

    def _trailers(self, sid: int) -> tuple[int, str] | None:
        for event in self.events:
            headers = getattr(event, "headers", None)
            if getattr(event, "stream_id", None) == sid and headers:
                found = dict(headers)
                if "grpc-status" in found:
                    message = urllib.parse.unquote(found.get("grpc-message", ""))
                    return int(found["grpc-status"]), message
        return None

    def goaway(self, timeout: float) -> bool:
        """True if the server sent GOAWAY (and closed) within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.read(0.1):
            pass
        return any(isinstance(e, h2.events.ConnectionTerminated) for e in self.events)

    def wait_closed(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.read(0.1):
                return True
        return False

    def abort(self) -> None:
        """Drop the connection with a TCP reset, like a killed process's kernel would."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        self.closed = True

    def close(self) -> None:
        self.sock.close()
        self.closed = True
