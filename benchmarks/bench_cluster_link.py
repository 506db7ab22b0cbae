"""Engine <-> drafter link per round: Ray across nodes against shared memory and TCP, in one run.

    python benchmarks/bench_cluster_link.py [--probes 300] [--vocab 49152] [--batch 10]
                                            [--warmup 20] [--json out.json]

Three paths from this process (the engine) to a drafter in another process:
* ray: a local ray.cluster_utils.Cluster (a head and two worker nodes that
  offer {"draft_node": 1}); an actor placed on a worker node answers
  `probe` with cluster/link.probe_reply, as DrafterActor.probe does for
  cluster/link.measure_link. The block goes through the worker node's object
  store and is pulled to the head's, the cross-node path.
* shm: listen("shm") with tensor arenas and a spawned worker that answers with
  drafting/wire.encode_reply, so the block goes through the arena exactly as
  the shm worker drafter sends it (and comes back via wire.decode_reply).
* tcp: listen("tcp") and the same worker: the block inline in the frame.
Each path: (a) a control record (a packed DraftRequest of 16 tokens) there and
back; (b) the record there and a 5 x vocab float64 block back. The paths take
turns a batch of probes at a time (order rotated every batch), so a shared
host's noise hits all three alike. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import struct
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy loads: three raylets and two workers share the cores

from hetero_sd.cluster.link import BLOCK_ROWS, percentile, probe_reply  # noqa: E402
from hetero_sd.drafting.wire import DRAFT, OK, Reply, decode_reply, encode_reply  # noqa: E402
from hetero_sd.ir.work import DraftRequest  # noqa: E402
from hetero_sd.transport import PeerClosed, connect, listen  # noqa: E402

CTX = mp.get_context("spawn")  # a fork would copy the driver's Ray threads and sockets
RECORD = DraftRequest(0, 0, BLOCK_ROWS, list(range(16))).pack()  # the record measure_link sends
_ROWS = struct.Struct("<H")  # the probe's `rows` argument, which the Ray call carries as an argument
PATHS = ("ray", "shm", "tcp")
SIZES = {"control": 0, "block": BLOCK_ROWS}
IDLE_S = 600.0  # a worker whose engine hung gives up after this long


def link_worker(address: str, vocab: int) -> None:
    """The drafter's side of a transport: every probe answered with one wire frame."""
    with connect(address) as ch:
        try:
            while True:
                msg = ch.recv(IDLE_S)
                (rows,) = _ROWS.unpack_from(msg)
                record, block = probe_reply(msg[_ROWS.size:], rows, vocab)  # the actor's block
                ch.send(encode_reply(ch, Reply(OK, DRAFT, record, probs=block)), IDLE_S)
        except PeerClosed:
            pass


class TransportPath:
    def __init__(self, kind: str, vocab: int):
        self.vocab = vocab
        arena = {"arena_regions": 2, "arena_region_bytes": BLOCK_ROWS * vocab * 8} if kind == "shm" else {}
        self.server = listen(kind, **arena)
        self.proc = CTX.Process(target=link_worker, args=(self.server.address, vocab), daemon=True)
        self.proc.start()
        self.server.handed_over()

    def probe(self, rows: int) -> float:
        t0 = time.perf_counter()
        self.server.send(_ROWS.pack(rows) + RECORD, timeout=60)
        reply = decode_reply(self.server, self.server.recv(timeout=60), self.vocab)
        dt = time.perf_counter() - t0
        _check(reply.body, reply.probs, rows, self.vocab)
        if reply.region is not None:
            reply.probs = None  # the view dies before its region goes back to the worker
            self.server.rx_arena.release(reply.region)
        return dt

    def close(self) -> None:
        self.server.close()  # the worker reads PeerClosed and returns
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)


def _prober():
    """The actor class, made in a function so Ray pickles it by value (Ray's
    workers cannot import this file as a module)."""

    class Prober:
        def probe(self, record: bytes, rows: int, vocab: int):
            return probe_reply(record, rows, vocab)

        def where(self) -> tuple[str, int]:
            import ray

            return ray.get_runtime_context().get_node_id(), os.getpid()

    return Prober


class RayPath:
    def __init__(self, vocab: int):
        import ray
        from ray.cluster_utils import Cluster

        self.ray, self.vocab, self.cluster = ray, vocab, Cluster()
        try:  # a node that started is stopped again whatever fails after it
            self.cluster.add_node(include_dashboard=False)  # the first node is the head
            for _ in range(2):
                self.cluster.add_node(num_cpus=1, resources={"draft_node": 1})
            ray.init(address=self.cluster.address, logging_level=logging.WARNING, log_to_driver=False)
            self.actor = (ray.remote(_prober()).options(num_cpus=1, resources={"draft_node": 1}, max_restarts=0)
                          .remote())
            actor_node, actor_pid = ray.get(self.actor.where.remote(), timeout=300)
            head = self.cluster.head_node.node_id
            if actor_node == head:
                raise RuntimeError("the probe actor landed on the head node; the link would not cross nodes")
        except BaseException:
            self.close()
            raise
        nodes = [self.cluster.head_node, *self.cluster.worker_nodes]
        # what a caller checks is gone after close(): the nodes' processes and the actor's
        self.info = {"head_node": head, "actor_node": actor_node, "nodes": len(nodes), "actor_pid": actor_pid,
                     "session_dir": self.cluster.head_node.get_session_dir_path(),
                     "pids": sorted({p.process.pid for n in nodes for ps in n.all_processes.values()
                                     for p in ps if p.process is not None})}

    def probe(self, rows: int) -> float:
        t0 = time.perf_counter()
        record, block = self.ray.get(self.actor.probe.remote(RECORD, rows, self.vocab))
        dt = time.perf_counter() - t0
        _check(record, block, rows, self.vocab)
        return dt

    def close(self) -> None:
        self.ray.shutdown()
        self.cluster.shutdown()


