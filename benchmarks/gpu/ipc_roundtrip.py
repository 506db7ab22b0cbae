"""The round trip of a drafter worker's probability rows to the target's process:
CUDA IPC buffers (transport/planes.py) against the shared-memory host arena.

    python benchmarks/gpu/ipc_roundtrip.py [--device cuda|cpu] [--vocab 128256] [--k 5] [--iters 200] [--json]

A producer process (the drafter worker) holds k x vocab float32 rows (a
1B-shaped drafter: Llama-3.2-1B's vocabulary) on its device; for each request
from the consumer (the engine) it writes them into the plane and sends the
control record over the shm ring; the consumer reads them into a target-side
tensor on its device and releases the region. One iteration is that whole
exchange, timed in the consumer:
  host      rows device -> host -> arena, arena -> target tensor (host -> device)
  cuda_ipc  rows device -> IPC buffer, IPC buffer -> target tensor (device -> device);
            each buffer's handle is sent and opened once
With --device cpu (no GPU) the host arena half runs on CPU tensors, the CUDA
half says "no GPU", and the CUDA plane's code runs over its shared-CPU-memory
stand-in (cpu_ipc) so it is measured too. Prints a Markdown table (median
microseconds, MB/s of rows); --json prints the numbers. Not a test.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
import warnings

from hetero_sd.transport import connect, listen, pack_frame, unpack_frame
from hetero_sd.transport.planes import channel_options, reader_for, region_bytes, writer_for

CTX = mp.get_context("spawn")
GO, STOP = b"go", b"stop"


def producer(address: str, kind: str, device: str, k: int, vocab: int) -> None:
    """The drafter worker's side: answer each GO with the rows' ref (and announcements)."""
    import torch

    torch.set_num_threads(1)  # two processes' OpenMP copies on a small host spin against each other
    ch = connect(address)
    try:
        writer = writer_for(ch, kind, device, region_bytes(vocab, k, 4))
        rows = torch.rand(k, vocab, device=device)  # the drafter's probability rows, where it made them
        while ch.recv(timeout=60) == GO:
            ref, view = writer.claim(timeout=30).alloc((k, vocab), "float32")
            # the host arena takes host bytes: a GPU drafter's rows cross to the host first
            writer.write(view, rows if kind != "host" else rows.cpu().numpy())
            writer.flush()
            ch.send(pack_frame(writer.announcements(), [ref]), timeout=30)
        writer.close()
    finally:
        ch.close()


def measure(kind: str, device: str, k: int, vocab: int, iters: int) -> dict:
    import torch

    # the arena's view is read-only and only read here (torch warns of any such array)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    torch.set_num_threads(1)
    ch = listen("shm", **channel_options(kind, vocab, k))
    proc = CTX.Process(target=producer, args=(ch.address, kind, device, k, vocab), daemon=True)
    proc.start()
    ch.handed_over()
    reader = reader_for(ch, kind)
    target = torch.empty(k, vocab, device=device)  # the verifier's side of the rows
    times = []
    try:
        for i in range(iters + 5):  # the first 5: warm-up (handles opened, pages touched)
            t0 = time.perf_counter()
            ch.send(GO, timeout=30)
            announce, (ref,) = unpack_frame(ch.recv(timeout=60))
            reader.accept(announce)
            rows = reader.view(ref) if kind != "host" else torch.from_numpy(reader.read(ref))
            target.copy_(rows)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            reader.release(ref.region)
            if i >= 5:
                times.append(time.perf_counter() - t0)
        ch.send(STOP, timeout=30)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        ch.close()
    median = statistics.median(times)
    opens = getattr(reader, "opens", None)
    return {"plane": kind, "device": device, "median_us": median * 1e6,
            "mb_per_s": k * vocab * 4 / median / 1e6, "handle_opens": opens}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when torch sees it")
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = [measure("host", device, args.k, args.vocab, args.iters)]
    if device == "cuda":
        rows.append(measure("cuda_ipc", device, args.k, args.vocab, args.iters))
    else:
        rows.append({"plane": "cuda_ipc", "device": "-", "median_us": None, "mb_per_s": None,
                     "handle_opens": None, "note": "no GPU"})
        rows.append(measure("cpu_ipc", "cpu", args.k, args.vocab, args.iters) | {"note": "CUDA IPC's CPU stand-in"})
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{args.k} x {args.vocab} float32 rows ({args.k * args.vocab * 4 / 1e6:.2f} MB), "
              f"{args.iters} round trips, producer and consumer in two processes\n")
        print("| plane | device | median us | MB/s | handle opens | note |\n|---|---|---|---|---|---|")
        for r in rows:
            us = "-" if r["median_us"] is None else f"{r['median_us']:.0f}"
            mbs = "-" if r["mb_per_s"] is None else f"{r['mb_per_s']:.0f}"
            print(f"| {r['plane']} | {r['device']} | {us} | {mbs} | {r['handle_opens'] or '-'} | {r.get('note', '')} |")
    return rows


if __name__ == "__main__":
    main()
