"""What only a GPU can show: CUDA graphs replay the eager call bit for bit, a call on
another stream rounds alike, and weights and the KV pool live in device memory. Skipped
where no GPU is (the interpreter has no graphs or streams); the kernels and the runner
these wrap are covered here by test_kernels.py and test_runner.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero_sd.backends.cuda.backend import CudaBackend
from hetero_sd.backends.cuda.runner import CudaRunner, Tiles
from hetero_sd.ir import load_model_ir
from helpers.tiny_models import random_prompt

from .conftest import GPU

pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (TRITON_INTERPRET unset)")


def _runner(path, graphs: bool, precision: str = "bf16"):
    backend = CudaBackend()
    ir = load_model_ir(path)
    info = next(d for d in backend.probe() if d.device == "cuda:0")
    prec = info.precision(precision)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    return CudaRunner(ir, info, prec, dtype, 8 << 20, tiles=Tiles(attn_split=32, graphs=graphs))


@pytest.mark.parametrize("variant", ["llama", "gemma3"])
def test_graph_replay_equals_eager(tiny_model_dir, variant):
    """Every width 1..17, at contexts crossing KV-split boundaries (split 32)."""
    path = tiny_model_dir(variant)
    graphed, eager = _runner(path, True), _runner(path, False)
    assert graphed._graphs is not None and eager._graphs is None
    for context in (5, 31, 70):
        prompt = random_prompt(context, seed=context)
        seqs = [r.allocate(context + 20) for r in (graphed, eager)]
        for r, s in zip((graphed, eager), seqs):
            r.forward(s, prompt, 0, 1)
        for width in range(1, 18):
            cont = random_prompt(width, seed=width)
            outs = []
            for r, s in zip((graphed, eager), seqs):
                r.truncate(s, context)
                outs.append((r.forward(s, cont, context, width), r.greedy(s, cont, context, width)))
            assert np.array_equal(outs[0][0], outs[1][0]), f"{variant} width {width} context {context}"
            assert outs[0][1] == outs[1][1]
    assert len(graphed._graphs._graphs) >= 17


def test_side_stream_rounds_alike(tiny_model_dir):
    runner = _runner(tiny_model_dir("llama"), False)
    prompt = random_prompt(20, seed=2)
    a = runner.forward(runner.allocate(32), prompt, 0, len(prompt))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        b = runner.forward(runner.allocate(32), prompt, 0, len(prompt))
    stream.synchronize()
    assert np.array_equal(a, b)


def test_weights_and_pool_in_device_memory(tiny_model_dir):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    runner = _runner(tiny_model_dir("llama"), True, "fp32")
    k, v = runner.kv_buffers()
    assert k.is_cuda and v.is_cuda
    pool = runner.usage().bytes_total
    assert pool == k.numel() * k.element_size() * 2
    grown = torch.cuda.memory_allocated() - before
    assert grown >= pool + runner.weight_bytes


def test_submit_returns_before_the_gpu_is_done_and_equals_greedy(tiny_model_dir):
    """The asynchronous call (Runner.submit) the overlap of drafting and verifying uses:
    its ids equal greedy's, bit for bit, at every width."""
    runner = _runner(tiny_model_dir("llama"), True)
    assert runner.asynchronous
    prompt = random_prompt(20, seed=4)
    a, b = runner.allocate(64), runner.allocate(64)
    for s in (a, b):
        runner.forward(s, prompt, 0, 1)
    for width in range(1, 10):
        cont = random_prompt(width, seed=width)
        sync = runner.greedy(a, cont, 20, width)
        pending = runner.submit(b, cont, 20, width)
        assert pending.wait() == sync
        logits = runner.submit(b, cont, 20, width, greedy=False).wait()
        assert np.array_equal(logits, runner.forward(a, cont, 20, width))
