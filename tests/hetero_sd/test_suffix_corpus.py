"""A suffix corpus (drafter.suffix_corpus): earlier outputs saved to a file by
`hetero-sd build-corpus` and pinned in the suffix drafter's global tree.

- pinned sequences beside evicted requests: drafts and counts equal the
  brute-force reference's, and clear_global() keeps the corpus;
- the file: round trip, and clear errors (missing, not a corpus, another
  vocabulary, damaged);
- the YAML key (auto, none, a path) and build-corpus end to end (resumable) on
  the tiny model, whose engine stays token-identical to the target alone;
- the corpus shipped for the embedded SmolLM2 is found by `auto` and drafts.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_sd.assets import default_corpus, packaged_corpus
from hetero_sd.config import load_config
from hetero_sd.drafting.corpus_file import corpus_info, load_corpus, save_corpus
from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.drafting.suffix_global import GlobalTree
from hetero_sd.errors import ConfigError
from hetero_sd.ir.work import DraftRequest
from hetero_sd.spec import spec_from_config
from helpers.suffix_trees import global_counts, ref_counts, ref_draft

ALPHABET = st.integers(min_value=0, max_value=3)
SEQS = st.lists(ALPHABET, min_size=1, max_size=16)


# ------------------------------------------------------------------ the pinned tree
@settings(max_examples=150, deadline=None)
@given(st.lists(SEQS, min_size=1, max_size=3), st.lists(st.tuples(SEQS, SEQS), min_size=1, max_size=7),
       st.integers(1, 3), st.integers(1, 5))
def test_a_pinned_corpus_with_evicted_requests_matches_the_reference(corpus, requests, cap, max_depth):
    """Requests in turn over a corpus: the tree holds the corpus and the last `cap`
    outputs (the corpus oldest, never evicted), and every draft is the reference's
    over exactly those; clear_global() leaves the corpus alone."""
    drafter, earlier = SuffixDrafter(max_depth=max_depth, max_cached_requests=cap, corpus=corpus), []
    assert global_counts(drafter.global_tree) == ref_counts(corpus, drafter.depth)
    for prompt, output in requests:
        drafter.begin(64)
        context, synced = prompt + output[:1], 0
        for i in range(1, len(output) + 1):
            got = drafter.draft(DraftRequest(0, synced, 5, context[synced:])).tokens
            assert got == ref_draft(context, corpus + earlier, 5, max_depth)[0]
            synced, context = len(context), context + output[i:i + 1]
        drafter.reset()
        earlier = (earlier + [prompt[max(0, len(prompt) - max_depth):] + output])[-cap:]
        assert global_counts(drafter.global_tree) == ref_counts(corpus + earlier, drafter.depth)
    drafter.clear_global()
    assert global_counts(drafter.global_tree) == ref_counts(corpus, drafter.depth)
    assert drafter.global_tree.tokens == 0 and drafter.global_tree.pinned_tokens == sum(map(len, corpus))


def test_the_corpus_is_outside_the_bounds_and_must_come_first():
    drafter = SuffixDrafter(max_depth=4, max_cached_requests=1, corpus=[[1, 2, 3, 4, 5]])
    drafter.add_to_global([7, 8, 9])
    drafter.add_to_global([6, 6, 7])  # evicts [7, 8, 9], not the corpus
    assert global_counts(drafter.global_tree) == ref_counts([[1, 2, 3, 4, 5], [6, 6, 7]], drafter.depth)
    drafter.begin(16)
    assert drafter.draft(DraftRequest(0, 0, 4, [9, 2, 3])).tokens == [4, 5]
    assert drafter.source == "global"
    with pytest.raises(ValueError, match="pinned"):
        drafter.global_tree.add([1, 2], pinned=True)


def test_an_edge_shared_with_the_corpus_survives_its_latest_occurrence():
    """The latest occurrence of a string goes; the corpus's copy is read from then on."""
    tree = GlobalTree(8)
    tree.add([1, 2, 3, 4], pinned=True)
    tree.add([0, 1, 2, 3, 5])
    edge = tree.root.children[1]
    assert edge.seq == 1  # the request's occurrence, the latest
    tree.evict_oldest()
    assert edge.seq == 0 and global_counts(tree) == ref_counts([[1, 2, 3, 4]], 8)


