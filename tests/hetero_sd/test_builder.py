"""Building an engine from YAML: a draft model that shares the target's tokenizer drafts its ids;
one that does not (even at the same size) drafts through the text (drafting/cross_vocab.py)."""
import json
import shutil

import pytest

from hetero_sd.engine import Engine
from hetero_sd.config import load_config
from hetero_sd.errors import ConfigError


def _write(tmp_path, target, draft):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"target: {{model: {target}}}\n"
                    f"drafter: {{kind: model, model: {draft}, precision: fp32, k: 3}}\n"
                    "memory: {kv_budget: 1MiB}\n")
    return path


def test_same_size_different_tokenizer_drafts_through_the_text(tiny_model_dir, tmp_path):
    from hetero_sd.drafting.cross_vocab import CrossVocabDrafter

    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_dir("llama", seed=1), draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids mean different text
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    engine = Engine.from_config(load_config(_write(tmp_path, tiny_model_dir("llama"), draft)))
    assert isinstance(engine._drafter.default, CrossVocabDrafter)
    prompt = list(range(5, 25))
    spec, base = engine.generate_ids(prompt, 20), engine.generate_ids(prompt, 20, target_only=True)
    assert spec.stats.drafted > 0 and spec.token_ids == base.token_ids


def test_draft_model_with_same_tokenizer_builds_and_is_lossless(tiny_model_dir, tmp_path):
    engine = Engine.from_config(load_config(_write(tmp_path, tiny_model_dir("llama"), tiny_model_dir("llama", seed=1))))
    prompt = list(range(5, 25))
    spec, base = engine.generate_ids(prompt, 20), engine.generate_ids(prompt, 20, target_only=True)
    assert spec.stats.mode == "model" and spec.stats.drafted > 0
    assert spec.token_ids == base.token_ids
