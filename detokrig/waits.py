"""Waiting for a condition against a deadline, never sleeping and hoping."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll `pred` until it is truthy and return its value; TimeoutError naming `what`
    at the deadline."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        time.sleep(interval)
    return value


def wait_on(cond: threading.Condition, pred: Callable[[], Any], timeout: float, what: str) -> Any:
    """The same on a Condition whose holder notifies it when `pred` may have changed
    (pred runs with the lock held)."""
    deadline = time.monotonic() + timeout
    with cond:
        while not (value := pred()):
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"no {what} within {timeout:.0f} s")
            cond.wait(min(left, 0.2))
        return value
