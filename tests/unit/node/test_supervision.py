"""The supervisor's parts on their own: output tagging, the restart policy and stopping
with real short-lived child processes, a child's state following its readiness, and the
supervisor link between two ends of a socket."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import trio
from support.pki import write_pki

from rsrv.config import ConfigError, SupervisorConfig, load_gateway, load_node, plan_node
from rsrv.lifeline import (
    CONFIG_FD_VARIABLE,
    CONFIG_PATH_VARIABLE,
    LINK_FD_VARIABLE,
    LINK_GRACE_VARIABLE,
    ChildStatus,
    ConfigCopy,
    SupervisorLink,
    handed_down_config,
    read_status,
)
from rsrv.lifeline._process import _serve_until_signal, serve_process
from rsrv.node._admin import public_port
from rsrv.node._children import Child, ChildSpec, ChildState, restart_delay
from rsrv.node._output import (
    MAX_LINE_BYTES,
    OutputSink,
    forward_lines,
    standard_output,
    tag_line,
)
from rsrv.node._specs import check_tls, gateway_spec, gateway_warnings, worker_spec
from rsrv.node._status import status_main
from rsrv.node._supervisor import SAME_STOP_SECONDS, Supervisor, check_node_ports


def test_lines_are_tagged_and_json_stays_json():
    assert tag_line("worker1", b"hello") == b"[worker1] hello\n"
    tagged = json.loads(tag_line("worker1", b'{"message": "hi", "level": "INFO"}'))
    assert tagged == {"message": "hi", "level": "INFO", "worker": "worker1"}
    # A JSON line that names its worker keeps it; a line that only looks like JSON is text.
    assert json.loads(tag_line("w", b'{"worker": "gpu3"}'))["worker"] == "gpu3"
    assert tag_line("w", b"{not json") == b"[w] {not json\n"
    assert tag_line("w", b"[1, 2]") == b"[w] [1, 2]\n"


async def test_output_is_forwarded_in_whole_lines(tmp_path):
    send, receive = trio.testing.memory_stream_one_way_pair()
    out = tmp_path / "out"
    with open(out, "wb") as sink:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward_lines, "w", receive, OutputSink(sink.fileno(), "out"))
            for piece in (b"one\ntw", b"o\n", b"x" * (MAX_LINE_BYTES + 10), b"\nlast"):
                await send.send_all(piece)
                await trio.testing.wait_all_tasks_blocked()
            await send.aclose()
    lines = out.read_bytes().split(b"\n")
    assert lines[:2] == [b"[w] one", b"[w] two"]
    assert lines[2] == b"[w] " + b"x" * MAX_LINE_BYTES  # an overlong line comes in pieces
    assert lines[3:] == [b"[w] " + b"x" * 10, b"[w] last", b""]


async def test_output_to_a_closed_pipe_is_read_and_dropped():
    """``rsrv node ... | head``: once the reader is gone, children's lines are still
    read (so no child blocks on a full pipe) and dropped; the node goes on."""
    send, receive = trio.testing.memory_stream_one_way_pair()
    read_end, write_end = os.pipe()
    os.close(read_end)
    sink = OutputSink(write_end, "out")
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(forward_lines, "w", receive, sink)
                for _ in range(3):
                    await send.send_all(b"line\n" * 1000)
                    await trio.testing.wait_all_tasks_blocked()
                await send.aclose()  # forward_lines reads to the end and returns
    finally:
        os.close(write_end)
    assert not sink.open  # (the closed pipe was seen: later lines are dropped)


async def test_a_reader_that_stops_reading_holds_the_supervisor_up_nowhere(caplog):
    """A paused terminal or a stalled log shipper: the supervisor's task goes on (a
    ticker keeps ticking), children's lines are still read, what does not fit the queue
    is dropped and counted, and once the reader reads again it gets the queued lines,
    a warning, then new lines."""
    read_end, write_end = os.pipe()
    sink = OutputSink(write_end, "out", limit=256 * 1024)
    send, receive = trio.testing.memory_stream_one_way_pair()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    def read_all() -> bytes:
        with os.fdopen(read_end, "rb") as reader:
            return reader.read()

    out: list[bytes] = []

    async def reader():
        out.append(await trio.to_thread.run_sync(read_all))

    async with trio.open_nursery() as outer:
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(sink.run)
                nursery.start_soon(ticker)
                nursery.start_soon(forward_lines, "w", receive, sink)
                line = b"%06d " + b"x" * 1000 + b"\n"
                for n in range(2000):  # ~2 MB: the pipe holds 64 KiB, the queue 256 KiB
                    await send.send_all(line % n)
                with trio.fail_after(10):
                    while ticks < 20:  # nothing is read meanwhile
                        await trio.sleep(0.01)
                assert sink.dropped > 1000
                with caplog.at_level("WARNING", logger="rsrv.node"):
                    outer.start_soon(reader)
                    with trio.fail_after(10):
                        await sink.flushed()
                    await send.send_all(b"after\n")
                    await send.aclose()
                    await trio.testing.wait_all_tasks_blocked()
                    with trio.fail_after(10):
                        await sink.flushed()
                nursery.cancel_scope.cancel()
        finally:
            os.close(write_end)  # the reader reads to the end
    lines = out[0].splitlines()
    numbers = [int(x.split()[1]) for x in lines[:-1]]
    assert numbers[0] == 0 and numbers == sorted(set(numbers))  # whole lines, in order
    assert all(len(x) == 1011 for x in lines[:-1])
    assert lines[-1] == b"[w] after"
    assert len(numbers) + sink.dropped == 2000
    reported = re.findall(r"(\d+) lines of output to out were dropped", caplog.text)
    assert sum(map(int, reported)) == sink.dropped  # each gap said, once caught up


async def test_stdout_and_stderr_on_one_pipe_never_interleave_their_lines():
    """``rsrv node 2>&1 | tee``: two sinks on one pipe, written from two threads in
    batches larger than a pipe keeps whole, to a slow reader: 11 of 4,000 lines came
    out broken before the sinks shared a lock."""
    read_end, write_end = os.pipe()
    out, err = standard_output(write_end, write_end)
    assert out.lock is err.lock
    lines = (b"[worker0] " + b"o" * 200 + b"\n", b"[worker1] " + b"e" * 200 + b"\n")
    got = bytearray()

    def read() -> None:
        time.sleep(0.3)  # the pipe fills: the writes go partial
        while chunk := os.read(read_end, 1 << 16):
            got.extend(chunk)
            time.sleep(0.001)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    async with trio.open_nursery() as nursery:
        await nursery.start(out.run)
        await nursery.start(err.run)
        for i in range(2000):
            out.write(lines[0])
            err.write(lines[1])
            if i % 50 == 0:
                await trio.sleep(0)
        await out.flushed()
        await err.flushed()
        nursery.cancel_scope.cancel()
    os.close(write_end)
    reader.join(30)
    os.close(read_end)
    assert sorted(set(bytes(got).splitlines(keepends=True))) == sorted(lines)
    assert bytes(got).count(b"\n") == 4000


def test_restart_delays_double_up_to_the_limit():
    policy = SupervisorConfig(backoff_seconds=0.5, max_backoff_seconds=3)
    assert [restart_delay(n, policy) for n in range(1, 6)] == [0.5, 1, 2, 3, 3]
    # "restart for ever" as a large max_restarts: 2.0 ** 1024 overflowed at restart 1025
    assert restart_delay(1025, policy) == restart_delay(10**9, policy) == 3


def child(
    script: str, policy: SupervisorConfig, failures: list[str], grace=5.0, config=None
) -> Child:
    spec = ChildSpec(
        name="c",
        kind="worker",
        argv=[sys.executable, "-c", script],
        env=dict(os.environ),
        grace=grace,
        port=0,
        config=config,
    )
    return Child(spec, policy, failures.append, standard_output())


async def test_a_crashing_child_is_restarted_until_the_limit(tmp_path):
    policy = SupervisorConfig(max_restarts=2, backoff_seconds=0.01, stable_seconds=60)
    count = tmp_path / "count"
    script = f"open({str(count)!r}, 'a').write('x'); raise SystemExit(3)"
    failures: list[str] = []
    c = child(script, policy, failures)
    with trio.fail_after(60):
        await c.run()
    assert count.read_text() == "xxx"  # the first start and two restarts
    assert c.state is ChildState.FAILED and c.last_exit == "code 3"
    assert c.restarts_total == 2
    assert len(failures) == 1 and "exited 3 time(s) in a row" in failures[0]


async def test_every_process_of_a_child_reads_the_configuration_handed_down(tmp_path):
    """A restart reads the node file as the node read it at start, not as it is now."""
    policy = SupervisorConfig(max_restarts=2, backoff_seconds=0.01, stable_seconds=60)
    seen = tmp_path / "seen"
    script = (
        "import os; from rsrv.lifeline import handed_down_config; "
        f"data = handed_down_config({str(tmp_path / 'node.toml')!r}); "
        "assert not any(k.startswith('RSRV_SUPERVISOR_CONFIG') for k in os.environ); "
        f"open({str(seen)!r}, 'ab').write(data + b'|'); raise SystemExit(3)"
    )
    data = "port = 8001\n# 名前\n".encode() * 5000  # (larger than a pipe's buffer)
    c = child(script, policy, [], config=ConfigCopy(str(tmp_path / "node.toml"), data))
    descriptors = len(os.listdir("/proc/self/fd"))
    with trio.fail_after(60):
        await c.run()
    assert seen.read_bytes() == (data + b"|") * 3  # the first start and two restarts
    assert len(os.listdir("/proc/self/fd")) == descriptors  # (each copy closed here)


def test_a_configuration_handed_down_is_for_its_file_and_read_once(tmp_path):
    """Another file named (a child started by hand with the variables inherited) is read
    from disk; the variables go once read (what the child starts reads its own files); a
    descriptor that cannot be read is one clear error."""
    path = str(tmp_path / "node.toml")
    assert handed_down_config(path, {}) is None
    env = {CONFIG_FD_VARIABLE: "9999", CONFIG_PATH_VARIABLE: path}
    assert handed_down_config(str(tmp_path / "other.toml"), env) is None and env == {}
    for text in ("9999", "x"):
        env = {CONFIG_FD_VARIABLE: text, CONFIG_PATH_VARIABLE: path}
        with pytest.raises(ValueError, match=f"RSRV_SUPERVISOR_CONFIG_FD={text!r}: cannot read"):
            handed_down_config(path, env)


async def test_a_child_that_never_serves_is_stopped_and_restarted_until_the_limit(tmp_path):
    """supervisor.startup_timeout_seconds: a start-up that hangs (here: a process that
    never reports on its supervisor link) is stopped like a crash, and is never counted
    as stable however long the timeout."""
    policy = SupervisorConfig(
        max_restarts=1, backoff_seconds=0.01, stable_seconds=0.1, startup_timeout_seconds=0.5
    )
    count = tmp_path / "count"
    script = f"import time; open({str(count)!r}, 'a').write('x'); time.sleep(60)"
    failures: list[str] = []
    c = child(script, policy, failures, grace=5.0)
    with trio.fail_after(30):
        await c.run()
    assert count.read_text() == "xx"  # the first start and one restart
    assert c.state is ChildState.FAILED and c.timed_out and not c.killed
    assert c.last_exit == "signal SIGTERM"  # stopped gracefully
    assert "the last one not serving 0.5 s after starting" in failures[0]


async def test_a_child_stopped_for_its_start_up_timeout_is_stopping_meanwhile():
    """Between its SIGTERM and its end (here: SIGKILL, as it ignores SIGTERM) it is
    ``stopping``, not ``starting``, for whoever watches /healthz."""
    policy = SupervisorConfig(max_restarts=0, startup_timeout_seconds=0.2)
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    c = child(script, policy, [], grace=1.0)
    states = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        with trio.fail_after(30):
            while c.state is not ChildState.FAILED:
                states.append(c.state)
                await trio.sleep(0.02)
    assert ChildState.STOPPING in states and states.index(ChildState.STOPPING) > 0
    assert set(states[states.index(ChildState.STOPPING) :]) == {ChildState.STOPPING}


async def test_a_child_that_cannot_be_started_is_retried_like_a_crash():
    """A failed start (here: no such executable; EMFILE alike) is not the supervisor's
    end: it is counted and retried with backoff, then given up on, naming the error."""
    policy = SupervisorConfig(max_restarts=1, backoff_seconds=0.01)
    failures: list[str] = []
    c = child("", policy, failures)
    c.spec = dataclasses.replace(c.spec, argv=["/nonexistent/python"])
    c.timed_out = c.served = True  # as an earlier process may have left them
    with trio.fail_after(30):
        await c.run()
    assert c.state is ChildState.FAILED and c.restarts_total == 1
    assert c.last_exit.startswith("not started: [Errno 2] No such file or directory")
    assert "exited 2 time(s) in a row" in failures[0] and "last: not started" in failures[0]


async def test_a_fatal_exit_is_not_restarted(tmp_path):
    failures: list[str] = []
    c = child("raise SystemExit(2)", SupervisorConfig(backoff_seconds=0.01), failures)
    with trio.fail_after(60):
        await c.run()
    assert c.restarts_total == 0 and c.state is ChildState.FAILED
    assert "configuration or device is unusable" in failures[0]


#: A child's script that reports ready on its supervisor link.
REPORT_READY = (
    f"import os, socket; socket.socket(fileno=int(os.environ[{LINK_FD_VARIABLE!r}]))"
    '.sendall(b\'{"ready": true, "port": 1}\\n\'); '
)


async def test_a_stable_child_has_its_count_reset(tmp_path):
    # Each run serves and lives longer than stable_seconds: however often it exits, it
    # never reaches the limit of one restart in a row.
    policy = SupervisorConfig(max_restarts=1, backoff_seconds=0.01, stable_seconds=0.2)
    count = tmp_path / "count"
    script = REPORT_READY + f"import time; open({str(count)!r}, 'a').write('x'); time.sleep(0.3)"
    failures: list[str] = []
    c = child(script, policy, failures)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        with trio.fail_after(60):
            while len(count.read_text() if count.exists() else "") < 4:
                await trio.sleep(0.05)
        await c.stop()
    assert not failures and c.state is ChildState.STOPPED


async def test_a_child_that_never_serves_is_not_stable_however_long_it_runs(tmp_path):
    policy = SupervisorConfig(max_restarts=1, backoff_seconds=0.01, stable_seconds=0.1)
    failures: list[str] = []
    c = child("import time; time.sleep(0.3)", policy, failures)
    with trio.fail_after(30):
        await c.run()
    assert c.state is ChildState.FAILED and "before serving" in failures[0]


async def test_a_child_serving_in_time_is_left_alone_and_a_gateway_is_not_timed(tmp_path):
    """The start-up timeout stops a worker that is not serving, not one that is, nor a
    gateway (which serves only once a worker does)."""
    policy = SupervisorConfig(startup_timeout_seconds=2.0)
    serving = child(REPORT_READY + "import time; time.sleep(60)", policy, [])
    gateway = child("import time; time.sleep(60)", policy, [])
    gateway.spec = dataclasses.replace(gateway.spec, kind="gateway")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serving.run)
        nursery.start_soon(gateway.run)
        with trio.fail_after(30):
            while serving.state is not ChildState.SERVING:
                await trio.sleep(0.01)
        await trio.sleep(2.5)  # past the timeout
        assert serving.state is ChildState.SERVING and not serving.timed_out
        assert gateway.state is ChildState.STARTING and not gateway.timed_out
        nursery.start_soon(serving.stop)
        nursery.start_soon(gateway.stop)
    assert serving.restarts_total == gateway.restarts_total == 0


async def test_a_child_kept_down_is_not_restarted_and_kill_is_at_once(tmp_path):
    """While the node stops (the gateway drains first), a worker that exits stays down;
    a second stop signal kills a child at once, past its grace period."""
    count = tmp_path / "count"
    script = f"import time; open({str(count)!r}, 'a').write('x'); time.sleep(0.2)"
    c = child(script, SupervisorConfig(backoff_seconds=0.01), [])
    c.keep_down()
    with trio.fail_after(30):
        await c.run()
    assert count.read_text() == "x" and c.state is ChildState.STOPPED
    waiting = child(script, SupervisorConfig(backoff_seconds=60), [])  # a long backoff
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiting.run)
        with trio.fail_after(30):
            while waiting.state is not ChildState.BACKOFF:
                await trio.sleep(0.01)
            waiting.keep_down()  # the node stops while it waits to be restarted
    assert count.read_text() == "xx" and waiting.state is ChildState.STOPPED
    up = tmp_path / "up"
    ignoring = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(up)!r}, 'w').close(); time.sleep(60)"
    )
    c = child(ignoring, SupervisorConfig(), [], grace=60)
    with trio.fail_after(30):  # well within the 60 s grace: the kill is at once
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.run)
            while not up.exists():
                await trio.sleep(0.01)
            nursery.start_soon(c.stop)
            await trio.sleep(0.2)
            c.kill()
    assert c.killed and c.last_exit == "signal SIGKILL"


async def test_a_child_kept_down_that_is_killed_from_elsewhere_did_not_drain():
    """A worker killed (the OOM killer, say) while the node's gateway drains, before the
    worker's own stop: the node said every child drained, and exited 0."""
    c = child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", SupervisorConfig(), [])
    c.keep_down()
    with trio.fail_after(30):
        await c.run()
    assert c.broke_off == "signal SIGKILL" and c.state is ChildState.STOPPED