# ------------------------------------------------------------------ the file
def test_corpus_file_round_trip_and_bad_files(tmp_path):
    path = save_corpus(tmp_path / "c.safetensors", [[1, 2, 3], [], [4]], 10, model="m.gguf")
    assert load_corpus(path, 10) == [[1, 2, 3], [], [4]]
    assert corpus_info(path)["model"] == "m.gguf"
    with pytest.raises(ConfigError, match=r"vocabulary of 10 tokens .*m\.gguf.*target has 12.*suffix_corpus"):
        load_corpus(path, 12)
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(tmp_path / "missing.safetensors", 10)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        corpus_info(tmp_path / "junk.safetensors")
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(ConfigError, match="not a suffix corpus"):
        corpus_info(tmp_path / "weights.safetensors")
    save_file({"tokens": np.array([1, 2], np.uint32), "offsets": np.array([0, 3], np.int64)},
              str(tmp_path / "bad.safetensors"), metadata={"format": "hetero-sd suffix corpus 1", "vocab_size": "10"})
    with pytest.raises(ConfigError, match="damaged"):
        load_corpus(tmp_path / "bad.safetensors", 10)
    save_file({"tokens": np.array([1, 2], np.uint32)}, str(tmp_path / "half.safetensors"),
              metadata={"format": "hetero-sd suffix corpus 1", "vocab_size": "10"})
    with pytest.raises(ConfigError, match="damaged"):
        load_corpus(tmp_path / "half.safetensors", 10)
    with pytest.raises(ValueError, match="0..9"):
        save_corpus(tmp_path / "big.safetensors", [[10]], 10)


# ------------------------------------------------------------------ YAML and build-corpus
def _yaml(tmp_path: Path, model, drafter: str) -> Path:
    path = tmp_path / "corpus.yaml"
    path.write_text(f"target: {{model: {model}, backend: torch, precision: fp32}}\ndrafter: {drafter}\n"
                    "memory: {kv_budget: 4MiB}\ngeneration: {max_new_tokens: 24, chat_template: true}\n")
    return path


PROMPTS = ["Write a short story about a clockmaker.", "Explain how tides work.", "Give me tips for sleeping.",
           "Write a poem about a fox.", "Describe a library at night.", "List three colours."]


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """build-corpus over six prompts on the tiny model: the config and the corpus file."""
    from hetero_sd.cli import main

    tmp = tmp_path_factory.mktemp("corpus")
    model = tiny_model_dir("llama")
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfg = _yaml(tmp, model, "{kind: suffix, k: 4, suffix_corpus: none, suffix_max_depth: 7}")
    out = tmp / "out" / "corpus.safetensors"
    assert main(["build-corpus", "--config", str(cfg), "--prompts-file", str(tmp / "prompts.jsonl"),
                 "--max-new-tokens", "24", "--out", str(out)]) == 0
    return tmp, model, out


def test_build_corpus_saves_the_targets_answers(built):
    from hetero_sd.engine import Engine

    tmp, model, out = built
    engine = Engine.from_config(_yaml(tmp, model, "{kind: none}"))
    seqs = load_corpus(out, engine.target_runner.vocab_size)
    assert len(seqs) == len(PROMPTS) and corpus_info(out)["prompts"] == str(len(PROMPTS))
    for prompt, seq in zip(PROMPTS, seqs):
        ids = engine.encode(prompt)
        answer = engine.generate_ids(ids, 24).token_ids
        assert len(ids) > 7 and seq == ids[-7:] + answer  # the prompt's last suffix_max_depth tokens, the answer
    assert not out.with_name(out.name + ".partial.jsonl").exists()


def test_build_corpus_resumes_an_interrupted_run(built, tmp_path, capsys):
    from hetero_sd.cli import main

    from hetero_sd.training.corpus_build import settings

    tmp, model, out = built
    cfg = _yaml(tmp_path, model, "{kind: suffix, k: 4, suffix_corpus: none, suffix_max_depth: 7}")
    args = ["build-corpus", "--config", str(cfg), "--prompts-file", str(tmp / "prompts.jsonl"),
            "--max-new-tokens", "24", "--out", str(tmp_path / "c.safetensors")]
    partial = tmp_path / "c.safetensors.partial.jsonl"
    vocab = int(corpus_info(out)["vocab_size"])
    full = load_corpus(out, vocab)
    head = json.dumps(settings(load_config(cfg), 24)) + "\n"
    saved = [[1, 2, 3], [4, 5]]  # (not what the target says: a resume keeps them, it does not answer again)
    lines = [json.dumps({"prompt": p, "tokens": t}) + "\n" for p, t in zip(PROMPTS[:2], saved)]
    partial.write_text(head + "".join(lines) + '{"prompt": "torn')  # a kill mid-write
    assert main(args) != 0 and "pass --resume to continue it" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    assert "dropped" in capsys.readouterr().err
    assert load_corpus(tmp_path / "c.safetensors", vocab) == saved + full[2:]
    partial.write_text(head + json.dumps({"prompt": "something else", "tokens": [1]}) + "\n")
    assert main(args + ["--resume"]) != 0 and "answered other prompts" in capsys.readouterr().err
    partial.write_text(head.replace('"max_new_tokens": 24', '"max_new_tokens": 99') + lines[0])
    assert main(args + ["--resume"]) != 0 and "max_new_tokens" in capsys.readouterr().err


