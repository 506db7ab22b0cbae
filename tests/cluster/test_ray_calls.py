"""The records on the Ray path: a round re-sent after a reconnect does not
commit twice (it carries the committed length it starts at); a placement no
node offers fails at once, naming what the cluster has; `--explain` shows a
cross-node placement with its link costs."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hetero_sd.cluster import RayPlacement
from hetero_sd.cluster.ray_target import RayRunner
from hetero_sd.drafting.build import worker_entry
from hetero_sd.drafting.remote import RemoteDrafter
from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.errors import ConfigError
from hetero_sd.ir.work import FORWARD, LENGTH, DraftRequest, RunnerCall
from helpers.tiny_models import VOCAB_SIZE, random_prompt

BUDGET = 4 << 20
TARGET_NODE = RayPlacement(resources=(("target_node", 1.0),))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    return ModelSpec(str(tiny_model_dir("llama")), "torch", "cpu", "fp32", BUDGET, role="target")


def test_a_resent_verify_does_not_commit_twice(ray_cluster, spec):
    import ray

    runner = RayRunner(spec, TARGET_NODE)
    try:
        prompt, drafts = random_prompt(12, seed=5), random_prompt(4, seed=6)
        seq = runner.allocate(64)
        runner.forward(seq, prompt, 0, 1)
        verify = RunnerCall(FORWARD, seq, len(prompt), len(drafts), drafts).pack()
        first = ray.get(runner.actor.call.remote(verify))
        again = ray.get(runner.actor.call.remote(verify))  # the same round, sent again
        np.testing.assert_array_equal(first, again)
        assert ray.get(runner.actor.call.remote(RunnerCall(LENGTH, seq, 0, 0).pack())) == len(prompt) + len(drafts)
        runner.release(seq)
    finally:
        runner.close()


def test_a_resent_draft_request_gives_the_same_draft(ray_cluster, spec):
    drafter = RemoteDrafter(spec, VOCAB_SIZE, entry=worker_entry(), transport="ray",
                            ray=RayPlacement(resources=(("draft_node", 1.0),)), timeout_s=30, threads=1)
    try:
        drafter.begin(64)
        prompt = random_prompt(10, seed=8)
        first = drafter.draft(DraftRequest(0, 0, 4, prompt))
        again = drafter.draft(DraftRequest(0, 0, 4, prompt))  # re-sent: rolls back to base_len 0 first
        assert first.tokens == again.tokens and len(first.tokens) == 4
        step = drafter.draft(DraftRequest(0, len(prompt), 4, first.tokens[:2]))
        resent = drafter.draft(DraftRequest(0, len(prompt), 4, first.tokens[:2]))
        assert step.tokens == resent.tokens
    finally:
        drafter.close()


def test_a_placement_no_node_offers_names_what_is_there(ray_cluster, spec):
    with pytest.raises(ConfigError) as err:
        RayRunner(spec, RayPlacement(resources=(("gpu_box", 1.0),)))
    message = str(err.value)
    for word in ("target", "gpu_box", "draft_node", "target_node", "spare", "role=draft"):
        assert word in message, (word, message)


def test_explain_and_profile_show_the_cross_node_placement_and_its_link(ray_cluster, tiny_model_dir, tmp_path):
    config = tmp_path / "ray.yaml"
    config.write_text(f"""
target: {{model: {tiny_model_dir('llama')}, process: ray, ray: {{resources: {{target_node: 1}}}}}}
drafter: {{kind: model, k: 4, process: ray, threads: 1, ray: {{resources: {{draft_node: 1}}}}}}
generation: {{max_new_tokens: 12, chat_template: false}}
""")
    generate = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "generate", "--config", str(config),
                               "--prompt", "hello", "--explain"], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
    assert generate.returncode == 0, generate.stderr[-3000:]
    profile = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "profile", "--config", str(config)],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert profile.returncode == 0, profile.stderr[-3000:]
    for err in (generate.stderr, profile.stdout):
        _check_explained(err)


def _check_explained(err: str) -> None:
    for words in ("placement: manual, on the Ray cluster", "3 live nodes", "target: torch:cpu",
                  "ray[target_node=1]", "ray[draft_node=1]", "another node than the target",
                  "link engine <-> drafter: control record p50", "5 x vocab probability block p50",
                  "link engine <-> target", "tokens/s  target alone", "draft across the link, async, k=4",
                  "advice:"):
        assert words in err, (words, err[-3000:])


def test_the_server_batches_a_ray_target(ray_cluster, tiny_model_dir, tmp_path):
    """`hetero-sd serve` with the target in a Ray actor: concurrent requests (batched
    through the actor when they overlap), each equal to the target alone here."""
    import asyncio

    import httpx

    from hetero_sd.engine import Engine
    from helpers.serving import ServerProcess

    model = tiny_model_dir("llama")
    config = tmp_path / "serve.yaml"
    config.write_text(f"""
target: {{model: {model}, process: ray, ray: {{resources: {{target_node: 1}}}}}}
drafter: {{kind: ngram, min_ngram: 1, max_ngram: 3, k: 4}}
generation: {{chat_template: false}}
""")
    prompts = [random_prompt(8, seed=90 + i) * 2 for i in range(6)]

    async def complete(url):
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [{"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0} for p in prompts]
            return await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))

    server = ServerProcess(str(config), "--max-running", "8")
    try:
        replies = asyncio.run(complete(server.url))
    finally:
        server.stop()
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"target: {{model: {model}}}\ngeneration: {{chat_template: false}}\n")
    solo = Engine.from_config(plain, target_only=True)
    for prompt, reply in zip(prompts, replies):
        assert reply.status_code == 200, reply.text
        want = solo.generate_ids(prompt, 12, target_only=True)
        assert reply.json()["choices"][0]["text"] == want.text


def test_a_batched_call_through_the_actor_equals_each_sequence_alone(ray_cluster, spec):
    from hetero_sd.backends.base import BatchItem
    from hetero_sd.backends.torch_backend import TorchBackend
    from hetero_sd.ir import load_model_ir

    runner = RayRunner(spec, TARGET_NODE)
    local = TorchBackend().load(load_model_ir(spec.model), "cpu", "fp32", BUDGET)
    try:
        assert runner.max_batch > 1
        prompts = [random_prompt(n, seed=40 + n) for n in (5, 11, 20)]
        drafts = [random_prompt(k, seed=60 + k) for k in (1, 4, 6)]
        seqs, alone = [], []
        for prompt, draft in zip(prompts, drafts):
            seq, mine = runner.allocate(64), local.allocate(64)
            runner.forward(seq, prompt, 0, 1)
            local.forward(mine, prompt, 0, 1)
            seqs.append(seq)
            alone.append(local.forward(mine, draft, len(prompt), len(draft)))
        batched = runner.forward_batch([BatchItem(s, d, len(p), len(d)) for s, p, d in zip(seqs, prompts, drafts)])
        for got, want in zip(batched, alone):
            np.testing.assert_array_equal(got, want)  # bit for bit: the batch changes no row
    finally:
        runner.close()