async def test_a_child_stopped_while_waiting_to_be_restarted_did_not_drain():
    """The node's stop finds it down after a crash (its in-flight requests lost): not a
    child that drained and exited by itself (the node said so, and exited 0)."""
    policy = SupervisorConfig(backoff_seconds=30.0)
    c = child("import sys; sys.exit(3)", policy, [])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        with trio.fail_after(30):
            while c.state is not ChildState.BACKOFF:
                await trio.sleep(0.01)
            await c.stop()
    assert c.broke_off == "code 3, then waiting to be restarted"
    assert c.state is ChildState.STOPPED


async def test_stop_escalates_to_sigkill_after_the_grace_period():
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    c = child(script, SupervisorConfig(), [], grace=0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        with trio.fail_after(30):
            while c.pid is None:
                await trio.sleep(0.01)
            await trio.sleep(0.5)  # the child has installed its handler
            await c.stop()
    assert c.killed and c.last_exit == "signal SIGKILL" and c.state is ChildState.STOPPED


async def test_stop_during_a_start_waits_for_that_process():
    """stop() called while the process is being started (Popen runs in a thread) stops
    that process too, and returns only once it is gone; ended by the node's SIGTERM (it
    had no handler yet), it stopped as asked (not broken off)."""
    c = child("import time; time.sleep(60)", SupervisorConfig(), [])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await trio.testing.wait_all_tasks_blocked()  # run() is inside open_process
        assert c.pid is None
        with trio.fail_after(30):
            await c.stop()
        assert c.pid is not None and not c.alive and c.last_exit == "signal SIGTERM"
    assert c.state is ChildState.STOPPED and not c.killed and c.broke_off is None


BLINKING_CHILD = """
import trio
from rsrv.lifeline import ChildStatus, SupervisorLink

ready = True


async def main():
    global ready
    link = SupervisorLink(lambda: ChildStatus(ready=ready, port=1), interval=0.01)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        await trio.sleep({serving})
        ready = False
        await trio.sleep(60)


trio.run(main)
"""


async def test_the_state_follows_readiness():
    """starting -> serving when the child reports ready -> not ready when it stops being
    ready -> stopping -> stopped."""
    c = child(BLINKING_CHILD.format(serving=1.0), SupervisorConfig(), [])
    seen = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        with trio.fail_after(30):
            while c.state is not ChildState.NOT_READY:
                if not seen or seen[-1] is not c.state:
                    seen.append(c.state)
                await trio.sleep(0.005)
            assert not c.ready
            await c.stop()
    assert seen == [ChildState.STARTING, ChildState.SERVING]
    assert c.state is ChildState.STOPPED


@pytest.mark.parametrize(
    ("grace", "alarm"), [("2.5", [3]), (None, [60]), ("inf", []), ("nan", []), ("3e9", [])]
)
async def test_the_link_reports_status_and_notices_the_supervisor_go(monkeypatch, grace, alarm):
    """Gone, the supervisor leaves the child SIGTERM and an alarm for the grace it
    would have given it (whole seconds, rounded up; 60 s when it did not say; none for
    a grace without end)."""
    supervisor_end, child_end = socket.socketpair()
    monkeypatch.setenv(LINK_FD_VARIABLE, str(child_end.fileno()))
    if grace is None:
        monkeypatch.delenv(LINK_GRACE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(LINK_GRACE_VARIABLE, grace)
    alarms: list[int] = []
    monkeypatch.setattr(signal, "alarm", alarms.append)  # (not this test process's)
    ready = False
    link = SupervisorLink(lambda: ChildStatus(ready=ready, port=8101), interval=0.01)
    terminated = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM) as signals:

        async def on_sigterm():
            async for _ in signals:
                terminated.set()
                return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_sigterm)
            nursery.start_soon(link.run)
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(supervisor_end))
            statuses = read_status(stream)
            assert await statuses.__anext__() == ChildStatus(False, 8101)
            ready = True
            assert await statuses.__anext__() == ChildStatus(True, 8101)
            await stream.aclose()  # the supervisor is gone
            with trio.fail_after(10):
                await terminated.wait()
    assert alarms == alarm


