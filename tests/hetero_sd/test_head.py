"""Issue 14: the EAGLE-3 head drafter.

- the loader reads a head written by hand in EAGLE-3's published layout (bf16,
  `midlayer.*`, d2t/t2d, its own embed_tokens) and computes what an
  independent re-implementation of vLLM's layer computes;
- `hetero-sd train-head`'s pipeline, run for seconds on the tiny model, makes
  a head whose acceptance is well above an untrained one's (the loop learns);
- greedy output with the head is token-identical to target-only on every
  backend, for k = 1..8, several prompts and lengths;
- bad configuration fails clearly.
(Sampling with the head: test_head_sampling.py.)
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hetero_sd.backends.registry import discover
from hetero_sd.backends.torch_head import TorchHeadRunner
from hetero_sd.config import load_config
from hetero_sd.ir.eagle import EagleHead, HeadConfig
from hetero_sd.drafting.head import HeadDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import ConfigError
from hetero_sd.ir import load_model_ir
from hetero_sd.training.head import init_head, train_head
from hetero_sd.training import data as D
from hetero_sd.training.options import TrainOptions
from helpers.tiny_models import random_prompt

REGISTRY = discover()
STEPS = 300
PROMPTS = 64  # self-distilled responses: what the head drafts at serving time
# Prompts like the training ones (the same templates) but not among the PROMPTS it trained on
UNSEEN = D.instruction_prompts()[PROMPTS:PROMPTS + 8]


def _yaml(tmp: Path, model: Path, drafter: str, backend: str = "torch") -> Path:
    path = tmp / "cfg.yaml"
    path.write_text(f"target: {{model: {model}, backend: {backend}, precision: fp32}}\n"
                    f"drafter: {drafter}\ngeneration: {{max_new_tokens: 32, chat_template: true}}\n")
    return path


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A head trained for a few seconds on the tiny model by the train-head pipeline, and its report."""
    model = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("head")
    cfg = load_config(_yaml(out, model, "{kind: ngram}"))
    # Most of the head's training rows are the target's own greedy responses (as at serving time),
    # not teacher-forced text it never drafts: with 16 responses and lr 2e-3 the head learned
    # too little (0.06-0.08 at k 4, depending on the host's float rounding and the seed), and
    # a test at that edge failed on some hosts; this learns well over twice as much in the same steps.
    opts = TrainOptions(prompts=PROMPTS, max_new_tokens=48, source_chunks=8, text_chars=1200, seq_len=64,
                        window=64, batch=2, gen_batch=16, draft_vocab=160, dtype="fp32", tune_steps=30,
                        steps=STEPS, lr=1e-2)  # counted steps: the same head on a loaded host
    report = train_head(cfg, out, opts)
    return model, out, report, cfg, opts


def _untrained(model: Path, trained_dir: Path, tmp: Path) -> Path:
    """The same initial head train-head starts from (same vocabulary and seed), saved untrained."""
    ir = load_model_ir(model)
    cfg = HeadConfig.read(trained_dir)
    ids = EagleHead.load(trained_dir, ir.weights.get("model.embed_tokens.weight")).target_ids.numpy()
    head = init_head(cfg, ir, ids, seed=0)
    head.save(tmp / "untrained")
    return tmp / "untrained"


def _acceptance(engine: Engine, prompts) -> float:
    drafted = accepted = 0
    for p in prompts:
        stats = engine.generate_ids(engine.encode(p), 32).stats
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return accepted / drafted


