"""Waiting without timing: a generous bound whose expiry is the failure."""
from __future__ import annotations

import threading

HANG_S = 60  # nothing asserts how fast a wait ends (a loaded CI host is slow), only that it ends


def finishes(fn, within: float = HANG_S):
    """fn() in a daemon thread: its result, or the exception it raised; fails
    if it is still blocked after `within` seconds."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised below, in the test's thread
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(within)
    assert not th.is_alive(), f"still blocked after {within} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")