def test_outside_a_supervisor_the_link_does_nothing(monkeypatch):
    monkeypatch.delenv(LINK_FD_VARIABLE, raising=False)
    trio.run(SupervisorLink(lambda: pytest.fail("polled")).run)


@pytest.mark.parametrize(
    ("yaml", "front"),
    [
        ("cpu_workers: 1\n", "worker"),
        ("cpu_workers: 2\n", "gateway"),
        ("cpu_workers: 2\ngateway:\n  enabled: false\n", None),
    ],
)
def test_the_public_port_is_the_front_door(tmp_path, yaml, front):
    """/healthz's ``port``: the gateway's, a one-worker node's worker's, or none."""
    path = tmp_path / "node.yaml"
    path.write_text(yaml)
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    expected = {
        "worker": node_plan.workers[0].endpoints.port,
        "gateway": node_plan.port,
        None: None,
    }[front]
    assert public_port(node_plan) == expected


def test_a_lone_device_reaches_the_worker_as_a_device_not_a_count(tmp_path):
    """A one-GPU node on ordinal 3: the worker plans the node again from what the
    supervisor passes, and must find the same single worker, port and device."""
    path = tmp_path / "node.yaml"
    path.write_text("global: {runtime: {backend: cuda}}\ngpus: [3]\n")
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    spec = worker_spec(node_plan, node_plan.workers[0], str(path), {})
    again = plan_node(load_node(path), {"PATH": "", **spec.env}, source=path)
    assert [(w.name, w.gpu, w.endpoints.port) for w in again.workers] == [
        (w.name, w.gpu, w.endpoints.port) for w in node_plan.workers
    ]
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "3"


