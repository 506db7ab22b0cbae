"""OrtHeadRunner (backends/onnx_head.py): the EAGLE-3 head lowered to ONNX, on onnxruntime.

- fp32 computes what TorchHeadRunner computes: over one sequence of calls (a
  multi-row features call at 0, one-row draft steps fed their own outputs, a
  multi-row call after a rollback to an earlier start, calls attending from
  first > 0) every call's logits agree within 1e-4 with the same argmax;
- int8 and int4 logits are finite and their argmax agrees with fp32 on most rows;
- fork() gives an independent cache over the same sessions;
- a bad precision or a call past the cache fails clearly;
- a bad drafter.backend / precision for a head is a ConfigError naming the choices;
- greedy output with the head on onnxruntime int8 (drafter.backend: onnxruntime)
  is token-identical to target-only, k = 1..8.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetero_sd.backends.onnx_head import OrtHeadRunner
from hetero_sd.backends.torch_head import TorchHeadRunner
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.eagle import EagleHead, HeadConfig
from hetero_sd.ir.work import MAX_DRAFT_TOKENS

VOCAB, DRAFT = 300, 120


def _head(seed: int = 0, heads: int = 8, kv_heads: int = 2) -> EagleHead:
    """A random head for a small target (GQA, non-trivial norms, a scattered draft vocabulary)."""
    target = ModelConfig("llama", VOCAB, 64, 96, 6, heads, kv_heads, 16, 1e-5, 10000.0, 512, False)
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(target, DRAFT), torch.randn(VOCAB, 64, generator=g) * 0.5).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 1 else 1.0 / p.shape[1] ** 0.5)
                    + (1.0 if p.dim() == 1 else 0.0))
    head.set_vocab(torch.as_tensor(np.sort(np.random.default_rng(seed).choice(VOCAB, DRAFT, replace=False))))
    return head


def _calls(head: EagleHead, seed: int = 1):
    """(tokens, start, first, features or None): None = feed the runner's own last output."""
    rng = np.random.default_rng(seed)
    width = len(head.cfg.aux_layers) * head.cfg.target_hidden
    feats = lambda n: rng.standard_normal((n, width), dtype=np.float32)  # noqa: E731
    tok = lambda n: [int(t) for t in rng.integers(0, VOCAB, n)]  # noqa: E731
    yield tok(6), 0, 0, feats(6)  # the prompt's pairs
    for i in range(5):  # a draft: rows 6..10
        yield tok(1), 6 + i, 0, None
    yield tok(3), 4, 0, feats(3)  # rolled back to 4: rows 4..6 rewritten
    for i in range(3):
        yield tok(1), 7 + i, 0, None
    yield tok(4), 7, 3, feats(4)  # a gap: attend from 3 on
    for i in range(4):
        yield tok(1), 11 + i, 3, None
    yield tok(1), 11, 3, feats(1)


def _call(runner, call, last):
    """One call; a draft step (features None) feeds the runner's own previous output."""
    tokens, start, first, features = call
    out, logits = runner.run(tokens, start, first, features=features, hidden=None if features is not None else last)
    return out, np.asarray(logits)


def _drive(runners: dict, calls) -> dict:
    """Every runner through the same calls; name -> [(out, logits)] per call."""
    results = {name: [] for name in runners}
    for call in calls:
        for name, r in runners.items():
            results[name].append(_call(r, call, results[name][-1][0] if results[name] else None))
    return results


