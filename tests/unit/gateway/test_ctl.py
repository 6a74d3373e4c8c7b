"""``rsrv gateway set-policy`` values: a boolean is one of the spelled-out forms, and
anything else is refused (exit 2) rather than read as false."""

from __future__ import annotations

import argparse

import pytest

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