class Starting:
    """A server whose start-up never ends (a model load that hangs)."""

    def __init__(self):
        self.cancelled = self.shut_down = False

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled = True
            raise

    async def shutdown(self):
        self.shut_down = True


def test_a_host_that_does_not_resolve_is_one_line_and_exit_1(monkeypatch, capsys):
    """As a port that cannot be bound (it used to end in a traceback)."""

    class Unresolvable(Starting):
        async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.delenv(LINK_FD_VARIABLE, raising=False)
    assert serve_process("worker w", Unresolvable(), lambda: ChildStatus(False, 1)) == 1
    error = capsys.readouterr().err
    assert (
        error
        == f"rsrv: worker w: cannot listen: [Errno {socket.EAI_NONAME}] Name or service not known\n"
    )


@pytest.mark.parametrize("fd", ["1", "1023"])  # (a pipe or terminal; no descriptor)
async def test_a_link_variable_that_names_no_socket_is_ignored(monkeypatch, fd, caplog):
    """(An inherited variable crashed the process: EBADF, ENOTSOCK.)"""
    monkeypatch.setenv(LINK_FD_VARIABLE, fd)
    with trio.fail_after(5):
        await SupervisorLink(lambda: ChildStatus(True, 1)).run()
    assert f"RSRV_SUPERVISOR_FD={fd} is no supervisor link" in caplog.text


