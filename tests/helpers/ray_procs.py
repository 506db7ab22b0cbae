"""Ray's processes on this host, for the tests that check a cluster is gone after shutdown."""
from __future__ import annotations

import psutil


def ray_processes() -> list[psutil.Process]:
    """Ray's processes among this test process's descendants (raylets, GCS, workers)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            text = " ".join(proc.cmdline()) + " " + proc.name()
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "raylet" in text or "gcs_server" in text or "ray::" in text or "default_worker.py" in text:
            out.append(proc)
    return out


def ray_daemons() -> set[int]:
    """Every raylet and GCS server on this host (ours or not)."""
    out = set()
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:  # exited, not yet reaped: not running
            continue
        text = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        if "raylet" in text or "gcs_server" in text:
            out.add(proc.pid)
    return out
