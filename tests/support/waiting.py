"""The one polling loop of the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float = 20.0, what: str = "", interval: float = 0.005
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; fail with
    an AssertionError naming ``what`` after ``timeout`` seconds. The timeout only guards
    against a hang: no test depends on how long the wait takes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)