STOP_SCRIPT = """
import logging, os, signal, sys, trio
from rsrv.lifeline import ChildStatus, hold_stop_signals, serve_process
logging.basicConfig(level=logging.INFO)

class Server:
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        print("run", flush=True)
        task_status.started()
        await trio.sleep_forever()

    async def shutdown(self):
        print("shutdown", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # (again, during the stop)

hold_stop_signals()  # (what the entry point does, before its slow start)
for _ in range(int(sys.argv[1])):
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
code = serve_process("x", Server(), lambda: ChildStatus(True, 1))
os.kill(os.getpid(), signal.SIGTERM)  # (again, as the process ends)
print("exit", code, flush=True)
sys.exit(code)
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_before_the_server_runs_stops_it_gracefully(signame):
    """Before serve_process watched them, a stop signal ended the process (SIGTERM: by
    the signal; SIGINT: a KeyboardInterrupt traceback); SIGHUP did at any time; and the
    same signal again, during the stop or as the process ended, ended it by that signal
    after a graceful stop. Now: the server starts, stops gracefully, exit 0."""
    result = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT, "1", signame], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["0", "exit", "run", "shutdown"]
    assert f"received {signame} (while starting)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_sighup_ignored_at_start_stays_ignored():
    """(`nohup rsrv serve` stopped on SIGHUP: the hold replaced the ignore.) SIGTERM is
    heeded even when ignored at start: it is how a process is stopped."""
    ignored = (
        "import signal\n"
        "for s in (signal.SIGHUP, signal.SIGTERM):\n"
        "    signal.signal(s, signal.SIG_IGN)\n"
    )
    script = ignored + STOP_SCRIPT
    script = script.replace(
        "for _ in range(int(sys.argv[1])):",
        "os.kill(os.getpid(), signal.SIGHUP)  # (ignored)\nfor _ in range(int(sys.argv[1])):",
    )
    result = subprocess.run(
        [sys.executable, "-c", script, "1", "SIGTERM"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert "received SIGTERM" in result.stderr and "SIGHUP" not in result.stderr


def test_a_second_stop_signal_before_the_server_runs_ends_the_process():
    """(A start-up that hangs, a device that never opens, can still be ended.)"""
    result = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT, "2", "SIGTERM"], capture_output=True, text=True
    )
    assert result.returncode == -signal.SIGTERM and result.stdout == ""


async def test_a_child_is_not_ready_while_it_starts_and_its_supervisor_going_stops_it(
    monkeypatch,
):
    """The link runs from the start (reporting not ready, whatever the server says, until
    it serves); the supervisor's going sends SIGTERM, which is watched from the start
    too: the server is shut down gracefully and its start-up, which would never end,
    cancelled."""
    supervisor_end, child_end = socket.socketpair()
    monkeypatch.setenv(LINK_FD_VARIABLE, str(child_end.fileno()))
    server = Starting()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_until_signal, server, lambda: ChildStatus(True, 8101))
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(supervisor_end))
            assert await read_status(stream).__anext__() == ChildStatus(False, 8101)
            await stream.aclose()  # the supervisor is gone
    assert server.shut_down and server.cancelled  # gracefully: it may have accepted calls


@pytest.mark.parametrize(
    ("worker_grace", "gateway_file", "drain"),
    [
        (45, "", 45.0),  # the gateway drains as long as its workers may
        (2, "", 30.0),  # its own (default) longer grace stands
        (45, "[grpc]\nshutdown_grace_seconds = 50\n", 50.0),
    ],
)
def test_the_gateway_drains_as_long_as_its_workers_and_is_given_that_long(
    tmp_path, worker_grace, gateway_file, drain
):
    gateway = tmp_path / "gateway.toml"
    gateway.write_text(gateway_file)
    path = tmp_path / "node.yaml"
    path.write_text(
        f"cpu_workers: 2\ngateway: {{file: {gateway}}}\n"
        f"global: {{endpoints: {{shutdown_grace_seconds: {worker_grace}}}}}\n"
    )
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    spec, config = gateway_spec(node_plan, {})
    assert spec.config == (str(gateway), gateway.read_bytes())  # to every process of it
    assert (
        load_gateway(node_plan.gateway_file, spec.env, spec.config.data) == config
    )  # (the child's)
    assert config.grpc.shutdown_grace_seconds == drain
    assert spec.grace == drain + node_plan.supervisor.kill_after_seconds


@pytest.mark.parametrize(
    ("gateway_file", "env", "expected"),
    [
        ("", {}, (2**30, "debug", "json")),  # as its workers
        (
            '[grpc]\nmax_message_bytes = 2097152\n[logging]\nlevel = "info"\nformat = "text"\n',
            {},
            (2097152, "info", "text"),  # its file says otherwise
        ),
        ("", {"INFERENCE_GATEWAY_LOGGING_LEVEL": "warning"}, (2**30, "warning", "json")),
    ],
)
def test_the_gateway_inherits_its_workers_limits_and_logging_unless_told_otherwise(
    tmp_path, gateway_file, env, expected
):
    gateway = tmp_path / "gateway.toml"
    gateway.write_text(gateway_file)
    path = tmp_path / "node.yaml"
    path.write_text(
        f"cpu_workers: 2\ngateway: {{file: {gateway}}}\n"
        "global: {endpoints: {max_message_bytes: 1073741824}, "
        "logging: {level: debug, format: json}}\n"
    )
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    spec, config = gateway_spec(node_plan, env)
    assert (
        load_gateway(node_plan.gateway_file, spec.env, spec.config.data) == config
    )  # (the child's)
    got = (config.grpc.max_message_bytes, config.logging.level, config.logging.format)
    assert got == expected


def test_a_node_serving_tls_serves_it_on_its_gateways_port_and_needs_a_ca_to_dial(tmp_path):
    """TLS set for the node's workers left the node's own port, the gateway's, in the
    clear; and a gateway without the CA never reached a worker (every probe failing in
    its handshake): the node now refuses to start, saying what to set."""
    pki = write_pki(tmp_path)
    tls = (
        f"global: {{endpoints: {{tls_cert_file: {pki['cert']}, tls_key_file: {pki['key']}, "
        f"tls_client_ca_file: {pki['ca']}}}}}\n"
    )
    gateway = tmp_path / "gateway.toml"
    path = tmp_path / "node.yaml"
    path.write_text(f"cpu_workers: 2\ngateway: {{file: {gateway}}}\n{tls}")
    for worker_client, needs in (
        ("", "serves TLS, which its gateway cannot call: set worker_client.tls_ca_file"),
        (
            f'tls_ca_file = "{pki["ca"]}"',
            "asks for client certificates, which its gateway cannot call",
        ),
    ):
        gateway.write_text(f"[worker_client]\n{worker_client}\n")
        node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
        spec, config = gateway_spec(node_plan, {})
        grpc = config.grpc
        assert (grpc.tls_cert_file, grpc.tls_key_file, grpc.tls_client_ca_file) == (
            str(pki["cert"]),
            str(pki["key"]),
            str(pki["ca"]),
        )
        with pytest.raises(ConfigError, match=f"worker 'worker0' {needs}"):
            check_tls(node_plan, config)
    client = f'"{pki["client_cert"]}"', f'"{pki["client_key"]}"'
    gateway.write_text(
        f'[worker_client]\ntls_ca_file = "{pki["ca"]}"\n'
        f"tls_cert_file = {client[0]}\ntls_key_file = {client[1]}\n"
    )
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    check_tls(node_plan, gateway_spec(node_plan, {})[1])
    # TLS settings of its own, from the environment or its file: none inherited
    own = {
        "INFERENCE_GATEWAY_GRPC_TLS_CERT_FILE": str(pki["cert"]),
        "INFERENCE_GATEWAY_GRPC_TLS_KEY_FILE": str(pki["key"]),
    }
    config = gateway_spec(node_plan, own)[1]
    assert config.grpc.tls_client_ca_file is None  # (and the node says so, once it logs)
    assert "the workers ask clients for certificates" in gateway_warnings(node_plan, config)[0]
    gateway.write_text(gateway.read_text() + f'[grpc]\ntls_key_file = "{pki["key"]}"\n')
    with pytest.raises(ConfigError, match="grpc.tls_cert_file and tls_key_file go together"):
        gateway_spec(node_plan, {})
    # workers serving TLS differently: which would the gateway serve?
    path.write_text(
        f"gateway: {{file: {gateway}}}\n{tls}"
        "workers: [{name: a}, {name: b, endpoints: {tls_client_ca_file: null}}]\n"
    )
    gateway.write_text(f'[worker_client]\ntls_ca_file = "{pki["ca"]}"\n')
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    with pytest.raises(ConfigError, match="the workers serve TLS differently"):
        gateway_spec(node_plan, {})


RESTRICTED = (
    "global:\n  endpoints:\n    restricted:\n"
    "      - {protocols: [model-repository, control], header: admin-key, value: 'k1,te=Q'}\n"
)


@pytest.mark.parametrize(
    ("yaml", "gateway_file", "env", "headers"),
    [
        (RESTRICTED, "", {}, {"admin-key": "k1,te=Q"}),  # its calls carry the workers' keys
        (RESTRICTED, '[worker_client.headers]\nadmin-key = "mine"\n', {}, {"admin-key": "mine"}),
        (
            RESTRICTED,
            "",
            {"INFERENCE_GATEWAY_WORKER_CLIENT_HEADERS": "admin-key=env"},
            {"admin-key": "env"},
        ),
        (  # control under two keys: gateway-control can take neither (the file gives it)
            RESTRICTED + "workers:\n  - {name: a}\n  - {name: b, endpoints: {restricted: "
            "[{protocols: [control], header: admin-key, value: k2}]}}\n",
            "",
            {},
            "the workers restrict control under different keys",
        ),
        (  # the gateway would never see both workers ready: no one header value would do
            RESTRICTED + "workers:\n  - {name: a}\n  - {name: b, endpoints: {restricted: "
            "[{protocols: [model-repository], header: admin-key, value: k2}]}}\n",
            "",
            {},
            "the protocols their gateway sees them by .* under header 'admin-key'",
        ),
        (  # keys of its other calls differing (shared memory, control): left out, warned
            "global:\n  endpoints:\n    restricted:\n"
            "      - {protocols: [shared-memory], header: x-key, value: shm}\n"
            "      - {protocols: [control], header: x-key, value: admin}\n",
            '[[grpc.restricted]]\nprotocols = ["gateway-control"]\nheader = "gk"\nvalue = "g"\n',
            {},
            {},
        ),
        (  # control under two keys: which would the gateway's own control service take?
            "workers:\n  - {name: a, endpoints: {restricted: [{protocols: [control], header: "
            "x-a, value: ka}]}}\n  - {name: b, endpoints: {restricted: [{protocols: [control],"
            " header: x-b, value: kb}]}}\n",
            "",
            {},
            "the workers restrict control under different keys",
        ),
        (  # a key only clients hold (inference's) beside the gateway's, on one header
            RESTRICTED.replace(
                "admin-key, value: 'k1,te=Q'}",
                "admin-key, value: 'k1,te=Q'}\n"
                "      - {protocols: [inference], header: admin-key, value: user}",
            ),
            "",
            {},
            {"admin-key": "k1,te=Q"},
        ),
    ],
)
def test_the_gateway_of_a_node_calls_its_workers_with_their_keys(
    tmp_path, yaml, gateway_file, env, headers
):
    """A node restricting model-repository: the gateway's RepositoryIndex probes were
    refused, no worker ever looked ready, and nothing said why."""
    gateway = tmp_path / "gateway.toml"
    gateway.write_text(gateway_file)
    path = tmp_path / "node.yaml"
    path.write_text(f"cpu_workers: 2\ngateway: {{file: {gateway}}}\n{yaml}")
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    if isinstance(headers, str):
        with pytest.raises(ConfigError, match=headers):
            gateway_spec(node_plan, env)
        return
    spec, config = gateway_spec(node_plan, env)
    assert load_gateway(node_plan.gateway_file, {**spec.env, **env}, spec.config.data) == config
    assert config.worker_client.headers == headers
    # restricting as they do (it answers ServerLive and ServerReady itself), its own
    # control service under their control key (open, a client's repack sent the workers a
    # CompactMemory under it)
    blocks = [(b.protocols, b.header, b.value) for b in config.grpc.restricted]
    if headers:
        expected = (["control", "model-repository", "gateway-control"], "admin-key", "k1,te=Q")
        assert expected in blocks
    else:  # (its calls the workers will refuse, said once the node logs)
        warnings = gateway_warnings(node_plan, config)
        assert "worker worker0 will refuse its gateway's own shared-memory calls" in warnings[0]


def test_the_node_is_ready_only_with_a_worker_ready_behind_its_gateway(tmp_path):
    """The gateway routes to a worker that is still loading its models (it serves what
    it has), so the gateway's readiness alone does not make the node ready."""
    path = tmp_path / "node.yaml"
    path.write_text("cpu_workers: 2\n")
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    specs = [worker_spec(node_plan, w, str(path), {}) for w in node_plan.workers]
    supervisor = Supervisor(node_plan, [*specs, gateway_spec(node_plan, {})[0]])
    *workers, gateway = supervisor.children
    gateway.ready = True
    assert not supervisor.ready  # both workers still starting
    workers[1].ready = True
    assert supervisor.ready


