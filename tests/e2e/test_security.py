"""Restricted protocols and TLS, end to end through tritonclient and the control client.

With a restricted block, the shared-memory, model-repository and control RPCs are refused
without the header (UNAVAILABLE, Triton's message) and work with it, while inference,
health and metadata stay open. The gRPC endpoint serves TLS and mutual TLS, checked with
tritonclient's ``ssl=True`` options and a CA made for the test (trustme).
"""

from __future__ import annotations

import socket
import ssl
import time

import numpy as np
import pytest
import trio
from purerpc.grpclib.status import StatusCode
from support.assertions import raises
from support.bundles import make_repo
from support.clients import connect, infer_input, raises_status, server_error
from support.pki import write_pki
from support.serving import free_port, node_config, run_rsrv, running

from rsrv.client import ControlClient
from rsrv.config import ConfigError
from rsrv.protocol import restrictions_of

RESTRICTED = "This protocol is restricted, expecting header 'admin-key'"
KEY = {"admin-key": "s3cret"}


@pytest.fixture(scope="module")
def node(cache_dir):
    """``node(repo, endpoints=..., restricted=...)``: the text of a node file serving
    ``repo`` in explicit mode, with these [global.endpoints] lines and restricted blocks."""

    def text(repo, *, endpoints: str = "", restricted: str = "") -> str:
        return f"""
model_repo = "{repo}"

[global]
cache_dir = "{cache_dir}"
model_control_mode = "explicit"

[global.endpoints]
{endpoints}

{restricted}
"""

    return text


ADMIN = """
[[global.endpoints.restricted]]
protocols = ["shared-memory", "model-repository", "control"]
header = "admin-key"
value = "s3cret"
"""


@pytest.fixture(scope="module")
def restricted_worker(tmp_path_factory, node):
    root = tmp_path_factory.mktemp("restricted")
    repo = make_repo(root / "repo", "classifier")
    with running(node_config(root, node(repo, restricted=ADMIN))) as w:
        yield w


def test_restricted_protocols_need_the_header(restricted_worker):
    with connect(restricted_worker) as triton:
        for call in (
            lambda: triton.load_model("classifier"),
            lambda: triton.unload_model("classifier"),
            lambda: triton.get_model_repository_index(),
            lambda: triton.register_system_shared_memory("r", "/nothing", 64),
            lambda: triton.get_system_shared_memory_status(),
            lambda: triton.unregister_system_shared_memory(),
        ):
            with raises_status("UNAVAILABLE", RESTRICTED):
                call()
        with raises_status("UNAVAILABLE", RESTRICTED):
            triton.load_model("classifier", headers={"admin-key": "wrong"})
        # with the header: served
        triton.load_model("classifier", headers=KEY)
        assert triton.get_model_repository_index(headers=KEY).models[0].state == "READY"
        assert triton.get_system_shared_memory_status(headers=KEY).regions == {}
        # open protocols need nothing
        assert triton.is_server_live() and triton.is_model_ready("classifier")
        assert triton.get_model_metadata("classifier").name == "classifier"
        x = np.ones((1, 256), np.float32)
        assert triton.infer("classifier", [infer_input("x", x)]).as_numpy("logits").shape == (
            1,
            10,
        )


async def test_restricted_control_service(restricted_worker):
    async with ControlClient("127.0.0.1", restricted_worker.port) as control:
        with server_error(StatusCode.UNAVAILABLE, "expecting header 'admin-key'"):
            await control.status()
    async with ControlClient("127.0.0.1", restricted_worker.port, headers=KEY) as control:
        assert (await control.status()).control_mode == "explicit"


def test_value_from_environment_or_file(tmp_path, monkeypatch, node):
    (tmp_path / "secret").write_text("from-file\n")
    text = node(
        tmp_path,
        restricted="""
[[global.endpoints.restricted]]
protocols = ["control"]
header = "a"
value_env = "RSRV_TEST_SECRET"

[[global.endpoints.restricted]]
protocols = ["model-repository"]
header = "b"
value_file = "secret"
""",
    )
    config = node_config(tmp_path, text)
    monkeypatch.setenv("RSRV_TEST_SECRET", "from-env")
    a, b = restrictions_of(config.endpoints.restricted, "endpoints.restricted")
    assert (a.protocols, a.header, a.value) == ({"control"}, "a", "from-env")
    assert (b.protocols, b.header, b.value) == ({"model-repository"}, "b", "from-file")
    monkeypatch.delenv("RSRV_TEST_SECRET")
    with raises(ConfigError, "RSRV_TEST_SECRET is not set"):
        restrictions_of(config.endpoints.restricted, "endpoints.restricted")
    # a value no gRPC client could send (it was accepted, and then no key matched)
    monkeypatch.setenv("RSRV_TEST_SECRET", "clé-s3cret")
    with raises(ConfigError, "restricted[0]: the header value must be printable ASCII"):
        restrictions_of(config.endpoints.restricted, "endpoints.restricted")