def test_training_learns(trained, tmp_path):
    model, out, report, cfg, opts = trained
    assert report["steps"] == STEPS and (out / "model.safetensors").exists() and (out / "checkpoint.pt").exists()
    # stage 2 ran the configured target over the responses and trained on its states
    assert report["tune_steps"] == 30 and report["tune_tokens"] == report["tokens_by_source"]["response"]
    assert set(report["tokens_by_source"]) == {"response", "reference", "readmes", "docstrings", "code", "source"}
    # resuming a finished run trains nothing more: the same head comes out
    before = (out / "model.safetensors").read_bytes()
    again = train_head(cfg, out, opts, resume=True)
    assert (again["steps"], again["tune_steps"]) == (STEPS, 30)
    assert (out / "model.safetensors").read_bytes() == before
    rates = {}
    for name, head in (("trained", out), ("untrained", _untrained(model, out, tmp_path))):
        engine = Engine.from_config(_yaml(tmp_path, model, f"{{kind: head, head: {head}, k: 4}}"))
        rates[name] = _acceptance(engine, UNSEEN)
    # the loop learns: the trained head's drafts are accepted far more often than its starting point's
    # (0.21 against 0.001 on an AMD AVX-512 host, the same with ATen's AVX2 and scalar kernels;
    # the first draft of a round about half the time: a one-layer head emulating a random
    # two-layer model learns slowly; 0.06-0.08 before the responses were most of its data)
    assert rates["trained"] > 2 * rates["untrained"] + 0.06, rates


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "openvino"])
def test_greedy_is_lossless_on_every_backend(trained, tmp_path, backend):
    model, out = trained[:2]
    engine = Engine.from_config(_yaml(tmp_path, model, f"{{kind: head, head: {out}, k: 1}}", backend))
    drafted = accepted = 0
    for k in range(1, 9):
        for seed, (length, new) in enumerate([(3, 20), (40, 33), (17, 12)]):
            prompt = engine.encode(UNSEEN[(k + seed) % len(UNSEEN)])[:length] if seed != 2 else \
                random_prompt(length, seed=100 * k + seed)
            base = engine.generate_ids(prompt, new, target_only=True)
            spec = _with_k(engine, k).generate_ids(prompt, new)
            assert spec.token_ids == base.token_ids, f"{backend} k={k} prompt {seed}: diverged"
            assert spec.stats.lossless == "exact"
            drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
    assert 0 < accepted < drafted  # both outcomes of verification happened


def _with_k(engine: Engine, k: int) -> Engine:
    from hetero_sd.scheduler import FixedDraftLength

    engine.policy = FixedDraftLength(k)
    return engine


def _reference_layer(w: dict, emb: torch.Tensor, hidden: torch.Tensor, cfg: dict) -> torch.Tensor:
    """vLLM's EAGLE-3 layer for a causal sequence, from the published tensors (independent of eagle.py)."""
    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * w[name]

    n, nh, nkv, hd = hidden.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    x = torch.cat([rms(emb, "midlayer.input_layernorm.weight"), rms(hidden, "midlayer.hidden_norm.weight")], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, nh, hd)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, nkv, hd)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, nkv, hd)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(n).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * hd)
    residual = hidden + attn @ w["midlayer.self_attn.o_proj.weight"].T
    h = rms(residual, "midlayer.post_attention_layernorm.weight")
    mlp = (torch.nn.functional.silu(h @ w["midlayer.mlp.gate_proj.weight"].T) * (h @ w["midlayer.mlp.up_proj.weight"].T))
    return residual + mlp @ w["midlayer.mlp.down_proj.weight"].T


def test_loader_reads_the_published_layout(tmp_path):
    H, T, V, N, I = 16, 12, 40, 10, 24
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": V,
           "draft_vocab_size": N, "target_hidden_size": T, "max_position_embeddings": 2048, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: (torch.randn(*shape, generator=g) * 0.3).to(torch.bfloat16)  # noqa: E731
    target_ids = torch.tensor(sorted(np.random.default_rng(0).choice(V, N, replace=False)))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    w = {"fc.weight": r(H, 3 * T), "embed_tokens.weight": r(V, H), "norm.weight": 1 + r(H), "lm_head.weight": r(N, H),
         "d2t": target_ids - torch.arange(N), "t2d": t2d,
         "midlayer.hidden_norm.weight": 1 + r(H), "midlayer.input_layernorm.weight": 1 + r(H),
         "midlayer.post_attention_layernorm.weight": 1 + r(H),
         "midlayer.self_attn.q_proj.weight": r(16, 2 * H), "midlayer.self_attn.k_proj.weight": r(8, 2 * H),
         "midlayer.self_attn.v_proj.weight": r(8, 2 * H), "midlayer.self_attn.o_proj.weight": r(H, 16),
         "midlayer.mlp.gate_proj.weight": r(I, H), "midlayer.mlp.up_proj.weight": r(I, H),
         "midlayer.mlp.down_proj.weight": r(H, I)}
    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    head = EagleHead.load(tmp_path, embed=None)  # its own embed_tokens
    assert head.cfg.feature_layers == (0, 2, 4) and head.cfg.draft_vocab == N
    assert torch.equal(head.target_ids, target_ids)
    wf = {k: v.float() for k, v in w.items()}
    feats, tokens = torch.randn(7, 3 * T, generator=g), torch.randint(0, V, (7,), generator=g)
    hidden = feats @ wf["fc.weight"].T
    want = _reference_layer(wf, wf["embed_tokens.weight"][tokens], hidden, cfg)
    with torch.no_grad():
        fused = head.fuse(feats[None])
        q, k, v = head.qkv(fused, tokens[None], torch.arange(7))
        mask = torch.ones(7, 7, dtype=torch.bool).tril()
        got = head.finish(fused, q, k, v, mask)[0]
        logits = head.logits(got[None])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    norm = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-5) * wf["norm.weight"]
    torch.testing.assert_close(logits, norm @ wf["lm_head.weight"].T, rtol=1e-4, atol=1e-4)
    # and it saves back to the same layout
    head.save(tmp_path / "again")
    again = EagleHead.load(tmp_path / "again", embed=wf["embed_tokens.weight"])
    assert torch.equal(again.target_ids, target_ids)


