"""Shared-memory segments: 0600, unique names, and unlinked on every exit path."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hetero_sd.transport import PeerClosed, TransportError, cleanup_stale, listen
from hetero_sd.transport.segment import SHM_DIR, Segment, pid_namespace

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="POSIX shared memory in /dev/shm: Linux")
sys.path.insert(0, str(Path(__file__).parent))
import transport_peers  # noqa: E402

CTX = multiprocessing.get_context("spawn")


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def wait_gone(name: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not exists(name):
            return True
        time.sleep(0.05)
    return False


def run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=timeout)


def test_segments_are_0600_and_uniquely_named():
    with listen("shm") as a, listen("shm") as b:
        assert a.name != b.name
        for ch in (a, b):
            assert os.stat(os.path.join(SHM_DIR, ch.name)).st_mode & 0o777 == 0o600
            assert f"-{os.getpid()}-" in ch.name


def test_close_unlinks_and_is_idempotent():
    ch = listen("shm")
    name = ch.name
    assert exists(name)
    ch.close()
    ch.close()
    assert not exists(name)


def test_an_exception_inside_the_with_block_unlinks():
    with pytest.raises(RuntimeError):
        with listen("shm") as ch:
            name = ch.name
            raise RuntimeError("boom")
    assert not exists(name)


def test_the_attaching_process_never_unlinks():
    with listen("shm") as ch:
        parent, child = CTX.Pipe()
        p = CTX.Process(target=transport_peers.attach_and_report, args=(ch.name, child))
        p.start()
        assert parent.recv() == "attached"
        p.join(30)
        assert p.exitcode == 0
        assert exists(ch.name)  # the child's exit (and its close) left it alone
        assert ch._segment.buf[0] == 7  # and it really wrote into our segment
        name = ch.name
    assert not exists(name)


def test_atexit_unlinks_a_channel_left_open():
    out = run_script("""
        from hetero_sd.transport import listen
        ch = listen("shm")
        print(ch.name)
    """)
    assert out.returncode == 0, out.stderr
    assert not exists(out.stdout.strip())


def test_a_forked_child_inheriting_the_owner_does_not_unlink():
    out = run_script("""
        import atexit, os
        from hetero_sd.transport import listen
        ch = listen("shm")
        pid = os.fork()
        if pid == 0:
            ch.close()              # the child's close and atexit must not unlink
            atexit._run_exitfuncs()
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.path.exists("/dev/shm/" + ch.name))
        ch.close()
        print(os.path.exists("/dev/shm/" + ch.name))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


def test_a_creator_killed_with_sigkill_is_cleaned_up_by_its_resource_tracker():
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from hetero_sd.transport import listen
        ch = listen("shm")
        print(ch.name, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert exists(name)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert wait_gone(name, 30), "the creator's resource tracker did not unlink its segment"


def test_when_the_peer_is_killed_the_creator_notices_and_unlinks():
    ch = listen("shm", check_interval=0.05)
    name = ch.name
    parent, child = CTX.Pipe()
    p = CTX.Process(target=transport_peers.attach_then_hang, args=(ch.address, child))
    p.start()
    try:
        assert parent.recv() == p.pid
        os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(PeerClosed, match="died"):
            ch.recv(timeout=30)  # the pid check ends the wait; the timeout would raise TransportTimeout
    finally:
        p.kill()
        p.join(30)
        ch.close()
    assert not exists(name)


def test_cleanup_stale_removes_segments_of_dead_creators_only():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = f"hsd-{pid_namespace():x}-{dead}-0123456789ab"
    fd = os.open(os.path.join(SHM_DIR, stale), os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    with listen("shm") as live:
        removed = cleanup_stale()
        assert stale in removed
        assert not exists(stale)
        assert exists(live.name)


def test_attach_rejects_foreign_and_missing_names():
    with pytest.raises(TransportError, match="not a hetero-sd segment name"):
        Segment.attach("../etc/passwd")
    with pytest.raises(TransportError, match="does not exist"):
        Segment.attach(f"hsd-{pid_namespace():x}-{os.getpid()}-ffffffffffff")