@pytest.mark.parametrize(
    ("yaml", "env", "listen", "dial"),
    [
        ("global: {endpoints: {host: '::'}}\n", {}, "[::]", "[::1]"),
        ("", {"INFERENCE_SERVER_ENDPOINTS_HOST": "0.0.0.0"}, "0.0.0.0", "127.0.0.1"),
    ],
)
def test_the_gateway_listens_on_the_nodes_host_and_dials_its_workers(
    tmp_path, yaml, env, listen, dial
):
    gateway = tmp_path / "gateway.toml"
    gateway.write_text('endpoints_dns = ["elsewhere:8001"]\n')  # replaced by the node
    path = tmp_path / "node.yaml"
    path.write_text(f"cpu_workers: 2\ngateway: {{file: {gateway}}}\n{yaml}")
    node_plan = plan_node(load_node(path), {"PATH": "", **env}, source=path)
    spec, config = gateway_spec(node_plan, env)
    assert (
        load_gateway(node_plan.gateway_file, spec.env, spec.config.data) == config
    )  # (the child's)
    assert config.listen.grpc == f"{listen}:{node_plan.port}"
    assert config.endpoints == [f"{dial}:{w.endpoints.port}" for w in node_plan.workers]
    assert config.endpoints_dns == []


@pytest.mark.parametrize(
    ("yaml", "clash"),
    [
        ("port: 18001\nhttp_base_port: 18001\n", "the REST port of worker 'worker0'"),
        ("metrics_port: 18101\nbase_port: 18101\n", "the gRPC port of worker 'worker0'"),
    ],
)
def test_node_ports_must_not_be_a_workers(tmp_path, yaml, clash):
    path = tmp_path / "node.yaml"
    path.write_text("cpu_workers: 2\n" + yaml)
    with pytest.raises(ConfigError, match=f"^{path}: .*{clash}"):
        check_node_ports(plan_node(load_node(path), {"PATH": ""}, source=path), str(path))


