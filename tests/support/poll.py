"""Bounded polling of other processes' eventual state in tests (never a sleep as synchronisation)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], bool], timeout_s: float = 20.0) -> float:
    """Polls `pred` until it holds (bounded by `timeout_s` and 10 000 polls); returns the seconds it took."""
    t0 = time.monotonic()
    for _ in range(10_000):
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            break
        time.sleep(0.01)  # the poll's interval
    raise AssertionError(f"condition not met within {timeout_s}s")
