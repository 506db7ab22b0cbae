"""Atomic uint32 words and futex waits over a shared buffer, from Python, no compiler.

Why this shape (measured on 2-core CPU hosts; benchmarks/bench_transport.py reproduces it):

* A ring needs three orderings on its control words: *release* when publishing
  an index after the payload, *acquire* when reading it before the payload, and
  a *sequentially consistent store-then-load* for the "I am going to sleep"
  handshake (waiter: store flag, load index; waker: store index, load flag).
  Without the last one either side may miss the other's store and a wake-up is
  lost.
* CPython has no atomics. We call the C11 ones in libatomic (`__atomic_load_4`,
  `__atomic_store_4`, `__atomic_exchange_4`) through ctypes: ~0.2 us a call,
  present as `libatomic1` on every Debian/Ubuntu host that has gcc's runtime,
  correct on every architecture. The `atomics` package was considered: its
  public API costs ~5.5 us an operation and its wheels stop at CPython 3.11.
* On x86-64 (TSO) aligned 4-byte loads and stores are already acquire and
  release at the hardware level, and a store through a memoryview is one `mov`
  in a C function the interpreter calls after the payload copy has returned, so
  only the seq-cst store needs more: the store, then libatomic's
  `atomic_thread_fence(seq_cst)` (an `mfence`, ~0.2 us through ctypes.PyDLL,
  cheaper than a ctypes `__atomic_exchange_4` with argument conversion).
* Without libatomic on x86-64 we fall back to "always FUTEX_WAKE after a
  publish": the kernel's futex wake path issues a full barrier before it looks
  for waiters and the wait path re-reads the word after its own barrier, which
  is the documented lost-wake-up-free futex protocol; the price is one syscall
  per publish. Without libatomic elsewhere (ARM: plain Python stores are not
  ordered) we refuse, naming the package to install.
* Waiting: a shared (not private) FUTEX_WAIT on the word itself, so the kernel
  re-checks the value under its own lock; futex is Linux-only, so is this
  transport (TCP and pipes work everywhere).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import sys
import time

from hetero_sd.transport.errors import PeerClosed, TransportError, TransportTimeout

_MACHINE = platform.machine().lower()
IS_X86 = _MACHINE in ("x86_64", "amd64", "i386", "i686")
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98,
              "riscv64": 98, "ppc64le": 221, "s390x": 238, "i386": 240, "i686": 240}
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # no FUTEX_PRIVATE_FLAG: the word is mapped by two processes
_RELAXED, _ACQUIRE, _RELEASE, _SEQ_CST = 0, 2, 3, 5
_INT_MAX = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libatomic():
    """(load, store, fence) from libatomic, or None. PyDLL: these return at once,
    so keeping the GIL is cheaper than releasing it around the call."""
    path = ctypes.util.find_library("atomic")
    for candidate in ([path] if path else []) + ["libatomic.so.1"]:
        try:
            lib = ctypes.PyDLL(candidate)
            break
        except OSError:
            continue
    else:
        return None
    u32p, u32, i = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int
    load, store = lib["__atomic_load_4"], lib["__atomic_store_4"]
    load.argtypes, load.restype = [u32p, i], u32
    store.argtypes, store.restype = [u32p, u32, i], None
    try:
        fence = lib["atomic_thread_fence"]  # libatomic >= 1.2 (gcc 7)
        fence.argtypes, fence.restype = [i], None
    except AttributeError:
        xchg = lib["__atomic_exchange_4"]
        xchg.argtypes, xchg.restype = [u32p, u32, i], u32
        scratch = ctypes.c_uint32(0)

        def fence(order):  # a locked exchange is a full fence
            xchg(ctypes.addressof(scratch), 0, order)
    return load, store, fence


def _load_syscall():
    if not sys.platform.startswith("linux") or _MACHINE not in _SYS_FUTEX:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return fn


_LIBATOMIC = _load_libatomic()
_SYSCALL = _load_syscall()


def without_libatomic() -> None:
    """Order the words as a host without libatomic does (a test hook: the x86 fallback
    that wakes on every publish); rings set up after this use it."""
    global _LIBATOMIC
    _LIBATOMIC = None


def ordering_mode() -> str:
    """How this host orders the ring's control words: 'libatomic',
    'x86-futex-always-wake', or 'unsupported'."""
    if _SYSCALL is None:
        return "unsupported"
    if _LIBATOMIC is not None:
        return "libatomic"
    return "x86-futex-always-wake" if IS_X86 else "unsupported"


def check_supported() -> None:
    mode = ordering_mode()
    if mode == "unsupported":
        why = ("futex is Linux-only" if _SYSCALL is None else
               f"{_MACHINE} needs real atomics and libatomic was not found")
        raise TransportError(f"the shared-memory transport is not available here ({why}); "
                             "install libatomic1 (apt-get install libatomic1) or use "
                             "transport 'tcp' or 'pipe'")


class SharedWords:
    """The uint32 words of a shared buffer with the memory orders a ring needs.

    Word indices count 4-byte words from the start of `buf`. Holding this object
    keeps a buffer export on the mapping, so it cannot be unmapped under a
    waiting thread; `release()` drops it."""

    def __init__(self, buf: memoryview):
        check_supported()
        self.words = buf.cast("B").cast("I")
        self._c = (ctypes.c_char * len(buf)).from_buffer(buf)
        self.base = ctypes.addressof(self._c)
        base = self.base
        words = self.words
        # No seq-cst store available: publishers must FUTEX_WAKE every time.
        self.wake_always = _LIBATOMIC is None
        if _LIBATOMIC is not None and not IS_X86:  # C11 atomics with their orders, one call each
            aload, astore, _ = _LIBATOMIC
            self.load_acquire = lambda i: aload(base + 4 * i, _ACQUIRE)
            self.store_release = lambda i, v: astore(base + 4 * i, v, _RELEASE)
            self.load_seqcst = lambda i: aload(base + 4 * i, _SEQ_CST)
            self.store_seqcst = lambda i, v: astore(base + 4 * i, v, _SEQ_CST)
        else:  # x86 TSO: plain aligned loads/stores are acquire/release; seq-cst loads are plain
            self.load_acquire = self.load_seqcst = words.__getitem__
            self.store_release = words.__setitem__
            if _LIBATOMIC is not None:  # a seq-cst store is a store then a full fence (mfence)
                fence = _LIBATOMIC[2]

                def store_seqcst(i, v):
                    words[i] = v
                    fence(_SEQ_CST)

                def publish(word, value, waiting):  # the hot path, inlined
                    words[word] = value
                    fence(_SEQ_CST)
                    if words[waiting]:
                        self.futex_wake(word)
                self.store_seqcst, self.publish = store_seqcst, publish
            else:  # ordering comes from the unconditional FUTEX_WAKE (wake_always)
                self.store_seqcst = words.__setitem__

    def publish(self, word: int, value: int, waiting: int) -> None:
        """Seq-cst store of `value` to `word`, then wake its sleeper if the
        `waiting` flag says there is one (the waker's half of the handshake)."""
        self.store_seqcst(word, value)
        if self.wake_always or self.load_seqcst(waiting):
            self.futex_wake(word)

    def futex_wait(self, i: int, expected: int, timeout_s: float | None) -> bool:
        """Sleep while word i == expected, at most timeout_s. False only on timeout."""
        ts = None
        if timeout_s is not None:
            timeout_s = max(timeout_s, 0.0)
            ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        rc = _SYSCALL(_SYS_FUTEX[_MACHINE], self.base + 4 * i, FUTEX_WAIT, expected,
                      ctypes.byref(ts) if ts is not None else None, None, 0)
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EINTR):  # value already changed, or a signal
            return True
        if err == errno.ETIMEDOUT:
            return False
        raise TransportError(f"futex wait failed: {os.strerror(err)}")

    def futex_wake(self, i: int, n: int = _INT_MAX) -> None:
        _SYSCALL(_SYS_FUTEX[_MACHINE], self.base + 4 * i, FUTEX_WAKE, n, None, None, 0)

    def wait(self, word: int, flag: int, closed: int, ready, timeout: float | None, *,
             spin_s: float, check_interval: float, on_idle=None, what: str = "change") -> int:
        """Spin up to spin_s, then sleep on `word` until ready(value); return that value.

        `flag` is this waiter's WAITING word (the sleep handshake, see the module
        docstring), `closed` a word the other end sets on close. Sleeps last at
        most check_interval so `on_idle()` (which may raise) runs while idle."""
        load = self.load_acquire
        value = load(word)
        if ready(value):
            return value
        now = time.perf_counter()
        deadline = None if timeout is None else now + timeout
        spin_until = now + (spin_s if timeout is None else min(spin_s, timeout))
        while time.perf_counter() < spin_until:
            value = load(word)
            if ready(value):
                return value
        while True:
            self.store_seqcst(flag, 1)
            value = self.load_seqcst(word)
            woken = True
            if not ready(value) and not self.load_seqcst(closed):
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    self.store_release(flag, 0)
                    raise TransportTimeout(f"no {what} within {timeout:.3g} s: the peer may be hung")
                woken = self.futex_wait(word, value, check_interval if left is None
                                        else min(left, check_interval))
                value = load(word)
            self.store_release(flag, 0)
            if ready(value):
                return value
            if load(closed):
                raise PeerClosed("the channel was closed by the other end")
            if not woken and on_idle is not None:
                on_idle()  # may raise PeerClosed when the peer process is gone

    def release(self) -> None:
        """Drop every buffer export this object holds (so the mapping can close)."""
        for name in ("load_acquire", "store_release", "load_seqcst", "store_seqcst", "publish"):
            self.__dict__.pop(name, None)
        self._c = None
        self.words.release()
