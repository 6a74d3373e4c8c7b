"""``rsrv gateway`` arguments: a set-policy boolean is one of the spelled-out forms, and
anything else is refused (exit 2) rather than read as false; a number that is not one is
refused naming its key; set-replicas takes N (1 or more), all or default; status and
repack take no arguments; their options never go with running a gateway."""

from __future__ import annotations

import argparse
import signal

import pytest

from rsrv.cli import main
from rsrv.gateway._ctl import _request


@pytest.mark.parametrize(("word", "value"), [("true", True), ("OFF", False), ("0", False)])
def test_booleans_are_spelled_out(word, value):
    _, request, _ = _request(
        "set-policy", [f"forbid_memory_oversubscription={word}"], argparse.Namespace()
    )
    assert list(request.update_mask) == ["forbid_memory_oversubscription"]
    assert request.policy.forbid_memory_oversubscription is value


@pytest.mark.parametrize("word", ["flase", "maybe", ""])
def test_anything_else_is_refused(word):
    with pytest.raises(ValueError, match="expected true or false"):
        _request("set-policy", [f"forbid_memory_oversubscription={word}"], argparse.Namespace())


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        ("set-policy", ["compaction_interval=x"], "compaction_interval='x': expected an integer"),
        ("set-policy", ["hysteresis=abc"], "hysteresis='abc'"),
        ("set-replicas", ["m", "abc"], "'abc': expected N"),
        ("set-replicas", ["m", "0"], "'0': expected N"),
        ("set-replicas", ["m", "-1"], "'-1': expected N"),
        ("repack", ["10"], "repack takes no arguments, not '10' \\(the time to wait is --wait"),
        ("status", ["10.0.0.5:8001"], "status takes no arguments"),
    ],
)
def test_a_malformed_command_line_is_refused_saying_why(command, args, message):
    options = argparse.Namespace(fill_mode="", allow_unknown=False, fill_factor=None)
    with pytest.raises(ValueError, match=message):
        _request(command, args, options)


@pytest.mark.parametrize(
    ("command", "args", "option", "value"),
    [
        ("status", [], "wait", 3.0),
        ("repack", [], "fill_mode", "spread"),
        ("set-policy", ["hysteresis=0.1"], "fill_factor", 2.0),
        ("status", [], "allow_unknown", True),
    ],
)
def test_an_option_of_another_command_is_refused(command, args, option, value):
    """(`rsrv gateway status --wait 3` made its call, the option silently dropped.)"""
    options = argparse.Namespace(**{option: value})
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{flag} is an option of .*, not of {command}$"):
        _request(command, args, options)


def test_replica_counts():
    options = argparse.Namespace(fill_mode="", allow_unknown=False, fill_factor=None)
    counts = [
        _request("set-replicas", ["m", n], options)[1].replicas for n in ("3", "all", "default")
    ]
    assert counts == [3, -1, 0]


@pytest.mark.parametrize("option", [["--address", "10.0.0.1:8001"], ["--wait", "3"]])
def test_a_command_option_with_a_gateway_to_run_is_refused(capsys, option):
    """`rsrv gateway gw.toml --address ...` ran a gateway, the option silently ignored
    (a mistyped command looked like it worked)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:  # (a server command holds the stop signals first thing: this process's)
        with pytest.raises(SystemExit) as ended:
            main(["gateway", "gw.toml", *option])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert ended.value.code == 2
    assert f"gateway: {option[0]}: options of the commands" in capsys.readouterr().err