def _check(record: bytes, block, rows: int, vocab: int) -> None:
    """Outside the timing: a probe that came back wrong is a broken path, not a fast one."""
    if bytes(record) != RECORD or (block is None) != (rows == 0):
        raise RuntimeError(f"probe reply does not echo the request (rows {rows})")
    if block is not None and (block.shape != (rows, vocab) or block[rows - 1, vocab - 1] != 1.0 / vocab):
        raise RuntimeError(f"probe block {block.dtype}{list(block.shape)} is not the {rows} x {vocab} block sent")


def run(probes: int, vocab: int, batch: int, warmup: int) -> dict:
    samples = {p: {s: [] for s in SIZES} for p in PATHS}
    paths: dict = {}
    res = {"probes": probes, "vocab": vocab, "rows": BLOCK_ROWS, "block_bytes": BLOCK_ROWS * vocab * 8,
           "batch": batch, "cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    try:
        print("starting a local Ray cluster (head + 2 worker nodes) ...", file=sys.stderr)
        paths["ray"] = RayPath(vocab)
        res["ray"] = paths["ray"].info
        for kind in ("shm", "tcp"):
            paths[kind] = TransportPath(kind, vocab)
        for path in paths.values():  # connections, page faults, the object store's first pulls
            for _ in range(warmup):
                for rows in SIZES.values():
                    path.probe(rows)
        done, turn = 0, 0
        while done < probes:
            n = min(batch, probes - done)
            for name in PATHS[turn % 3:] + PATHS[:turn % 3]:
                for _ in range(n):
                    for size, rows in SIZES.items():  # as measure_link: control, then block
                        samples[name][size].append(paths[name].probe(rows))
            done, turn = done + n, turn + 1
    finally:
        for path in reversed(paths.values()):
            try:
                path.close()
            except Exception as exc:  # close the others anyway
                print(f"closing a path failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    res["paths"] = {p: {s: {"p50_us": percentile(v, 50) * 1e6, "p99_us": percentile(v, 99) * 1e6}
                        for s, v in by.items()} for p, by in samples.items()}
    res["ratios"] = {f"ray/{o}": {f"{s}_{q}": res["paths"]["ray"][s][f"{q}_us"] / res["paths"][o][s][f"{q}_us"]
                                  for s in SIZES for q in ("p50", "p99")} for o in ("shm", "tcp")}
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return res


def markdown(res: dict) -> str:
    kib = res["block_bytes"] / 1024
    lines = [(f"Round trip engine <-> drafter, {res['probes']} probes per path and size, interleaved in "
              f"batches of {res['batch']}; microseconds"),
             (f"control: a {len(RECORD)}-byte DraftRequest (16 tokens) there and back; "
              f"block: the record there, {res['rows']} x {res['vocab']} float64 ({kib:.0f} KiB) back"),
             "| path | control p50 | control p99 | block p50 | block p99 |", "|---|---|---|---|---|"]
    for p, v in res["paths"].items():
        lines.append(f"| {p} | {v['control']['p50_us']:.0f} | {v['control']['p99_us']:.0f} | "
                     f"{v['block']['p50_us']:.0f} | {v['block']['p99_us']:.0f} |")
    lines.append("")
    for name, r in res["ratios"].items():
        lines.append(f"{name}: control p50 {r['control_p50']:.1f}x, p99 {r['control_p99']:.1f}x; "
                     f"block p50 {r['block_p50']:.1f}x, p99 {r['block_p99']:.1f}x")
    ray = res["ray"]
    lines += ["", (f"ray: actor on node {ray['actor_node'][:8]}, engine (driver) on head {ray['head_node'][:8]}, "
                   f"{ray['nodes']} nodes on this host ({res['cpus']} CPUs)"),
              f"load average before: {res['loadavg_before']}, after: {res['loadavg_after']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", type=int, default=300, help="timed probes per path and size")
    ap.add_argument("--vocab", type=int, default=49152, help="the block's columns (default: SmolLM2's vocabulary)")
    ap.add_argument("--batch", type=int, default=10, help="probes a path makes before the next path's turn")
    ap.add_argument("--warmup", type=int, default=20, help="untimed probes per path and size first")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    if args.probes < 1 or args.batch < 1 or args.vocab < 1 or args.warmup < 0:
        ap.error("--probes, --batch and --vocab must be positive, --warmup not negative")
    res = run(args.probes, args.vocab, args.batch, args.warmup)
    print(markdown(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