def test_bad_heads_fail_clearly(tiny_model_dir, tmp_path, trained):
    model = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="drafter.head.*not a head folder"):
        Engine.from_config(_yaml(tmp_path, model, f"{{kind: head, head: {tmp_path / 'nope'}}}"))
    with pytest.raises(ConfigError, match="train-head"):  # head: auto, none trained for this model yet
        Engine.from_config(_yaml(tmp_path, tiny_model_dir("llama", seed=3), "{kind: head}"))
    with pytest.raises(ConfigError, match="workers and cascades"):
        load_config(_yaml(tmp_path, model, f"{{kind: head, head: {trained[1]}, process: worker}}"))
    other = tiny_model_dir("qwen2")  # another vocabulary
    with pytest.raises(ConfigError, match="vocabulary"):
        HeadDrafter(TorchHeadRunner(EagleHead.load(trained[1], load_model_ir(model).weights.get(
            "model.embed_tokens.weight"))), load_model_ir(other).config.vocab_size + 1)


def test_hybrid_is_lossless_and_uses_both_drafters(trained, tmp_path):
    model, out = trained[:2]
    engine = Engine.from_config(_yaml(tmp_path, model, f"{{kind: hybrid, head: {out}, hybrid_min_match: 3, k: 1}}"))
    hybrid = engine.drafter
    drafted = accepted = 0
    for k in range(1, 9):
        for seed in range(3):
            stem = random_prompt(6 + seed, seed=300 + 10 * k + seed)
            prompt = stem * 3 if seed else stem  # repeated text for the suffix trees, and fresh text
            base = engine.generate_ids(prompt, 24, target_only=True)
            spec = _with_k(engine, k).generate_ids(prompt, 24)
            assert spec.token_ids == base.token_ids, f"hybrid k={k} prompt {seed}: diverged"
            drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
    assert hybrid.picks["suffix"] > 0 and hybrid.picks["head"] > 0, hybrid.picks
    assert 0 < accepted < drafted


def test_a_head_reports_its_catch_up_only_after_text_it_did_not_draft(trained, tmp_path):
    """The first draft runs the prompt's features with it (Round.catch_up_s > 0); a
    round after the head's own drafts runs at most those and the bonus (none reported)."""
    model, out = trained[:2]
    engine = _with_k(Engine.from_config(_yaml(tmp_path, model, f"{{kind: head, head: {out}, k: 2}}")), 2)
    head, results = engine.drafter, []
    draft = head.draft

    def spy(req, rnd=None):
        got = draft(req, rnd)
        results.append(rnd)
        return got

    head.draft = spy
    base = engine.generate_ids(engine.encode(UNSEEN[0]), 24, target_only=True)
    assert engine.generate_ids(engine.encode(UNSEEN[0]), 24).token_ids == base.token_ids
    assert results[0].catch_up_s > 0 and len(results) > 3, results
    assert all(r.catch_up_s == 0.0 for r in results[1:]), [r.catch_up_s for r in results]


