"""Hidden states of chosen decoder layers (an EAGLE-3 draft head's input): the
runner's `take_features` on every built-in backend, against transformers'
layer outputs; logits unchanged by them, bitwise; the Loader, the failover
runner and the fake backend around them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero_sd.backends.base import BatchItem, DeviceInfo, PrecisionInfo, run_batch
from hetero_sd.backends.registry import Registry, discover
from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.errors import BackendError, GenerationError, ModelLoadError
from hetero_sd.failover import FailoverRunner, RankedFallback
from hetero_sd.ir import load_model_ir
from hetero_sd.loading import Loader
from hetero_sd.testing.fake_backend import FakeBackend, FakeDeviceSpec, FakeFailure
from helpers.tiny_models import HIDDEN, NUM_LAYERS, load_hf_model, random_prompt

REGISTRY = discover()
LAYERS = (1, 0)  # the tiny models have two layers; out of order, to test the concatenation order
BUDGET = 4 << 20


def _load(backend, folder, precision="fp32", layers=LAYERS):
    if backend not in REGISTRY.backends:
        pytest.fail(f"backend {backend} missing: install the test extra (pip install -e '.[test]')")
    model = load_model_ir(folder).with_features(layers)
    return REGISTRY.get(backend).load(model, "cpu", precision, BUDGET)


@torch.no_grad()
def _hf_features(folder, ids, layers=LAYERS) -> np.ndarray:
    """transformers' decoder layer outputs [T, len(layers) * hidden], read by forward
    hooks (its output_hidden_states puts the final norm on the last layer's)."""
    model = load_hf_model(folder)
    outs = {}

    def hook(i):
        return lambda module, args, out: outs.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0])

    handles = [model.model.layers[i].register_forward_hook(hook(i)) for i in set(layers)]
    try:
        model(input_ids=torch.tensor([list(ids)]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([outs[i] for i in layers], dim=-1).float().numpy()


def _steps(runner, seq, tokens, prefill=12, verify=6):
    """A prefill (one logit), a multi-token verify, then one-token decodes (the last
    through greedy): each call's features, taken at once."""
    feats = [None] * 2
    runner.forward(seq, tokens[:prefill], 0, 1)
    feats[0] = runner.take_features(seq)
    assert runner.take_features(seq) is None  # taken: forgotten
    runner.forward(seq, tokens[prefill:prefill + verify], prefill, verify)
    feats[1] = runner.take_features(seq)
    for pos in range(prefill + verify, len(tokens)):
        call = runner.greedy if pos == len(tokens) - 1 else runner.forward
        call(seq, [tokens[pos]], pos, 1)
        feats.append(runner.take_features(seq))
    return feats


@pytest.mark.parametrize("variant", ["llama", "mistral-swa", "qwen2", "gemma3", "qwen3-moe", "phi3"])
def test_torch_features_equal_transformers_layer_outputs(tiny_model_dir, variant):
    folder = tiny_model_dir(variant)
    tokens = random_prompt(22, seed=3)
    runner = _load("torch", folder)
    assert runner.feature_layers == LAYERS
    seq = runner.allocate(64)
    assert runner.take_features(seq) is None  # no call yet
    feats = _steps(runner, seq, tokens)
    widths = [12, 6] + [1] * 4
    assert [f.shape for f in feats] == [(w, len(LAYERS) * HIDDEN) for w in widths]
    assert all(f.dtype == np.float32 for f in feats)
    np.testing.assert_allclose(np.concatenate(feats), _hf_features(folder, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend,precision", [("torch", "fp32"), ("onnxruntime", "fp32"), ("onnxruntime", "int4"),
                                               ("openvino", "fp32")])
def test_forward_batch_features_are_each_items_rows(tiny_model_dir, backend, precision):
    """Each BatchItem gets its own rows' features: close to transformers', and
    bitwise the features of the same rows run in a call of their own."""
    folder = tiny_model_dir("llama")
    runner = _load(backend, folder, precision)
    prompts = [random_prompt(n, seed=10 + n) for n in (5, 9, 14)]
    news = [random_prompt(n, seed=20 + n)[1:] for n in (4, 2, 7)]
    seqs = [runner.allocate(40) for _ in prompts]
    for seq, p in zip(seqs, prompts):
        runner.forward(seq, p, 0, 1)
    # the last item returns fewer logits than rows (as a prefill does): its own path on torch
    items = [BatchItem(seq, new, len(p), len(new) if i < 2 else 2)
             for i, (seq, p, new) in enumerate(zip(seqs, prompts, news))]
    solo = []
    for it in items:
        runner.forward(it.seq_id, it.tokens, it.start, it.num_logits)
        solo.append(runner.take_features(it.seq_id))
        runner.truncate(it.seq_id, it.start)
    run_batch(runner, items)
    for it, p, one in zip(items, prompts, solo):
        got = runner.take_features(it.seq_id)
        assert got.shape == (len(it.tokens), len(LAYERS) * HIDDEN)
        assert np.array_equal(got, one), f"{len(it.tokens)} rows: batched features differ from solo"
        if precision == "fp32":
            ref = _hf_features(folder, p + list(it.tokens))[len(p):]
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
        assert runner.take_features(it.seq_id) is None


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("variant", ["llama-tied", "qwen2", "gemma3", "mixtral", "smollm3"])
def test_graph_fp32_features_close_to_transformers(tiny_model_dir, backend, variant):
    folder = tiny_model_dir(variant)
    tokens = random_prompt(22, seed=4)
    runner = _load(backend, folder)
    assert runner.feature_layers == LAYERS
    feats = _steps(runner, runner.allocate(64), tokens)
    assert [f.shape[0] for f in feats] == [12, 6, 1, 1, 1, 1]
    # the logits tests' fp32 tolerance (float reassociation only)
    np.testing.assert_allclose(np.concatenate(feats), _hf_features(folder, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend,precision", [("onnxruntime", "int8"), ("onnxruntime", "int4"),
                                               ("openvino", "int8"), ("openvino", "int4")])
def test_quantised_features_of_a_verify_equal_one_token_steps(tiny_model_dir, backend, precision):
    runner = _load(backend, tiny_model_dir("llama"), precision)
    seq = runner.allocate(64)
    prompt, cont = random_prompt(12, seed=1), random_prompt(9, seed=2)
    runner.forward(seq, prompt, 0, 1)
    first = runner.take_features(seq)
    assert first.shape == (12, len(LAYERS) * HIDDEN) and np.isfinite(first).all()
    single = []
    for i, tok in enumerate(cont):
        runner.forward(seq, [tok], 12 + i, 1)
        single.append(runner.take_features(seq))
    single = np.concatenate(single)
    assert single.shape == (9, len(LAYERS) * HIDDEN) and np.isfinite(single).all()
    for width in (2, 5, 9):
        runner.truncate(seq, 12)
        runner.forward(seq, cont[:width], 12, width)
        rows = runner.take_features(seq)
        if runner.precision.batch_invariant:
            assert np.array_equal(rows, single[:width]), f"width {width} differs from one-token steps"
        else:
            np.testing.assert_allclose(rows, single[:width], atol=0.05 * np.abs(single).max())


@pytest.mark.parametrize("backend,precision", [("torch", "fp32"), ("onnxruntime", "fp32"), ("onnxruntime", "int4"),
                                               ("openvino", "fp32"), ("openvino", "int4")])
def test_logits_with_features_are_bitwise_the_logits_without(tiny_model_dir, backend, precision):
    folder = tiny_model_dir("qwen2")
    tokens = random_prompt(22, seed=5)
    got = []
    for layers in (None, LAYERS, (0,)):
        runner = _load(backend, folder, precision, layers)
        assert tuple(runner.feature_layers) == (layers or ())
        seq = runner.allocate(64)
        calls = [runner.forward(seq, tokens[:12], 0, 1), runner.forward(seq, tokens[12:18], 12, 6)]
        calls += [runner.forward(seq, [t], 18 + i, 1) for i, t in enumerate(tokens[18:])]
        calls.append(np.array(runner.greedy(seq, tokens[:5], 0, 5)))
        got.append(calls)
        if layers is None:
            assert runner.take_features(seq) is None  # nothing computed, nothing kept
    for with_features in got[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(got[0], with_features))


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_the_graph_has_a_features_output_only_when_asked(tiny_model_dir, backend):
    """And the cache keeps the two graphs apart: a graph built without features
    is not reused for a model with them, nor one with other layers."""
    folder = tiny_model_dir("llama")
    plain, feat, other = (_load(backend, folder, "fp32", layers) for layers in (None, LAYERS, (0,)))

    def outputs(runner):
        if backend == "onnxruntime":  # (its SlabAttention graph writes K/V into the pool it is given)
            return [o.name for o in runner._session.get_outputs()]
        # (OpenVINO may name a tensor by its producer too: one layer's Concat is folded)
        return [next((n for n in ("logits", "new_kv", "features") if n in o.get_names()), o.get_any_name())
                for o in runner._compiled.outputs]

    kv = [] if backend == "onnxruntime" else ["new_kv"]
    assert outputs(plain) == ["logits", *kv]
    assert outputs(feat) == outputs(other) == ["logits", *kv, "features"]
    assert plain.feature_layers == () and feat.feature_layers == LAYERS and other.feature_layers == (0,)
    seq = other.allocate(32)
    other.forward(seq, [5, 6, 7], 0, 1)
    assert other.take_features(seq).shape == (3, HIDDEN)


def test_a_bad_layer_index_is_a_clear_error(tiny_model_dir):
    model = load_model_ir(tiny_model_dir("llama"))
    for bad in ((NUM_LAYERS,), (0, -1), (0, 7)):
        with pytest.raises(ModelLoadError, match=rf"feature layer\(s\) \[-?\d+\] outside 0\.\.{NUM_LAYERS - 1}"):
            model.with_features(bad)
    with pytest.raises(ModelLoadError, match="feature layers must be integers"):
        model.with_features(("1",))
    assert model.with_features(None) is model
    assert model.with_features((1, 1)).config.feature_layers == (1, 1)
    with pytest.raises(ModelLoadError, match="outside 0..1"):
        Loader()(ModelSpec(str(tiny_model_dir("llama")), "torch", "cpu", "fp32", BUDGET, "target",
                           features=(0, 2)))


class _NoFeaturesBackend:
    """A plugin written before hidden states: it loads any model, ignores feature_layers."""

    name, api_version = "plain", 1

    def probe(self):
        return [DeviceInfo(self.name, "cpu", "plain", (PrecisionInfo("fp32", True),), "fp32")]

    def load(self, model, device, precision, kv_budget_bytes, progress=None):
        inner = REGISTRY.get("torch").load(model, "cpu", "fp32", kv_budget_bytes)

        class Runner:  # the required contract only
            device, precision = self.probe()[0], self.probe()[0].precisions[0]
            vocab_size, max_context = inner.vocab_size, inner.max_context
            allocate, forward, greedy = inner.allocate, inner.forward, inner.greedy
            truncate, length, release, usage = inner.truncate, inner.length, inner.release, inner.usage

        return Runner()


def test_loader_refuses_a_backend_that_cannot_return_features(tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    load = Loader(Registry({"plain": _NoFeaturesBackend(), "torch": REGISTRY.get("torch")}))
    spec = ModelSpec(folder, "plain", "cpu", "fp32", BUDGET, "target")
    assert load(spec) is not None  # without features it serves
    with pytest.raises(BackendError, match=r"target: backend 'plain' cannot return hidden states"):
        load(ModelSpec(folder, "plain", "cpu", "fp32", BUDGET, "target", features=(0, 1)))
    runner = load(ModelSpec(folder, "torch", "cpu", "fp32", BUDGET, "target", features=(0, 1)))
    assert tuple(runner.feature_layers) == (0, 1)


def _fake(failing_after=None):
    failure = None if failing_after is None else FakeFailure(after_calls=failing_after, kind="runtime_error")
    return FakeBackend(devices=[FakeDeviceSpec(device="fake:0", failure=failure), FakeDeviceSpec(device="fake:1")])


def test_failover_and_fake_runners_pass_features_through(tiny_model_dir):
    """The fake runner hands the wrapped runner's features on; the failover runner
    too, and after a device failure the replacement (loaded from the same spec)
    returns the same layers: the replay's own features are not the caller's."""
    folder = tiny_model_dir("llama")
    ir = load_model_ir(folder).with_features(LAYERS)
    tokens = random_prompt(22, seed=6)
    ref = _hf_features(folder, tokens)
    fake = _fake().load(ir, "fake:1", "fp32", BUDGET)
    assert tuple(fake.feature_layers) == LAYERS
    assert tuple(_fake().load(load_model_ir(folder), "fake:1", "fp32", BUDGET).feature_layers) == ()
    for after in (1, 2, 4):  # the prefill, the verify, the second decode fails
        runner = FailoverRunner(_fake(after).load(ir, "fake:0", "fp32", BUDGET),
                                RankedFallback(targets=[("fake:1", lambda: _fake().load(ir, "fake:1", "fp32",
                                                                                         BUDGET))]))
        assert tuple(runner.feature_layers) == LAYERS
        other = runner.allocate(64)
        runner.forward(other, tokens[:3], 0, 3)  # its features are not taken before the failover
        seq = runner.allocate(64)
        feats = _steps(runner, seq, tokens)
        assert any("target moved to" in e for e in runner.take_events())
        assert tuple(runner.current.feature_layers) == LAYERS
        np.testing.assert_allclose(np.concatenate(feats), ref, atol=1e-5, rtol=0)
        # the other sequence's call ran on the failed device: its features were carried over
        np.testing.assert_allclose(runner.take_features(other), ref[:3], atol=1e-5, rtol=0)
        assert runner.take_features(other) is None


def test_failover_refuses_a_replacement_without_the_layers(tiny_model_dir):
    ir = load_model_ir(tiny_model_dir("llama"))
    runner = FailoverRunner(_fake(1).load(ir.with_features(LAYERS), "fake:0", "fp32", BUDGET),
                            RankedFallback(targets=[("fake:1", lambda: _fake().load(ir, "fake:1", "fp32", BUDGET))]))
    seq = runner.allocate(32)
    runner.forward(seq, [5, 6, 7], 0, 1)
    with pytest.raises(GenerationError, match="no other device"):
        runner.forward(seq, [8], 3, 1)
    assert any("cannot return the hidden states of layers [1, 0]" in e for e in runner.take_events())
