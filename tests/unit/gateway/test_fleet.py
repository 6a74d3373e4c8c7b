"""Which worker addresses are this machine's (system shared memory needs every worker
here): loopback, unspecified, and the machine's own interface addresses, however the
host name resolves."""

from __future__ import annotations

import socket

import pytest

from rsrv.gateway._fleet import is_local_host


def own_address() -> str | None:
    """This machine's address on its default route; None without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("203.0.113.7", 9))  # (TEST-NET-3: nothing is sent)
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "0.0.0.0", "::"])
def test_loopback_and_unspecified_addresses_are_this_machine(host):
    assert is_local_host(host)


def test_an_address_of_this_machines_interfaces_is_this_machine():
    """Not only what the host name resolves to (often 127.0.1.1 in /etc/hosts)."""
    address = own_address()
    if address is None:
        pytest.skip("this machine has no route off loopback")
    assert is_local_host(address)


def test_other_machines_are_not_and_unknown_names_are_not_known():
    assert is_local_host("203.0.113.7") is False
    assert is_local_host("no-such-host.invalid") is None  # (it may resolve later)