def _fresh(head: EagleHead, precision: str = "fp32") -> OrtHeadRunner:
    r = OrtHeadRunner(head, precision)
    r.begin(32)
    return r


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_fp32_computes_what_torch_computes(heads, kv_heads):
    head = _head(heads=heads, kv_heads=kv_heads)
    torch_runner = TorchHeadRunner(head)
    torch_runner.begin(32)
    runners = {"torch": torch_runner, "ort": _fresh(head)}
    res = _drive(runners, list(_calls(head)))
    for i, ((t_out, t_log), (o_out, o_log)) in enumerate(zip(res["torch"], res["ort"])):
        assert o_log.shape == (DRAFT,) and o_log.dtype == np.float32
        np.testing.assert_allclose(o_log, t_log, rtol=0, atol=1e-4, err_msg=f"call {i}")
        np.testing.assert_allclose(np.asarray(o_out).reshape(-1), t_out.numpy().reshape(-1), rtol=0, atol=1e-4,
                                   err_msg=f"call {i}")
        assert o_log.argmax() == t_log.argmax(), f"call {i}"
    assert np.array_equal(runners["ort"].target_ids, runners["torch"].target_ids)
    assert runners["ort"].feature_layers == runners["torch"].feature_layers and runners["ort"].vocab_size == VOCAB


def test_the_calls_tell_wrong_windows_apart():
    """The comparison above can fail: where a call attends from, and the rows a rollback rewrote,
    change the logits far beyond its tolerance (a runner that ignored `first`, or kept the rows
    a rollback replaced, would fail it)."""
    head = _head()
    calls = list(_calls(head))
    base = _drive({"r": _fresh(head)}, calls)["r"]
    gap = next(i for i, c in enumerate(calls) if c[2] > 0)
    from_zero = [c if i != gap else (c[0], c[1], 0, c[3]) for i, c in enumerate(calls)]
    assert np.abs(_drive({"r": _fresh(head)}, from_zero)["r"][gap][1] - base[gap][1]).max() > 1e-2
    back = next(i for i, c in enumerate(calls) if c[3] is not None and c[1] == 4)  # the rollback
    stale = calls[:back] + [(c[0], c[1], c[2], None if c[3] is None else c[3] * 0.5) for c in calls[back:back + 1]] \
        + calls[back + 1:]
    got = _drive({"r": _fresh(head)}, stale)["r"]
    assert np.abs(got[back + 1][1] - base[back + 1][1]).max() > 1e-2  # the next step reads rows 4..6


@pytest.mark.parametrize("precision,min_rate", [("int8", 0.9), ("int4", 0.7)])
def test_quantized_logits_agree_with_fp32(precision, min_rate):
    """Same inputs (every row a real pair, so the runners' inputs never diverge): the argmax of
    int8 agreed with fp32 on 95 of 96 rows when written (int4: 82, LM head at 8 bits); the bars leave margin."""
    head = _head(seed=3)
    fp32, quant = OrtHeadRunner(head, "fp32"), OrtHeadRunner(head, precision)
    rng = np.random.default_rng(4)
    width = len(head.cfg.aux_layers) * head.cfg.target_hidden
    agree = rows = 0
    for r in (fp32, quant):
        r.begin(128)
    for start in range(0, 96, 1):
        tokens, feats = [int(rng.integers(VOCAB))], rng.standard_normal((1, width), dtype=np.float32)
        _, want = fp32.run(tokens, start, 0, features=feats)
        _, got = quant.run(tokens, start, 0, features=feats)
        assert np.isfinite(got).all()
        agree, rows = agree + int(got.argmax() == want.argmax()), rows + 1
    assert agree / rows >= min_rate, f"{precision}: argmax agrees on {agree}/{rows} rows"


def test_fork_has_its_own_cache():
    """A fork writing other rows at the same positions, call by call in between, changes nothing
    the original computes (bitwise: the same graph on the same inputs)."""
    head = _head()
    mine, theirs = list(_calls(head)), list(_calls(head, seed=9))
    want = _drive({"r": _fresh(head, "int8")}, mine)["r"]
    a = _fresh(head, "int8")
    b = a.fork()
    assert b._step is a._step and b._cache is None  # the sessions are shared, the cache is not
    b.begin(32)
    got = {"a": [], "b": []}
    for call_a, call_b in zip(mine, theirs):
        got["a"].append(_call(a, call_a, got["a"][-1][0] if got["a"] else None))
        got["b"].append(_call(b, call_b, got["b"][-1][0] if got["b"] else None))
    for (_, w), (_, g) in zip(want, got["a"]):
        np.testing.assert_array_equal(g, w)
    assert np.abs(got["b"][-1][1] - got["a"][-1][1]).max() > 1e-2


