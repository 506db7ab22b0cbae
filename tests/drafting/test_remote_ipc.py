"""A RemoteDrafter whose draft rows travel through a device data plane
(transport/planes.py): over SharedCpuBuffers here (the CUDA IPC plane's code with
CPU tensors in shared memory standing in for device buffers), over CUDA IPC where
a GPU is at hand. The rows equal the host arena's, each buffer's handle is opened
once, and a worker that dies after sending rows in a buffer the engine had not
opened yet is dropped with IpcOwnerGone, the request finishing without it."""
from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.drafting.build import worker_entry
from hetero_sd.drafting.remote import RemoteDrafter
from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import SamplingParams
from hetero_sd.transport import planes
from hetero_sd.transport.segment import cleanup_stale, pid_alive
from helpers.drafters import ProxyDrafter
from helpers.tiny_models import random_prompt

sys.path.insert(0, str(Path(__file__).parent))
import ipc_peers  # noqa: E402

BUDGET = 4 << 20
PARAMS = SamplingParams(0.9, top_k=40, top_p=0.95, seed=11)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def paths(tiny_model_dir):
    return {"target": tiny_model_dir("llama"), "other": tiny_model_dir("llama", seed=1)}


@pytest.fixture(scope="module")
def target(paths):
    return TorchBackend().load(load_model_ir(paths["target"]), "cpu", "fp32", BUDGET)


@pytest.fixture
def remote(target):
    made = []

    def make(spec, entry=None, **kw) -> RemoteDrafter:
        drafter = RemoteDrafter(spec, target.vocab_size, entry=entry or worker_entry(), transport="shm",
                                threads=1, timeout_s=30.0, start_method="spawn", **kw)
        made.append(drafter)
        return drafter

    yield make
    for drafter in made:
        drafter.close()
    cleanup_stale()  # a killed worker's stand-in segments (a dead GPU worker's memory goes with it)


class _Rows(ProxyDrafter):
    """Keeps a copy of every proposal's rows."""

    def __init__(self, inner):
        super().__init__(inner)
        self.rows = []

    def seen(self, req, result):
        self.rows.append((list(result.tokens), None if result.probs is None else np.array(result.probs)))
        return result


def _run(target, drafter, prompt, new=24):
    rec = _Rows(drafter)
    return Engine(target, rec, k=4).generate_ids(prompt, new, sampling=PARAMS), rec.rows


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("plane", ["cpu_ipc", pytest.param("cuda_ipc", marks=pytest.mark.skipif(
    not _cuda(), reason="needs CUDA"))])
def test_rows_through_a_device_plane_equal_the_arenas(target, paths, remote, plane):
    device = "cuda" if plane == "cuda_ipc" else "cpu"
    spec = ModelSpec(str(paths["other"]), "torch", device, "fp32", BUDGET)
    prompt = random_prompt(12, seed=3)
    host = remote(spec, data_plane="host")
    want, want_rows = _run(target, host, prompt)
    assert isinstance(host._w.plane, planes.HostReader)
    drafter = remote(spec, data_plane=plane)
    got, rows = _run(target, drafter, prompt)
    assert got.token_ids == want.token_ids and got.stats.events == []
    assert len(rows) == len(want_rows) > 3
    for (tokens, probs), (w_tokens, w_probs) in zip(rows, want_rows):
        assert tokens == w_tokens
        np.testing.assert_array_equal(probs, w_probs)
    reader = drafter._w.plane
    assert isinstance(reader, planes.DeviceReader) and reader.opens == 2  # two buffers, each opened once


def test_auto_keeps_the_host_arena_without_a_gpu(target, paths, remote):
    if _cuda():
        pytest.skip("this host has CUDA: auto picks cuda_ipc for a CUDA drafter")
    spec = ModelSpec(str(paths["other"]), "torch", "cuda", "fp32", BUDGET)
    drafter = RemoteDrafter(spec, target.vocab_size, entry=worker_entry(), start=False)
    assert drafter.options.data_plane == "host"
    cpu = RemoteDrafter(ModelSpec(str(paths["other"]), "torch", "cpu", "fp32", BUDGET), target.vocab_size,
                        entry=worker_entry(), start=False, data_plane="auto")
    assert (cpu.options.data_plane, cpu.options.plane_device) == ("host", "cpu")


def test_a_dead_owners_buffer_drops_the_drafter_and_keeps_the_output(target, paths, remote, monkeypatch):
    spec = ModelSpec(str(paths["other"]), "torch", "cpu", "fp32", BUDGET)
    drafter = remote(spec, entry=partial(ipc_peers.dying_main), data_plane="cpu_ipc")
    accept = planes.DeviceReader.accept

    def accept_once_dead(reader, blob):  # open the handle only once its owner is gone
        deadline = time.monotonic() + 30
        while pid_alive(drafter._w.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        return accept(reader, blob)

    monkeypatch.setattr(planes.DeviceReader, "accept", accept_once_dead)
    prompt = random_prompt(12, seed=4)
    got, rows = _run(target, drafter, prompt, new=20)
    failures = [e for e in got.stats.events if "failed" in e]
    assert len(failures) == 1 and "IpcOwnerGone" in failures[0] and "process" in failures[0], got.stats.events
    assert len(got.token_ids) == 20  # the request went on without the drafter, target-only
    assert rows == [] and drafter.stats.failures == 1 and drafter.pid is None


def test_the_yaml_key_reaches_the_worker(tmp_path):
    """drafter.data_plane is a worker key: it reaches the WorkerSpec, and without
    process: worker it is refused, naming itself."""
    from hetero_sd.config import load_config
    from hetero_sd.errors import ConfigError
    from hetero_sd.spec import spec_from_config

    path = tmp_path / "c.yaml"
    path.write_text("drafter: {kind: ngram, process: worker, data_plane: host}\n")
    assert spec_from_config(load_config(path)).drafter.data_plane == "host"
    path.write_text("drafter: {kind: ngram, data_plane: cuda_ipc}\n")
    with pytest.raises(ConfigError, match="data_plane"):
        load_config(path)