def test_int8_head_loads_close_to_its_fp32_form_and_stays_lossless(trained, tmp_path):
    """The shipped form: int8 rows with a scale each, a quarter of the bytes, the same drafts
    within rounding, and greedy output unchanged."""
    from safetensors import safe_open

    model, out = trained[:2]
    embed = load_model_ir(model).weights.get("model.embed_tokens.weight")
    fp32 = EagleHead.load(out, embed)
    fp32.save(tmp_path / "int8", int8=True)
    with safe_open(str(tmp_path / "int8" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("midlayer.mlp.down_proj.weight").dtype == torch.int8
        assert f.get_tensor("midlayer.mlp.down_proj.weight.scale").dtype == torch.float32
    small = EagleHead.load(tmp_path / "int8", embed)
    for name, w in fp32.published().items():
        got = small.published()[name]
        tol = w.abs().amax(-1, keepdim=True) / 127 if w.ndim == 2 else 0  # half a step per row, and slack
        assert torch.all((got - w).abs() <= tol + 1e-7), name
    assert (tmp_path / "int8" / "model.safetensors").stat().st_size < 0.4 * (out / "model.safetensors").stat().st_size
    engine = Engine.from_config(_yaml(tmp_path, model, f"{{kind: head, head: {tmp_path / 'int8'}, k: 4}}"))
    for seed, prompt in enumerate(UNSEEN[:3]):
        ids = engine.encode(prompt)
        assert engine.generate_ids(ids, 24).token_ids == engine.generate_ids(ids, 24, target_only=True).token_ids


def test_int8_head_without_scales_fails_clearly(trained, tmp_path):
    from safetensors.torch import load_file

    model, out = trained[:2]
    EagleHead.load(out, load_model_ir(model).weights.get("model.embed_tokens.weight")).save(
        tmp_path / "h", int8=True)
    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    del state["fc.weight.scale"]
    save_file(state, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(Exception, match="fc.weight is int8 without a scale"):
        EagleHead.load(tmp_path / "h", load_model_ir(model).weights.get("model.embed_tokens.weight"))


def test_store_resumes_after_a_partial_write(tmp_path):
    """A pass stopped between a sequence's rows and its index keeps every sequence it recorded."""
    from hetero_sd.training.store import ExampleStore

    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, 99, n), rng.standard_normal((n, 6)), rng.standard_normal((n, 2))) for n in (5, 3, 7)]
    store = ExampleStore(tmp_path, 6, 2)
    for s in seqs[:2]:
        store.append(*s)
    with open(tmp_path / "features.f16", "ab") as f:  # a third sequence half written, never indexed
        f.write(np.zeros((4, 6), np.float16).tobytes())
    again = ExampleStore(tmp_path, 6, 2)
    assert len(again) == 2 and again.rows == 8
    again.append(*seqs[2])
    for i, (tokens, feats, final) in enumerate(seqs):
        t, f, h = again.window(i, 0, len(tokens))
        assert (t == tokens).all() and np.allclose(f, feats, atol=2e-3) and np.allclose(h, final, atol=2e-3)
    t, f, _ = again.window(2, 3, 4)
    assert (t == seqs[2][0][3:]).all()
    with pytest.raises(IndexError):
        again.window(1, 1, 3)


def test_packaged_head_drafts_the_embedded_model(smollm2_gguf, tmp_path):
    """head: auto finds the head shipped for the embedded SmolLM2 when none was trained here; on
    the serving target (onnxruntime int4, the head on onnxruntime) its drafts are accepted on
    open prompts it never saw (about a third at the first position, 0.17 of all at k 3, where an
    untrained head gets none), and the output is the target's."""
    from hetero_sd.assets import default_head, packaged_head

    assert not (default_head(str(smollm2_gguf)) / "config.json").exists()  # (the session's empty cache)
    assert (packaged_head(str(smollm2_gguf)) / "model.safetensors").stat().st_size < 16 << 20
    path = tmp_path / "cfg.yaml"
    path.write_text(f"target: {{model: {smollm2_gguf}, backend: onnxruntime, precision: int4}}\n"
                    "drafter: {kind: head, head: auto, backend: onnxruntime, k: 3}\n"
                    "generation: {max_new_tokens: 32, chat_template: true}\n")
    engine = Engine.from_config(path)
    drafted = accepted = 0
    for prompt in ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
                   "Explain how a refrigerator keeps food cold, in simple terms."):
        ids = engine.encode(prompt)
        spec = engine.generate_ids(ids, 32)
        assert spec.token_ids == engine.generate_ids(ids, 32, target_only=True).token_ids
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
    assert accepted > 0.1 * drafted, (accepted, drafted)


