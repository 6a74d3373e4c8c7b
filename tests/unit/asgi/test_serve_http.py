"""``rsrv.asgi.serve_http`` and clients that read their answers slowly or not at all: a
reader that keeps reading is never cut off, one that reads nothing is after the send
timeout, and a stop never waits on either past hypercorn's graceful second."""

from __future__ import annotations

import errno
import socket
import time

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import trio

from rsrv.asgi import PlainApp, Response, serve_http

SIZE = 6 << 20


async def _route(path: str) -> Response:
    return Response(200, bytes(SIZE))


APP = PlainApp(_route)


def read_slowly(port: int, pause: float) -> int:
    """GET the answer through a small receive buffer, pausing between reads; the bytes
    received until the server closes the connection."""
    got = 0
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        try:
            while chunk := s.recv(128 << 10):
                got += len(chunk)
                time.sleep(pause)
        except ConnectionResetError:
            pass
    return got


async def serving(nursery: trio.Nursery, stop: trio.Event, send_timeout: float, **options) -> int:
    binds = await nursery.start(
        lambda task_status: serve_http(
            APP,
            "127.0.0.1",
            0,
            "test",
            send_timeout=send_timeout,
            shutdown_trigger=stop.wait,
            task_status=task_status,
            **options,
        )
    )
    return int(binds[0].rsplit(":", 1)[1])


def h2_without_window(port: int) -> socket.socket:
    """A connection asking for an answer over HTTP/2 (prior knowledge) with a stream
    window of 0: it lets none of the answer through."""
    s = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    headers = [(":method", "GET"), (":path", "/x"), (":scheme", "http"), (":authority", "x")]
    conn.send_headers(1, headers, end_stream=True)
    s.sendall(conn.data_to_send())
    return s


def read_h2_slowly(port: int, pause: float) -> int:
    """GET the answer over HTTP/2, giving back each frame's window only after
    ``pause``; the bytes received until the answer ends or the server closes."""
    got = 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        headers = [(":method", "GET"), (":path", "/x"), (":scheme", "http"), (":authority", "x")]
        conn.send_headers(1, headers, end_stream=True)
        s.sendall(conn.data_to_send())
        while data := s.recv(1 << 16):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    got += len(event.data)
                    time.sleep(pause)
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded):
                    return got
            s.sendall(conn.data_to_send())
    return got


async def test_an_http2_client_reading_slowly_gets_its_whole_answer():
    """A frame every few ms, for longer than the 0.5 s send timeout in all: progress all
    along (a timeout on the whole answer cut such a reader off)."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await serving(nursery, stop, send_timeout=0.5)
        got = await trio.to_thread.run_sync(read_h2_slowly, port, 0.003)
        stop.set()
    assert got == SIZE


def answered(port: int) -> bool:
    """Whether a plain GET gets its answer (not refused at the connection cap)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"HEAD /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        try:
            return s.recv(100).startswith(b"HTTP/1.1 200")
        except ConnectionResetError:
            return False


@pytest.mark.parametrize("leaves", [True, False])
async def test_an_http2_client_that_opens_no_window_is_closed(leaves):
    """hypercorn's HTTP/2 answer waited for window space without a bound: such a client
    held its connection (answering: beyond the cap's reach) while it stayed, and for good
    once it left. With a cap of 1, the port then refused every other client."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await serving(nursery, stop, send_timeout=0.5, max_connections=1)
        with h2_without_window(port) as s:
            await trio.sleep(0.2)
            if not leaves:
                s.settimeout(5)
                with trio.fail_after(5):  # closed after the 0.5 s send timeout
                    while await trio.to_thread.run_sync(s.recv, 1 << 16):
                        pass
        with trio.fail_after(10):
            while not await trio.to_thread.run_sync(answered, port):
                await trio.sleep(0.1)
        stop.set()


@pytest.mark.parametrize(
    ("method", "path"), [(b"GET", b"/\xffhealthz"), (b"G\xe9T", b"/x")], ids=["path", "method"]
)
async def test_an_http2_request_that_is_not_ascii_ends_its_connection_alone(method, path):
    """hypercorn decodes :path and :method as ASCII, and its UnicodeDecodeError took the
    whole server down (a worker's admin or REST port: the process, gRPC port and all)."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await serving(nursery, stop, send_timeout=0.5)
        config = h2.config.H2Configuration(
            client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
        )
        conn = h2.connection.H2Connection(config)
        conn.initiate_connection()
        headers = [(b":method", method), (b":path", path), (b":scheme", b"http")]
        headers.append((b":authority", b"x"))
        conn.send_headers(1, headers, end_stream=True)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(conn.data_to_send())
            s.settimeout(5)
            with trio.fail_after(5):  # closed
                while await trio.to_thread.run_sync(s.recv, 1 << 16):
                    pass
        assert await trio.to_thread.run_sync(answered, port)
        stop.set()


async def test_a_get_asking_for_a_websocket_is_answered_as_plain_http():
    """(PlainApp ignored the websocket scope, and hypercorn answered 500.)"""

    async def route(path: str) -> Response:
        return Response(200, b"ok")

    def get(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\n\r\n"
            )
            answer = b""
            while not answer.endswith(b"\r\n\r\nok") and (chunk := s.recv(1000)):
                answer += chunk
            return answer

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: serve_http(
                PlainApp(route),
                "127.0.0.1",
                0,
                "test",
                send_timeout=1,
                shutdown_trigger=stop.wait,
                task_status=task_status,
            )
        )
        with trio.fail_after(10):
            answer = await trio.to_thread.run_sync(get, int(binds[0].rsplit(":", 1)[1]))
        assert answer.startswith(b"HTTP/1.1 200")
        stop.set()


async def test_a_client_reading_slowly_gets_its_whole_answer():
    """At most 128 KiB every 0.1 s: under 1 MiB per 0.5 s send timeout (a timeout per
    1 MiB piece cut such a reader off), but progress all along."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await serving(nursery, stop, send_timeout=0.5)
        got = await trio.to_thread.run_sync(read_slowly, port, 0.1)
        stop.set()
    assert got > SIZE


async def test_a_client_reading_nothing_is_closed_and_a_stop_is_bounded():
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await serving(nursery, stop, send_timeout=0.5)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(2.0)  # no progress for 0.5 s: closed
            s.settimeout(5)
            received = 0
            try:
                while chunk := s.recv(1 << 20):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            assert received < SIZE
        # a slow reader at the stop: the stop waits a second for it, not its whole answer
        reader = trio.Event()

        async def slow():
            await trio.to_thread.run_sync(read_slowly, port, 0.2)
            reader.set()

        nursery.start_soon(slow)
        await trio.sleep(0.5)
        start = trio.current_time()
        stop.set()
    assert trio.current_time() - start < 3.0


async def test_a_port_that_cannot_be_bound_is_named():
    """A worker binds several ports; "[Errno 98] Address already in use" said not which."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            await serve_http(APP, "127.0.0.1", port, "test", what="REST")
        except OSError as e:
            error = e
        assert error.errno == errno.EADDRINUSE
        assert f"REST port 127.0.0.1:{port}: " in str(error)


async def test_an_error_that_is_not_a_bind_is_not_called_one(tmp_path):
    """A TLS file that is missing is its own error, not "REST port ...: No such file"."""
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(BaseException) as info:
        await serve_http(APP, "127.0.0.1", 0, "test", tls=(missing, missing, None), what="REST")
    error = info.value
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, FileNotFoundError) and "REST port" not in str(error)