def test_bad_precisions_and_calls_fail_clearly():
    with pytest.raises(ValueError, match="fp32, int8, int4"):
        OrtHeadRunner(_head(), "fp16")
    head = _head()
    r = OrtHeadRunner(head, "fp32")
    r.begin(4)  # 4 positions and a draft past them
    with pytest.raises(ValueError, match="do not fit"):
        r.run([1] * 3, 4 + MAX_DRAFT_TOKENS, 0, hidden=np.zeros((3, 64), np.float32))


# -- the config: drafter.backend / precision choose the head's runner -------------------------------

def test_bad_head_backends_and_precisions_fail_clearly():
    from hetero_sd.drafting.build import load_head
    from hetero_sd.drafting.specs import HeadSpec
    from hetero_sd.ir.errors import ConfigError

    with pytest.raises(ConfigError, match="drafter.backend: 'openvino'.*torch, onnxruntime"):
        load_head(HeadSpec("h", "t", backend="openvino"), load=None)
    with pytest.raises(ConfigError, match="drafter.precision: 'gguf'.*default, int8, fp32, int4"):
        load_head(HeadSpec("h", "t", backend="onnxruntime", precision="gguf"), load=None)
    with pytest.raises(ConfigError, match="drafter.precision: 'int8'.*torch head.*default, fp32"):
        load_head(HeadSpec("h", "t", backend="torch", precision="int8"), load=None)
    with pytest.raises(ConfigError, match="cpu only"):
        load_head(HeadSpec("h", "t", device="cuda:0", backend="onnxruntime"), load=None)


# -- the engine: greedy output with the head on onnxruntime int8 is the target's own ------------------

def _yaml(path: Path, model: Path, drafter: str) -> Path:
    path.write_text(f"target: {{model: {model}, backend: torch, precision: fp32}}\n"
                    f"drafter: {drafter}\ngeneration: {{max_new_tokens: 32, chat_template: false}}\n")
    return path


@pytest.fixture(scope="module")
def head_engine(tiny_model_dir, tmp_path_factory):
    """An engine (torch fp32 target) drafting with an untrained head on onnxruntime (precision
    default: int8), its draft vocabulary the tokens the target emits on the test prompts (so
    some drafts are accepted and some rejected), and those prompts with the target's own output."""
    from hetero_sd.engine import Engine
    from hetero_sd.ir import load_model_ir
    from hetero_sd.training.head import init_head
    from helpers.tiny_models import random_prompt

    model, tmp = tiny_model_dir("llama"), tmp_path_factory.mktemp("ort_head")
    target = Engine.from_config(_yaml(tmp / "target.yaml", model, "{kind: none}"), target_only=True)
    prompts = [(random_prompt(7, seed=2), 30), (random_prompt(4, seed=11), 20)]
    cases = [(p, target.generate_ids(p, n, target_only=True).token_ids) for p, n in prompts]
    ir = load_model_ir(model)
    ids = np.array(sorted({t for _, out in cases for t in out}))
    init_head(HeadConfig.for_target(ir.config, len(ids)), ir, ids, seed=0).save(tmp / "head")
    engine = Engine.from_config(_yaml(tmp / "head.yaml", model, f"{{kind: head, head: {tmp / 'head'}, "
                                                                 "backend: onnxruntime}"))
    return engine, cases


def test_greedy_is_lossless_with_the_onnxruntime_head(head_engine):
    from hetero_sd.scheduler import FixedDraftLength

    engine, cases = head_engine
    assert isinstance(engine.drafter.runner, OrtHeadRunner) and engine.drafter.runner.precision == "int8"
    drafted = accepted = 0
    for k in range(1, 9):
        engine.policy = FixedDraftLength(k)
        for i, (prompt, want) in enumerate(cases):
            out = engine.generate_ids(prompt, len(want))
            assert out.token_ids == want, f"k={k} prompt {i}: diverged"
            assert out.stats.lossless == "exact"
            drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    assert 0 < accepted < drafted  # both outcomes of verification happened