def test_node_status_names_the_node_file_in_its_errors(tmp_path, monkeypatch, capsys):
    """(It named <node config>, then the embedded default, for the file it was given.)"""
    path = tmp_path / "node.yaml"
    path.write_text("port: 18001\n")
    monkeypatch.setenv("INFERENCE_SERVER_ENDPOINTS_METRICS_PORT", "18001")
    assert status_main(str(path)) == 2
    assert capsys.readouterr().err.startswith(f"rsrv: {path}: ")


async def test_only_a_second_signal_forces_the_stop_even_after_a_give_up(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("cpu_workers: 1\n")
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    specs = [worker_spec(node_plan, w, str(path), {}) for w in node_plan.workers]
    supervisor = Supervisor(node_plan, specs)
    supervisor._give_up("a child gave up")  # the node is stopping already
    send, receive = trio.open_memory_channel(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor._watch_signals, receive)
        await send.send(signal.SIGTERM)  # docker stop: the first signal
        await trio.testing.wait_all_tasks_blocked()
        assert not supervisor.forced
        await trio.sleep(SAME_STOP_SECONDS)  # (one at once would be the same stop)
        await send.send(signal.SIGINT)
        await trio.testing.wait_all_tasks_blocked()
        assert supervisor.forced
        await send.aclose()


async def test_the_same_signal_twice_at_once_is_one_stop(tmp_path, autojump_clock):
    """GNU `timeout` signals the node, then its process group: two SIGTERMs a millisecond
    apart; a closing session SIGHUP and SIGTERM. Each pair is one graceful stop (the node
    killed every child and exited 1); a stop signal later still forces it."""
    path = tmp_path / "node.yaml"
    path.write_text("cpu_workers: 1\n")
    node_plan = plan_node(load_node(path), {"PATH": ""}, source=path)
    specs = [worker_spec(node_plan, w, str(path), {}) for w in node_plan.workers]
    supervisor = Supervisor(node_plan, specs)
    send, receive = trio.open_memory_channel(4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor._watch_signals, receive)
        await send.send(signal.SIGTERM)
        await trio.sleep(0.001)
        await send.send(signal.SIGTERM)
        await send.send(signal.SIGHUP)
        await trio.testing.wait_all_tasks_blocked()
        assert supervisor._stop_requested.is_set() and not supervisor.forced
        await trio.sleep(1.0)
        await send.send(signal.SIGTERM)
        await trio.testing.wait_all_tasks_blocked()
        assert supervisor.forced
        await send.aclose()
