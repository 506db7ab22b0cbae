"""CUDA graphs of one sequence's decode and verify calls.

A decode step is a few hundred kernel launches; replaying them as one graph
takes the launch overhead out. One graph is captured per (rows, KV splits
rounded up to a power of two), with static input buffers the call's
positions are copied into, and replayed from then on. Replays run the very
kernels and grids the eager call runs (only the count of empty KV splits
differs, and a row merges only its own splits), so a replayed row equals the
eager one bit for bit: the CUDA tests check it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from hetero_sd.backends.cuda.forward import CudaForward, Rows
from hetero_sd.backends.cuda.ops import Kernels


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    rows: Rows  # the static inputs
    logits: torch.Tensor
    ids: torch.Tensor


class GraphCache:
    def __init__(self, forward: CudaForward, ops: Kernels, max_rows: int):
        self._forward, self._ops, self.max_rows = forward, ops, max_rows
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None  # one memory pool shared by every graph: they never run at once

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def run(self, rows: Rows, greedy: bool) -> torch.Tensor:
        """The call's logits (or argmax ids) from its graph, captured on first use."""
        splits = triton.next_power_of_2(rows.splits)
        key = (rows.ids.shape[0], splits)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(rows, splits)
        for static, now in ((g.rows.ids, rows.ids), (g.rows.pos, rows.pos), (g.rows.base, rows.base),
                            (g.rows.slots, rows.slots)):
            static.copy_(now)
        g.graph.replay()
        return (g.ids if greedy else g.logits).clone()

    def _capture(self, rows: Rows, splits: int) -> _Graph:
        n = rows.ids.shape[0]
        static = Rows(rows.ids.clone(), rows.pos.clone(), rows.base.clone(), rows.slots.clone(),
                      torch.arange(n, device=rows.ids.device), splits, (n,))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture (writes the same KV)
            self._ops.argmax(self._forward(static))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(static)
            ids = self._ops.argmax(logits)
        return _Graph(graph, static, logits, ids)
