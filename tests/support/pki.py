"""A certificate authority made for a test (trustme): a server certificate for
127.0.0.1 and localhost, and a client certificate, in PEM files."""

from __future__ import annotations

from pathlib import Path

import trustme


def write_pki(root: Path) -> dict[str, Path]:
    """PEM files under ``root``: ``ca``, ``cert`` and ``key`` (the server's),
    ``client_cert`` and ``client_key``."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@rsrv.test")
    files = {
        "ca": root / "ca.pem",
        "cert": root / "server.pem",
        "key": root / "server.key",
        "client_cert": root / "client.pem",
        "client_key": root / "client.key",
    }
    ca.cert_pem.write_to_path(files["ca"])
    server.cert_chain_pems[0].write_to_path(files["cert"])
    server.private_key_pem.write_to_path(files["key"])
    client.cert_chain_pems[0].write_to_path(files["client_cert"])
    client.private_key_pem.write_to_path(files["client_key"])
    return files
