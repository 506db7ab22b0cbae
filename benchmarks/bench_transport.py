"""Transport micro-benchmark: what a draft/verify round trip and a probability
block cost over shared memory, a pipe, loopback TCP and an in-process call.

    python benchmarks/bench_transport.py [--iters 5000] [--block-iters 200] [--json] [--no-pin]

One run measures, for each transport:
* the round trip of a DraftRequest (k=5) answered by a packed DraftResult,
  idle and with a numpy matmul process beside it (and how much of that
  process's throughput survives: a spinning waiter steals it);
* the time to hand a 5 x 152,064 float32 probability block from a worker to
  the engine: a TensorRef into the shared arena (written in place, or copied
  in once) against the bytes through a multiprocessing pipe;
* the CPU time a process burns waiting ~1 s for a record that never comes.
The engine and the worker are pinned to two different cores when the host has
them (--no-pin to compare). Prints Markdown tables; --json prints the numbers.
Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: the load is one core's worth, spawned children inherit it
import numpy as np  # noqa: E402

from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.transport import PeerClosed, connect, listen, pack_frame, unpack_frame
from hetero_sd.transport.serve import pin_to_cpu, serve

CTX = mp.get_context("spawn")
REQUEST = DraftRequest(1, 200, 5, [11, 12]).pack()
REPLY = DraftResult(1, [21, 22, 23, 24, 25]).pack()
ROWS, VOCAB = 5, 152_064


def cpus() -> tuple[int | None, int | None]:
    """(engine core, worker core), or Nones when there are not two to pin to."""
    have = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (have[0], have[1]) if len(have) >= 2 else (None, None)


class pinned:
    """Pin this process to `cpu` for the block, then restore its affinity."""

    def __init__(self, cpu: int | None):
        self.cpu, self.old = cpu, None

    def __enter__(self):
        if self.cpu is not None:
            self.old = os.sched_getaffinity(0)
            pin_to_cpu(self.cpu)

    def __exit__(self, *exc):
        if self.old is not None:
            os.sched_setaffinity(0, self.old)


def reply(_record: bytes) -> bytes:
    return REPLY


def pct(samples: list[int], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


# ------------------------------------------------------------------ compute load beside us
def matmul_load(counter, stop) -> None:
    a = np.random.default_rng(0).standard_normal((192, 192), dtype=np.float32)
    while not stop.is_set():
        a = np.tanh(a @ a)
        with counter.get_lock():
            counter.value += 1


class Load:
    """A matmul process; `rate()` is its throughput over the last interval."""

    def __init__(self):
        self.counter, self.stop = CTX.Value("q", 0), CTX.Event()
        self.proc = CTX.Process(target=matmul_load, args=(self.counter, self.stop), daemon=True)
        self.proc.start()
        while self.counter.value == 0:
            time.sleep(0.01)
        self.mark()

    def mark(self) -> None:
        self._t, self._n = time.perf_counter(), self.counter.value

    def rate(self) -> float:
        return (self.counter.value - self._n) / (time.perf_counter() - self._t)

    def close(self) -> None:
        self.stop.set()
        self.proc.join(10)


# ------------------------------------------------------------------ control round trips
def round_trips(kind: str, iters: int, pin: bool, min_seconds: float = 0.0) -> list[int]:
    """`iters` timed round trips; then untimed ones until min_seconds have
    passed, so the load beside us is measured over a long enough window."""
    engine_cpu, worker_cpu = cpus() if pin else (None, None)
    if kind == "call":  # the floor: a Python function call, no transport
        samples = []
        for _ in range(iters):
            t = time.perf_counter_ns()
            reply(REQUEST)
            samples.append(time.perf_counter_ns() - t)
        return samples
    if kind == "inproc":  # both ends in this thread, as today's engine would use it
        server = listen("inproc")
        client = connect(server.address)
        samples = []
        for _ in range(iters):
            t = time.perf_counter_ns()
            server.send(REQUEST)
            client.send(reply(client.recv()))
            server.recv()
            samples.append(time.perf_counter_ns() - t)
        server.close()
        return samples
    with listen(kind) as server:
        worker = CTX.Process(target=serve, args=(server.address, reply), kwargs={"cpu": worker_cpu})
        worker.start()
        server.handed_over()
        try:
            with pinned(engine_cpu):
                for _ in range(300):  # warm-up: connection, page faults, caches
                    server.send(REQUEST, timeout=60)
                    server.recv(timeout=60)
                samples, start = [], time.perf_counter()
                for _ in range(iters):
                    t = time.perf_counter_ns()
                    server.send(REQUEST, timeout=10)
                    server.recv(timeout=10)
                    samples.append(time.perf_counter_ns() - t)
                while time.perf_counter() - start < min_seconds:
                    server.send(REQUEST, timeout=10)
                    server.recv(timeout=10)
        finally:
            server.close()
            worker.join(30)
    return samples


def control_table(iters: int, pin: bool) -> dict:
    kinds = ["shm", "pipe", "tcp", "inproc", "call"]
    out = {k: {} for k in kinds}
    for k in kinds:
        s = round_trips(k, iters, pin)
        out[k]["idle"] = {"p50_us": pct(s, 0.5), "p99_us": pct(s, 0.99)}
    load = Load()
    time.sleep(0.5)
    for k in kinds:
        load.mark()
        time.sleep(0.5)
        alone = load.rate()  # the matmul rate with the engine idle, just before (other users drift)
        load.mark()
        s = round_trips(k, iters, pin, min_seconds=1.0)
        kept = load.rate() / alone if k in ("shm", "pipe", "tcp") else None  # others: no 2nd process
        out[k]["load"] = {"p50_us": pct(s, 0.5), "p99_us": pct(s, 0.99), "compute_kept": kept}
    load.close()
    return out


# ------------------------------------------------------------------ probability block handoff
def block_worker(address, mode: str) -> None:
    """Answer each request with a ROWS x VOCAB float32 block: by arena ref
    (written in place, or copied in from private memory) or as pipe bytes."""
    probs = np.random.default_rng(1).random((ROWS, VOCAB), dtype=np.float32)
    with connect(address) as ch:
        try:
            while True:
                ch.recv(timeout=60)
                if mode == "pipe":
                    ch.send(probs.data, timeout=60)  # multiprocessing sends the buffer as is
                    continue
                lease = ch.tx_arena.claim(timeout=60)
                ref, view = lease.alloc((ROWS, VOCAB), np.float32)
                if mode == "arena+copy":
                    np.copyto(view, probs)
                ch.send(pack_frame(REPLY, [ref]), timeout=60)
        except PeerClosed:
            pass


def block_handoff(mode: str, iters: int, pin: bool) -> dict:
    engine_cpu, worker_cpu = cpus() if pin else (None, None)
    kind = "pipe" if mode == "pipe" else "shm"
    opts = {} if kind == "pipe" else {"arena_regions": 2, "arena_region_bytes": ROWS * VOCAB * 4}
    with listen(kind, **opts) as server:
        worker = CTX.Process(target=block_worker, args=(server.address, mode))
        worker.start()
        server.handed_over()
        samples, checksum = [], 0.0
        with pinned(engine_cpu):
            for i in range(iters + 20):
                t = time.perf_counter_ns()
                server.send(REQUEST, timeout=60)
                frame = server.recv(timeout=60)
                if mode == "pipe":
                    probs = np.frombuffer(frame, dtype=np.float32).reshape(ROWS, VOCAB)
                else:
                    _, (ref,) = unpack_frame(frame)
                    probs = server.rx_arena.view(ref)
                dt = time.perf_counter_ns() - t
                checksum += float(probs[i % ROWS, i % VOCAB])  # touch it, outside the timing
                if mode != "pipe":
                    del probs
                    server.rx_arena.release(ref.region)
                if i >= 20:
                    samples.append(dt)
        server.close()
        worker.join(30)
    return {"p50_us": pct(samples, 0.5), "p99_us": pct(samples, 0.99)}


# ------------------------------------------------------------------ idle CPU while waiting
def idle_waiter(address, seconds: float, result, options: dict) -> None:
    with connect(address, **options) as ch:
        t0 = time.process_time()  # user + system CPU of this process, ns resolution (os.times ticks 10 ms)
        try:
            ch.recv(timeout=seconds)
        except Exception:  # the timeout is the point
            pass
        result.value = time.process_time() - t0
        try:
            ch.recv(timeout=30)  # the server's goodbye
        except Exception:
            pass


def idle_cpu(kind: str, seconds: float = 1.0, **waiter_options) -> float:
    result = CTX.Value("d", -1.0)
    with listen(kind) as server:
        worker = CTX.Process(target=idle_waiter, args=(server.address, seconds, result, waiter_options))
        worker.start()
        server.handed_over()
        while result.value < 0 and worker.is_alive():
            time.sleep(0.05)
        server.send(b"bye", timeout=5)
        worker.join(30)
    return result.value * 1e3 / seconds  # CPU ms per second of waiting


# ------------------------------------------------------------------ report
def markdown(res: dict) -> str:
    c = res["control"]
    lines = [f"Round trip of a DraftRequest/DraftResult, {res['iters']} round trips "
             f"(pinned: {res['pinned']}), microseconds",
             "| transport | idle p50 | idle p99 | load p50 | load p99 | matmul throughput kept |",
             "|---|---|---|---|---|---|"]
    for k, v in c.items():
        kept = v["load"]["compute_kept"]
        lines.append(f"| {k} | {v['idle']['p50_us']:.1f} | {v['idle']['p99_us']:.1f} | "
                     f"{v['load']['p50_us']:.1f} | {v['load']['p99_us']:.1f} | "
                     f"{'-' if kept is None else f'{100 * kept:.0f}%'} |")
    shm, tcp = c["shm"]["idle"]["p50_us"], c["tcp"]["idle"]["p50_us"]
    lines += ["", f"shm vs TCP (idle p50): {tcp / shm:.1f}x faster", "",
              f"Handing a {ROWS} x {VOCAB} float32 block to the engine, "
              f"{res['block_iters']} times, microseconds",
              "| path | p50 | p99 |", "|---|---|---|"]
    for k, v in res["block"].items():
        lines.append(f"| {k} | {v['p50_us']:.1f} | {v['p99_us']:.1f} |")
    lines += ["", "CPU burnt by a process waiting ~1 s for a record (ms of CPU per s)",
              "| waiter | CPU ms/s |", "|---|---|"]
    for k, v in res["idle_cpu"].items():
        lines.append(f"| {k} | {v:.1f} |")
    lines += ["", f"load average before: {res['loadavg_before']}, after: {res['loadavg_after']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=5000, help="round trips per transport and condition")
    ap.add_argument("--block-iters", type=int, default=200, help="probability blocks per path")
    ap.add_argument("--no-pin", action="store_true", help="leave both processes unpinned")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args(argv)
    pin = not args.no_pin and cpus()[0] is not None
    res = {"iters": args.iters, "block_iters": args.block_iters, "pinned": pin,
           "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    res["control"] = control_table(args.iters, pin)
    res["block"] = {m: block_handoff(m, args.block_iters, pin) for m in ("arena", "arena+copy", "pipe")}
    res["idle_cpu"] = {"shm (50 us spin, then futex)": idle_cpu("shm"),
                       "shm (pure spin)": idle_cpu("shm", spin_us=2e6),
                       "pipe": idle_cpu("pipe"), "tcp": idle_cpu("tcp")}
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res, indent=2) if args.json else markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