@pytest.mark.parametrize("header", ["te", "user-agent"])
def test_a_header_grpc_keeps_to_itself_cannot_carry_a_key(tmp_path, node, header):
    """`te` is never a call's metadata: every gRPC call would have been refused; gRPC
    clients set `user-agent` themselves (a node's gateway could not send the key)."""
    text = node(
        tmp_path,
        restricted=f"""
[[global.endpoints.restricted]]
protocols = ["control"]
header = "{header}"
value = "x"
""",
    )
    with raises(ConfigError, f"restricted[0].header: '{header}' is a header gRPC itself sets"):
        restrictions_of(node_config(tmp_path, text).endpoints.restricted, "endpoints.restricted")


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ('protocols = ["control"]\nheader = "k"', "exactly one of value"),
        ('protocols = ["control"]\nheader = "k"\nvalue = "x"\nvalue_env = "E"', "exactly one"),
        ('protocols = []\nheader = "k"\nvalue = "x"', "length >= 1"),
        ('protocols = ["inference", "everything"]\nheader = "k"\nvalue = "x"', "everything"),
        ('protocols = ["control"]\nheader = "Admin Key"\nvalue = "x"', "header"),
        (  # (accepted, guarding nothing)
            'protocols = ["gateway-control"]\nheader = "k"\nvalue = "x"',
            "gateway-control is a gateway's own protocol",
        ),
    ],
)
def test_bad_restricted_blocks(tmp_path, node, block, needle):
    with raises(ConfigError, needle):
        node_config(
            tmp_path, node(tmp_path, restricted=f"[[global.endpoints.restricted]]\n{block}")
        )


def test_a_protocol_restricted_twice(tmp_path, node):
    block = '[[global.endpoints.restricted]]\nprotocols = ["control"]\nheader = "k"\nvalue = "x"\n'
    with raises(ConfigError, "'control' is already restricted by endpoints.restricted[0]"):
        node_config(tmp_path, node(tmp_path, restricted=block + "\n" + block))


def test_effective_configuration_hides_the_value(tmp_path, node):
    from rsrv.config import effective_config_dict

    config = node_config(tmp_path, node(tmp_path, restricted=ADMIN))
    shown = effective_config_dict(config)["endpoints"]["restricted"][0]
    assert shown["value"] == "***" and "s3cret" not in str(effective_config_dict(config))


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_config(tmp_path, pki, node):
    """``tls_config(mutual)``: a worker serving the classifier over TLS (``mutual``: to
    clients with a certificate of the test CA only)."""

    def config(mutual: bool):
        endpoints = f'tls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\n'
        if mutual:
            endpoints += f'tls_client_ca_file = "{pki["ca"]}"\n'
        repo = make_repo(tmp_path / "repo", "classifier")
        return node_config(tmp_path, node(repo, endpoints=endpoints))

    return config


def _client(worker, pki, *, cert: bool = False, ssl_on: bool = True):
    options = {}
    if ssl_on:
        options = {"ssl": True, "root_certificates": str(pki["ca"])}
        if cert:
            options.update(
                private_key=str(pki["client_key"]), certificate_chain=str(pki["client_cert"])
            )
    return connect(worker, **options)


def test_tls(pki, tls_config):
    with running(tls_config(mutual=False)) as w:
        with _client(w, pki) as triton:
            triton.load_model("classifier")
            x = np.ones((2, 256), np.float32)
            assert triton.infer("classifier", [infer_input("x", x)]).as_numpy("logits").shape == (
                2,
                10,
            )
        with _client(w, pki, ssl_on=False) as plain:  # plaintext HTTP/2 is not spoken
            with raises_status("UNAVAILABLE"):
                plain.is_server_live(client_timeout=5)
        assert w.server.connections is not None


