"""The config's scheduler section: a device's max_batch bounds the sequences of each batched
target call (outputs still equal solo runs), max_verify caps the drafts a round, and
timeout_ms ends a served request with finish_reason "timeout", keeping its text."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml

from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from hetero_sd.serve.batch import BatchEngine, Submission
from helpers.tiny_models import random_prompt
from serve.test_batch import _Collector

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(tmp_path, model, scheduler: dict, drafter: dict | None = None) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "target": {"model": str(model), "backend": "torch", "device": "cpu", "precision": "fp32"},
        "drafter": drafter or {"kind": "ngram", "k": 4, "min_ngram": 1, "max_ngram": 3},
        "generation": {"max_new_tokens": 12}, "memory": {"kv_budget": "8MiB"}, "scheduler": scheduler}))
    return str(path)


def test_a_device_max_batch_bounds_every_call(tmp_path, tiny_model_dir):
    engine = Engine.from_config(_config(tmp_path, tiny_model_dir("llama"), {"max_batch": {"cpu": 2}}))
    runner = engine.target_runner.current
    assert runner.max_batch == 2
    sizes, real = [], runner.forward_batch
    runner.forward_batch = lambda items: (sizes.append(len(items)), real(items))[1]
    prompts = [random_prompt(10, seed=60 + i) for i in range(5)]
    solo = [engine.generate_ids(p, 12, target_only=True).token_ids for p in prompts]
    batch = BatchEngine(engine, max_running=5, prefills_per_step=5).start()
    try:
        done = [_Collector() for _ in prompts]
        for p, c in zip(prompts, done):
            batch.submit(Submission(p, 12), c)
        assert all(c.done.wait(120) for c in done)
    finally:
        batch.shutdown()
    assert [c.result.token_ids for c in done] == solo
    assert sizes and max(sizes) == 2  # five running sequences, in calls of at most two


def test_max_verify_caps_the_drafts(tmp_path, tiny_model_dir):
    cfg = load_config(_config(tmp_path, tiny_model_dir("llama"), {"max_verify": {"cpu": 3, "cuda:0": 9}},
                              {"kind": "ngram", "k": 6, "k_max": 8}))
    assert (cfg.drafter.k, cfg.drafter.k_max) == (2, 2)
    other = load_config(_config(tmp_path, tiny_model_dir("llama"), {"max_verify": {"cuda:0": 3}},
                                {"kind": "ngram", "k": 6}))
    assert other.drafter.k == 6  # another device's bound


def test_timeout_ms_ends_a_served_request_with_its_text(tmp_path, tiny_model_dir):
    from hetero_sd.cli import build_parser
    from hetero_sd.serve.app import ServerState, create_app
    from hetero_sd.serve.cli import _limits

    path = _config(tmp_path, tiny_model_dir("llama"), {"timeout_ms": 400, "max_running": 3})
    cfg = load_config(path)
    limits = _limits(build_parser().parse_args(["serve", "--config", path]), cfg.scheduler)
    assert limits.request_timeout_s == 0.4
    st = ServerState(Engine.from_config(cfg), "tiny", max_running=cfg.scheduler.max_running, limits=limits)
    real = st.batch.target.forward_batch
    st.batch.target.forward_batch = lambda items: (time.sleep(0.03), real(items))[1]
    st.start()

    async def go():
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            return await client.post("/v1/completions", json={"prompt": "once upon a time", "max_tokens": 200})

    try:
        r = asyncio.run(go())
    finally:
        st.close()
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "timeout" and choice["text"]
    assert 0 < r.json()["usage"]["completion_tokens"] < 200
