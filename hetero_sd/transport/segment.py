"""Named POSIX shared-memory segments that only their creator unlinks.

On Linux `shm_open(name)` is `open("/dev/shm/name")`; we do that directly so
that attaching never registers the segment with a resource tracker (Python
< 3.13's `SharedMemory` does, and the attacher's tracker then unlinks the
segment when the attacher exits).

The creator unlinks on every exit path, in this order of defence:
1. `close()` (the transports call it from `__exit__` and on errors);
2. an `atexit` hook for segments still open at a normal interpreter exit;
3. multiprocessing's resource tracker, with which the creator registers the
   name: a separate process that unlinks what is still registered once the
   creator is gone, kill -9 and SIGTERM included;
4. `cleanup_stale()`, for when the tracker died too (the whole process group
   was killed): it unlinks segments whose name says their creator's pid is
   dead. Names carry the creator's pid-namespace inode, so a host-wide
   /dev/shm shared by containers is only swept for segments of our namespace.
   A reused pid keeps a stale segment alive until that pid exits: harmless.
"""
from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import warnings

from hetero_sd.transport.errors import TransportError

SHM_DIR = "/dev/shm"
PREFIX = "hsd"
_NAME = re.compile(rf"^{PREFIX}-([0-9a-f]+)-(\d+)-[0-9a-f]+$")
_OWNED: dict[str, "Segment"] = {}  # name -> segment created (and still open) in this process


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    """True while `pid` names a live, non-zombie process of this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")  # a killed child not yet reaped is a zombie
    except (OSError, IndexError):
        return True


def _tracker(action: str, name: str) -> None:
    try:
        from multiprocessing import resource_tracker
        getattr(resource_tracker, action)("/" + name, "shared_memory")
    except Exception as exc:  # the tracker is a defence in depth, never a reason to fail
        warnings.warn(f"resource tracker {action} of {name} failed: {exc}", RuntimeWarning)


class Segment:
    """A mapped shared-memory segment. `Segment.create` owns (and unlinks) it;
    `Segment.attach` only maps it."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name, self.size, self.owner = name, len(mm), owner
        self.creator_pid = os.getpid() if owner else None
        self._mm = mm
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, size: int) -> "Segment":
        if not os.path.isdir(SHM_DIR):
            raise TransportError(f"{SHM_DIR} does not exist: the shared-memory transport "
                                 "needs Linux POSIX shared memory; use 'tcp' or 'pipe'")
        name = f"{PREFIX}-{pid_namespace():x}-{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # explicit: never wider than owner read/write, whatever the umask
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        seg = cls(name, mm, owner=True)
        _OWNED[name] = seg
        _tracker("register", name)
        return seg

    @classmethod
    def attach(cls, name: str) -> "Segment":
        if not _NAME.match(name):
            raise TransportError(f"{name!r} is not a hetero-sd segment name "
                                 f"(expected {PREFIX}-<ns>-<pid>-<hex>)")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise TransportError(f"shared-memory segment {name!r} does not exist "
                                 "(its creator closed it or died)") from None
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def unlink(self) -> None:
        """Remove the name (creator only, and only in the creating process: a
        forked child inherits the object but must not unlink)."""
        if not self.owner or os.getpid() != self.creator_pid:
            return
        if _OWNED.pop(self.name, None) is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        _tracker("unregister", self.name)

    def close(self) -> None:
        """Unlink (creator) and unmap. Views still alive elsewhere (numpy arrays
        over an arena) keep the mapping until they die; the name is gone at once."""
        self.unlink()
        if self.buf is not None:
            try:
                self.buf.release()
                self._mm.close()
            except BufferError:
                pass  # exported views outlive us; the mapping goes with the last of them
            self.buf = None


@atexit.register
def _unlink_owned() -> None:
    for seg in list(_OWNED.values()):
        seg.unlink()


def cleanup_stale() -> list[str]:
    """Unlink hetero-sd segments of this pid namespace whose creator is dead.
    Returns the names removed. Safe to call at any time, e.g. at engine start."""
    removed, ns = [], f"{pid_namespace():x}"
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in entries:
        m = _NAME.match(name)
        if not m or m.group(1) != ns or pid_alive(int(m.group(2))):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except (FileNotFoundError, PermissionError):
            pass
    return removed