def _small_run(tiny_model_dir, folder: Path):
    """A head, example store and LM rows small enough to train a few steps in a second."""
    from hetero_sd.training.head import lm_rows
    from hetero_sd.training.store import ExampleStore

    ir = load_model_ir(tiny_model_dir("llama"))
    cfg = HeadConfig.for_target(ir.config, 32)
    ids = np.arange(cfg.draft_vocab)
    H = ir.config.hidden_size
    store = ExampleStore(folder / "store", len(cfg.feature_layers) * H, H)
    rng = np.random.default_rng(0)
    for _ in range(6):
        store.append(rng.integers(0, cfg.draft_vocab, 12), rng.standard_normal((12, store.F)),
                     rng.standard_normal((12, H)))
    return (lambda: init_head(cfg, ir, ids, seed=0)), store, lm_rows(ir, ids)


def test_checkpoints_are_plain_data_and_resume(tiny_model_dir, tmp_path):
    """A checkpoint reads back through torch's weights-only unpickler (head, optimizer, step, seed,
    finished), and a run resumes from it: an unfinished one to its step budget, a finished one not at all."""
    from hetero_sd.training.head import load_checkpoint, save_checkpoint, train

    new_head, store, lm = _small_run(tiny_model_dir, tmp_path)
    ckpt = tmp_path / "checkpoint.pt"
    opts = TrainOptions(window=8, batch=2, ttt_steps=2, steps=4, save_every=2, lr=1e-3)
    assert train(new_head(), store, lm, opts, ckpt, resume=False)["steps"] == 4
    state = torch.load(ckpt, weights_only=True)
    assert (state["step"], state["seed"], state["finished"]) == (4, 0, True) and state["opt"]["state"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    # a run stopped at step 4 of 6 goes on from there
    save_checkpoint(ckpt, {**load_checkpoint(ckpt), "finished": False})
    opts6 = replace(opts, steps=6)
    assert train(new_head(), store, lm, opts6, ckpt, resume=True)["steps"] == 6
    assert load_checkpoint(ckpt)["step"] == 6
    # a finished run is not trained again: the head comes back as the checkpoint holds it
    head = new_head()
    assert train(head, store, lm, replace(opts6, steps=9), ckpt, resume=True)["steps"] == 6
    saved = load_checkpoint(ckpt)["head"]
    assert all(torch.equal(v, saved[k]) for k, v in head.state_dict().items())


class _RunsCode:
    """Unpickles by calling exec: what a crafted checkpoint would do with the full unpickler."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_a_checkpoint_that_would_run_code_is_refused(tiny_model_dir, tmp_path):
    from hetero_sd.training.head import train

    new_head, store, lm = _small_run(tiny_model_dir, tmp_path)
    marker, ckpt = tmp_path / "ran", tmp_path / "checkpoint.pt"
    torch.save({"head": _RunsCode(marker), "opt": {}, "step": 0, "seed": 0}, ckpt)
    opts = TrainOptions(window=8, batch=2, ttt_steps=2, steps=2, save_every=2)
    with pytest.raises(ConfigError, match="checkpoint.pt: refused"):
        train(new_head(), store, lm, opts, ckpt, resume=True)
    assert not marker.exists()


def test_a_checkpoint_write_that_fails_midway_keeps_the_last_one(tiny_model_dir, tmp_path, monkeypatch):
    """A crash while the checkpoint is written (here: torch.save raising after half its bytes) leaves
    the previous checkpoint whole, and no partial file beside it."""
    from hetero_sd.training.head import load_checkpoint, train

    new_head, store, lm = _small_run(tiny_model_dir, tmp_path)
    ckpt = tmp_path / "checkpoint.pt"
    opts = TrainOptions(window=8, batch=2, ttt_steps=2, steps=2, save_every=2)
    train(new_head(), store, lm, opts, ckpt, resume=False)
    before = ckpt.read_bytes()
    real_save = torch.save

    def crash(obj, f, *args, **kwargs):
        import io
        buf = io.BytesIO()
        real_save(obj, buf)
        data = buf.getvalue()[:len(buf.getvalue()) // 2]
        if isinstance(f, (str, Path)):
            Path(f).write_bytes(data)
        else:
            f.write(data)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        train(new_head(), store, lm, replace(opts, steps=4), ckpt, resume=False)
    assert ckpt.read_bytes() == before and load_checkpoint(ckpt)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "store"]