def test_yaml_suffix_corpus_auto_none_and_path(built, tmp_path):
    tmp, model, out = built
    rel = tmp_path / "mine.safetensors"
    rel.write_bytes(out.read_bytes())
    assert spec_from_config(load_config(_yaml(tmp_path, model, "{kind: suffix, suffix_corpus: mine.safetensors}"))
                            ).drafter.corpus == str(rel)
    assert spec_from_config(load_config(_yaml(tmp_path, model, "{kind: suffix, suffix_corpus: none}"))
                            ).drafter.corpus is None
    auto = load_config(_yaml(tmp_path, model, "{kind: hybrid, hybrid_with: model, suffix_corpus: auto}"))
    assert spec_from_config(auto).drafter.suffix.corpus is None  # none built for this model, none shipped
    cached = default_corpus(str(model))
    cached.parent.mkdir(parents=True)
    cached.write_bytes(out.read_bytes())
    try:
        assert spec_from_config(auto).drafter.suffix.corpus == str(cached)
    finally:
        cached.unlink()
    with pytest.raises(ConfigError, match=r"corpus\.yaml: drafter\.suffix_corpus: .*nope\.safetensors does not exist"):
        spec_from_config(load_config(_yaml(tmp_path, model, "{kind: suffix, suffix_corpus: nope.safetensors}")))
    with pytest.raises(ConfigError, match=r"drafter\.suffix_corpus.*drafter\.kind: suffix"):
        load_config(_yaml(tmp_path, model, "{kind: ngram, suffix_corpus: none}"))


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_with_a_corpus_equals_target_only(built, tmp_path, k):
    """A fresh engine drafting from the corpus: token-identical to the target alone on the
    corpus's own prompts (long global drafts) and others (short or none)."""
    from hetero_sd.engine import Engine

    tmp, model, out = built
    engine = Engine.from_config(_yaml(tmp_path, model, f"{{kind: suffix, k: {k}, suffix_corpus: {out}, "
                                                       "suffix_cache_requests: 0}"))
    drafted = 0
    for prompt in PROMPTS[k % 3::2] + ["Something the corpus never saw: 7 9 3."]:
        ids = engine.encode(prompt)
        got = engine.generate_ids(ids, 24)
        assert got.token_ids == engine.generate_ids(ids, 24, target_only=True).token_ids, (k, prompt)
        drafted += got.stats.drafted
    assert drafted > 0


def test_a_fresh_engine_drafts_from_the_corpus(built, tmp_path):
    """Without earlier requests (suffix_cache_requests: 0), only the corpus can draft a
    prompt's answer before it is written: far more accepted than without it."""
    from hetero_sd.engine import Engine

    tmp, model, out = built
    accepted = {}
    for corpus in ("none", str(out)):
        engine = Engine.from_config(_yaml(tmp_path, model, f"{{kind: suffix, k: 4, suffix_corpus: {corpus}, "
                                                           "suffix_cache_requests: 0}"))
        accepted[corpus] = sum(engine.generate_ids(engine.encode(p), 24).stats.accepted for p in PROMPTS)
    assert accepted[str(out)] >= 2 * accepted["none"] + len(PROMPTS), accepted


def test_the_shipped_corpus_drafts_the_embedded_model(smollm2_gguf, tmp_path):
    """suffix_corpus: auto finds the corpus shipped for the embedded SmolLM2 (none built here);
    on a held-out open prompt, with no earlier request, its drafts are accepted and the
    output is the target's."""
    from hetero_sd.engine import Engine

    assert not default_corpus(str(smollm2_gguf)).exists()  # (the session's empty cache)
    shipped = packaged_corpus(str(smollm2_gguf))
    assert shipped.stat().st_size < 4 << 20
    accepted = {}
    for corpus in ("auto", "none"):
        path = _yaml(tmp_path, smollm2_gguf, f"{{kind: suffix, k: 3, suffix_corpus: {corpus}, "
                                             "suffix_cache_requests: 0}")
        path.write_text(path.read_text().replace("backend: torch, precision: fp32", "backend: onnxruntime, "
                                                 "precision: gguf").replace("4MiB", "32MiB"))
        engine = Engine.from_config(path)
        assert (engine.drafter.global_tree.pinned_tokens > 100_000) == (corpus == "auto")
        ids = engine.encode("Write a polite email to a landlord asking to fix a leaking kitchen tap.")
        spec = engine.generate_ids(ids, 48)
        assert spec.token_ids == engine.generate_ids(ids, 48, target_only=True).token_ids
        accepted[corpus] = spec.stats.accepted
    assert accepted["auto"] > accepted["none"] + 5, accepted
