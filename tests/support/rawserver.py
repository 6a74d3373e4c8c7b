"""A scripted raw HTTP/2 server on trio, for the client side's tests: each connection is
handed to a handler that reads frames and sends bytes as a (misbehaving) server would."""

from __future__ import annotations

import struct
from contextlib import asynccontextmanager

import hpack
import trio

from rsrv.transport import _frames as F


class Peer:
    """One accepted connection: frames in, bytes out."""

    def __init__(self, stream: trio.SocketStream, index: int):
        self.s = stream
        self.index = index
        self.reader = F.FrameReader(F.MAX_WINDOW)
        self.frames: list = []
        self.enc = hpack.Encoder()
        self.dec = hpack.Decoder()
        self._preface = b""
        self.got_preface = False
        self.lock = trio.Lock()

    async def frame(self):
        while not self.frames:
            data = await self.s.receive_some(1 << 16)
            if not data:
                raise EOFError
            if not self.got_preface:
                self._preface += data
                if len(self._preface) < 24:
                    continue
                data, self._preface = self._preface[24:], b""
                self.got_preface = True
            self.frames.extend(self.reader.feed(data))
        return self.frames.pop(0)

    async def until(self, kind):
        while True:
            f = await self.frame()
            if f[0] == kind:
                return f

    async def send(self, data: bytes) -> None:
        async with self.lock:
            await self.s.send_all(data)

    def headers(self, sid, headers, *, end=False) -> bytes:
        flags = F.END_HEADERS | (F.END_STREAM if end else 0)
        return F.frame(F.HEADERS, flags, sid, self.enc.encode(headers))

    def answer(self, sid, payload: bytes) -> bytes:
        return (
            self.headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
            + F.frame(F.DATA, 0, sid, struct.pack(">?I", False, len(payload)) + payload)
            + self.headers(sid, [("grpc-status", "0")], end=True)
        )


@asynccontextmanager
async def raw_server(handler):
    """handler(peer) for each connection; yields (port, peers)."""
    peers: list[Peer] = []
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]

        async def serve(stream):
            peer = Peer(stream, len(peers))
            peers.append(peer)
            try:
                await handler(peer)
            except* (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async def accept():
            await trio.serve_listeners(serve, listeners)

        nursery.start_soon(accept)
        try:
            yield port, peers
        finally:
            nursery.cancel_scope.cancel()