def test_a_rest_connection_closed_at_the_cap_in_its_handshake_leaves_the_server_up(
    tmp_path, pki, node
):
    """Three TCP connections that never start their TLS handshake fill the REST port's
    cap; a fourth closes the oldest (from its own task: closed from the new one's, the
    handshake's error took the worker down) and is served over TLS, and so is gRPC. A
    handshake that does not finish within receive_timeout_seconds is closed."""
    endpoints = (
        f'tls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\n'
        f"http_port = {free_port()}\nmax_connections = 3\nreceive_timeout_seconds = 1\n"
    )
    repo = make_repo(tmp_path / "repo", "classifier")
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    with running(node_config(tmp_path, node(repo, endpoints=endpoints))) as w:
        silent = [socket.create_connection(("127.0.0.1", w.http_port)) for _ in range(3)]
        try:
            time.sleep(0.3)  # (each in its handshake)
            with (
                socket.create_connection(("127.0.0.1", w.http_port), timeout=10) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                tls.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                assert tls.recv(100).startswith(b"HTTP/1.1 200 ")
            assert silent[0].recv(100) == b""  # the oldest, closed to make room
            silent[1].settimeout(10)  # (the handshake's limit: receive_timeout_seconds)
            assert silent[1].recv(100) == b""
        finally:
            for sock in silent:
                sock.close()
        with _client(w, pki) as triton:
            assert triton.is_server_live()


def test_mutual_tls(pki, tls_config):
    with running(tls_config(mutual=True)) as w:
        with _client(w, pki, cert=True) as triton:
            assert triton.is_server_live()
        with _client(w, pki, cert=False) as anonymous:
            with raises_status("UNAVAILABLE"):
                anonymous.is_server_live(client_timeout=5)


def test_control_client_over_mutual_tls(pki, tls_config):
    config = tls_config(mutual=True)
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))

    async def status(port: int) -> str:
        async with ControlClient("127.0.0.1", port, tls=context) as control:
            return (await control.status()).control_mode

    with running(config) as w:
        assert trio.run(status, w.port) == "explicit"


def test_tls_files_must_pair(tmp_path, pki, node):
    with raises(ConfigError, "tls_cert_file and tls_key_file go together"):
        node_config(tmp_path, node(tmp_path, endpoints=f'tls_cert_file = "{pki["cert"]}"'))
    with raises(ConfigError, "tls_client_ca_file needs"):
        node_config(tmp_path, node(tmp_path, endpoints=f'tls_client_ca_file = "{pki["ca"]}"'))


@pytest.mark.parametrize("broken", ["missing", "garbage"])
def test_a_tls_file_that_cannot_be_used_is_a_configuration_error(tmp_path, node, broken):
    """Exit 2 with one line naming the files, as for any invalid setting (a traceback
    and exit 1 read, to a supervisor, as a port that may free up)."""
    (tmp_path / "repo").mkdir()
    if broken == "garbage":
        (tmp_path / "cert.pem").write_text("not a certificate\n")
        (tmp_path / "key.pem").write_text("not a key\n")
    endpoints = f'port = {free_port()}\ntls_cert_file = "cert.pem"\ntls_key_file = "key.pem"'
    (tmp_path / "node.toml").write_text(node(tmp_path / "repo", endpoints=endpoints))
    result = run_rsrv("serve", str(tmp_path / "node.toml"))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("rsrv: a TLS file cannot be used (endpoints.tls_cert_file = ")


async def test_the_gateway_command_line_calls_a_tls_gateway(tmp_path, pki):
    """`rsrv gateway status` spoke plain HTTP/2 only: a gateway serving TLS (a node's,
    when its workers do) could not be steered from the command line."""
    from rsrv.config import load_gateway
    from rsrv.gateway import Gateway

    path = tmp_path / "gateway.toml"
    path.write_text(
        f'endpoints = ["127.0.0.1:{free_port()}"]\n'
        f'[listen]\ngrpc = "127.0.0.1:0"\nmetrics = "none"\n'
        f'[grpc]\ntls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\n'
    )
    gateway = Gateway(load_gateway(path, env={}))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(gateway.run)
        address = ["--address", f"127.0.0.1:{port}"]
        plain = await trio.to_thread.run_sync(lambda: run_rsrv("gateway", "status", *address))
        assert plain.returncode == 2
        secure = [*address, "--tls-ca-file", str(pki["ca"])]
        status = await trio.to_thread.run_sync(lambda: run_rsrv("gateway", "status", *secure))
        assert status.returncode == 0, status.stderr
        assert '"mode": "round_robin"' in status.stdout
        alone = [*secure, "--tls-cert-file", str(pki["client_cert"])]
        refused = await trio.to_thread.run_sync(lambda: run_rsrv("gateway", "status", *alone))
        assert refused.returncode == 2
        assert "--tls-cert-file and --tls-key-file go together" in refused.stderr
        nursery.cancel_scope.cancel()
