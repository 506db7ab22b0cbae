"""benchmarks/bench_cluster_link.py end to end with a few probes and a small vocabulary:
all three paths and both sizes measured, and the local Ray cluster it started gone
afterwards. Speed is never asserted."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cluster_link.py"


def _processes():
    """(pid, command line) of every live process, from /proc (zombies have exited: skipped)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):  # gone meanwhile
            continue
        if state != "Z":
            yield int(entry.name), cmd


def _left_behind(pids: list[int], session_dir: str) -> list[str]:
    """Processes of the benchmark's Ray session still running: anything whose command line
    names the session's directory (gcs_server, raylets, agents), and its nodes' processes and
    the actor by pid (a recycled pid counts only when it is a Ray process again)."""
    return [f"{pid}: {cmd[:160]}" for pid, cmd in _processes()
            if session_dir in cmd or (pid in pids and "ray" in cmd)]


def test_three_paths_two_sizes_and_no_ray_left(tmp_path):
    out = tmp_path / "link.json"
    # A subprocess, as the benchmark is run: its spawned workers re-import it as __main__,
    # and Ray's driver state stays out of this test process. The cwd keeps the repository
    # root off sys.path (tests/hetero_sd would shadow the package).
    run = subprocess.run([sys.executable, str(_PATH), "--probes", "5", "--vocab", "512", "--batch", "2",
                          "--warmup", "2", "--json", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["probes"], res["vocab"], res["rows"], res["block_bytes"]) == (5, 512, 5, 5 * 512 * 8)
    assert set(res["paths"]) == {"ray", "shm", "tcp"}
    for path, sizes in res["paths"].items():
        assert set(sizes) == {"control", "block"}, path
        for size, q in sizes.items():
            assert 0 < q["p50_us"] <= q["p99_us"], (path, size, q)
    assert set(res["ratios"]) == {"ray/shm", "ray/tcp"}
    assert all(v > 0 for r in res["ratios"].values() for v in r.values())
    for row in ("| ray |", "| shm |", "| tcp |", "ray/shm:", "ray/tcp:"):
        assert row in run.stdout, row

    ray = res["ray"]
    assert ray["nodes"] == 3 and ray["actor_node"] != ray["head_node"]
    pids = [*ray["pids"], ray["actor_pid"]]
    assert ray["pids"] and ray["session_dir"]
    # The benchmark has returned, so its cluster should be down; an actor worker whose raylet
    # was killed exits on its own, so give stragglers time rather than fail on a race.
    deadline = time.monotonic() + 60
    while _left_behind(pids, ray["session_dir"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _left_behind(pids, ray["session_dir"])
