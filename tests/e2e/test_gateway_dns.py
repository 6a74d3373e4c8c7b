"""The gateway's worker list from DNS: workers join and leave as the name's addresses
change, without a restart.

Two real workers listen on the same port of two loopback addresses (127.0.0.1 and
127.0.0.2), as pods behind a Kubernetes headless Service do; the gateway runs in this
test's trio loop, whose host-name resolver (trio's own hook,
``trio.socket.set_custom_hostname_resolver``) answers for ``workers.test``.
"""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest
import trio
from support.bundles import X, export_linear, matches
from support.serving import running

from rsrv.config import load_gateway, load_node, resolve_worker
from rsrv.gateway import Gateway
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.transport import open_channel

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is loopback")


class Resolver(trio.abc.HostnameResolver):
    """``workers.test`` and ``other.test`` resolve as ``self.names`` says (a list of
    addresses, IPv6 ones with a colon; "fail"; "hang"); every other name as usual."""

    def __init__(self, names: dict[str, list[str] | str]):
        self.names = names

    async def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        if name in self.names:
            answer = self.names[name]
            if answer == "fail":
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            if answer == "hang":
                await trio.sleep_forever()
            return [
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, int(port), 0, 0))
                if ":" in a
                else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port)))
                for a in answer
            ]
        return await trio.to_thread.run_sync(
            socket.getaddrinfo, host, port, family, type, proto, flags
        )

    async def getnameinfo(self, sockaddr, flags):
        return await trio.to_thread.run_sync(socket.getnameinfo, sockaddr, flags)


def worker_on(tmp_path, host: str, port: int, cache_dir):
    node = tmp_path / f"{host}.toml"
    node.write_text(
        f'model_repo = "{tmp_path / "repo"}"\nbase_port = {port}\n'
        f'[global]\ncache_dir = "{cache_dir}"\nmodel_control_mode = "static"\n'
        f'[global.endpoints]\nhost = "{host}"\n'
    )
    return resolve_worker(load_node(node), None, {}, source=node)


def free_port_on_both() -> int:
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.2", port))
                except OSError:
                    continue
                return port


async def infer(channel):
    request = pb.ModelInferRequest(model_name="lin")
    request.inputs.add(name="x", datatype="FP32", shape=list(X.shape))
    request.raw_input_contents.append(X.astype("<f4").tobytes())
    return await channel.unary(
        "/inference.GRPCInferenceService/ModelInfer", request.SerializeToString(), timeout=30
    )


def test_workers_join_and_leave_with_dns(tmp_path, cache_dir, caplog):
    export_linear(tmp_path / "repo" / "lin", seed=4)
    port = free_port_on_both()
    caplog.set_level("WARNING", logger="rsrv.gateway")
    with (
        running(worker_on(tmp_path, "127.0.0.1", port, cache_dir)),
        running(worker_on(tmp_path, "127.0.0.2", port, cache_dir)),
    ):
        trio.run(gateway_follows_dns, port, caplog)


async def gateway_follows_dns(port: int, caplog) -> None:
    resolver = Resolver({"workers.test": ["127.0.0.1"], "other.test": []})
    trio.socket.set_custom_hostname_resolver(resolver)
    config = load_gateway(
        None,
        {
            "INFERENCE_GATEWAY_ENDPOINTS_DNS": f"workers.test:{port},other.test:{port}",
            "INFERENCE_GATEWAY_LISTEN_GRPC": "127.0.0.1:0",
            "INFERENCE_GATEWAY_LISTEN_METRICS": "none",
            "INFERENCE_GATEWAY_DISCOVERY_INTERVAL_SECONDS": "0.1",
        },
    )
    gateway = Gateway(config)

    async def wait_for(names: set[str], ready: set[str]) -> None:
        with trio.fail_after(30):
            while (
                {w.name for w in gateway.fleet.workers},
                {w.name for w in gateway.fleet.ready},
            ) != (names, ready):
                await trio.sleep(0.05)

    one, two = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
    async with trio.open_nursery() as nursery:
        gateway_port = await nursery.start(gateway.run)
        async with open_channel("127.0.0.1", gateway_port) as channel:
            await wait_for({one}, {one})
            resolver.names["other.test"] = ["127.0.0.2"]
            await wait_for({one, two}, {one, two})
            # A name that fails keeps its own workers, not the other name's.
            resolver.names.update({"workers.test": "fail", "other.test": []})
            await wait_for({one}, {one})
            rounds = gateway.discovery.rounds
            with trio.fail_after(30):
                while gateway.discovery.rounds < rounds + 3:
                    await trio.sleep(0.05)
            # warned about once, not every round (8 names, every 2 s: 14,000 an hour)
            failed = [r for r in caplog.records if "cannot resolve workers.test" in r.message]
            assert len(failed) == 1
            # A name that does not answer holds no round up; a dual-stack name is taken
            # by its IPv4 addresses (each pod has one in each family), whichever comes first.
            resolver.names.update({"workers.test": "hang", "other.test": ["::1", "127.0.0.2"]})
            await wait_for({one, two}, {one, two})
            rounds = gateway.discovery.rounds
            await wait_for({one, two}, {one, two})
            with trio.fail_after(30):
                while gateway.discovery.rounds < rounds + 3:
                    await trio.sleep(0.05)
            resolver.names.update({"workers.test": ["127.0.0.1", "127.0.0.2"], "other.test": []})
            await wait_for({one, two}, {one, two})
            for _ in range(4):
                result = await infer(channel)
                assert result.status.name == "OK", result.message
            routed = gateway.forwarder.counters.routed
            assert routed.get((one, "OK")) and routed.get((two, "OK"))

            resolver.names["workers.test"] = ["127.0.0.2"]
            await wait_for({two}, {two})
            # What was kept of the worker that left is dropped (its metric series too).
            routed = gateway.forwarder.counters.routed
            assert not [key for key in routed if key[0] == one]
            assert gateway.scheduler.ledger.routed("lin", one) == 0
            assert gateway.fleet.routes["lin"] == (two,)
            result = await infer(channel)
            response = pb.ModelInferResponse.FromString(result.response)
            y = np.frombuffer(response.raw_output_contents[0], "<f4")
            assert matches(y.reshape(len(X), 2), 4, X)
        await gateway.shutdown()
