"""Polling helper shared by the tests of live jobs and clusters (``tests`` is on pytest's pythonpath)."""
from __future__ import annotations

import time


def until(cond, timeout: float = 30.0, interval: float = 0.2) -> bool:
    """Poll ``cond()`` every ``interval`` seconds until it is true (True) or ``timeout`` passes (False)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(interval)
    return True
