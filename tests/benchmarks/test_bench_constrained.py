"""The constrained-decoding benchmark: its validity and summary arithmetic on
made-up records, and the whole script on a tiny GGUF (ours, and GenAI's
structured output where GenAI loads it). Speed is never asserted."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_constrained.py"
_spec = importlib.util.spec_from_file_location("bench_constrained", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "c": {"enum": ["a", "b"]}},
          "required": ["n", "c"], "additionalProperties": False}


@pytest.mark.parametrize("text, valid, why", [
    ('{"n": 3, "c": "a"}', True, ""),
    ('  {"c": "b", "n": -1}\n', True, ""),
    ('{"n": 3, "c": "a"', False, "not JSON"),  # cut at max_new_tokens
    ('{"n": 3, "c": "a"} trailing', False, "not JSON"),
    ('```json\n{"n": 3, "c": "a"}\n```', False, "not JSON"),
    ('{"n": 3.5, "c": "a"}', False, "schema"),
    ('{"n": 3, "c": "z"}', False, "schema"),
    ('{"n": 3}', False, "schema"),
    ('{"n": 3, "c": "a", "extra": 1}', False, "schema"),
])
def test_validity_is_parse_and_schema(text, valid, why):
    ok, reason = bench.validity(text, SCHEMA)
    assert ok is valid and reason.startswith(why)


def test_packaged_prompts_are_well_formed():
    prompts = bench.load_prompts(bench.PROMPTS)
    assert len(prompts) >= 10 and len({p["id"] for p in prompts}) == len(prompts)
    assert sum(p["source"] == "ours" for p in prompts) == 5 == sum(bool(p.get("ours")) for p in prompts)
    assert {p["source"] for p in prompts} == {"ours", "heldout-style"}
    assert bench.load_prompts(bench.PROMPTS, limit=3) == prompts[:3]


def _rec(name, rep, pid, tokens, total_s, text, source="ours", **stats):
    p = {"id": pid, "source": source, "schema": SCHEMA}
    return bench.record(name, rep, p, tokens, text, total_s, 0.1 * total_s, "grammar", **(
        {"stats": type("S", (), stats)()} if stats else {}))


def test_summary_counts_validity_equality_and_pairs_ratios():
    names, greedy = bench.config_names("ngram", peer=False)
    assert names == ["ours target-only [json]", "ours ngram [json]", "ours target-only", "ours ngram"]
    assert greedy == {"ours ngram [json]": "ours target-only [json]", "ours ngram": "ours target-only"}
    good, bad = '{"n": 1, "c": "a"}', '{"n": 1, "c": "a"'
    cost = dict(drafted=10, accepted=6, rounds=4, draft_s=0.01, verify_s=0.4, mask_s=0.05, mask_wait_s=0.01,
                grammar_cut=2, grammar_drafted=3)
    records = []
    for rep, slow in ((0, 1.0), (1, 3.0)):  # the host slows down 3x between repetitions
        records += [_rec("ours target-only [json]", rep, "p", [1, 2, 3, 4], 1.0 * slow, good, **cost),
                    _rec("ours ngram [json]", rep, "p", [1, 2, 3, 4], 0.5 * slow, good, **cost),
                    _rec("ours target-only [json]", rep, "q", [5, 6], 1.0 * slow, bad, "heldout-style", **cost),
                    _rec("ours ngram [json]", rep, "q", [5, 7], 0.5 * slow, bad, "heldout-style", **cost)]
    records.append({"run": "ours ngram", "rep": 0, "id": "p", "source": "ours", "error": "GenerationError: boom"})
    s = bench.summarize(records, names, greedy, "ngram")
    spec = s["configs"]["ours ngram [json]"]
    assert spec["runs"] == 4 and spec["valid"] == 2 and spec["valid_by_source"] == {"heldout-style": [0, 2],
                                                                                     "ours": [2, 2]}
    assert (spec["equal_greedy"], spec["compared"]) == (2, 4)  # q's tokens differ from its greedy run
    assert spec["acceptance"] == pytest.approx(0.6) and spec["accepted_per_round"] == pytest.approx(1.5)
    assert spec["grammar_cut"] == 8 and spec["grammar_drafted"] == 12
    assert spec["mask_ms_per_token"] == pytest.approx(1e3 * 0.2 / 12)
    prefill = 0.1 * 0.5 * (1 + 1 + 3 + 3)
    assert spec["mask_of_compute"] == pytest.approx(0.2 / (prefill + 4 * 0.41))
    assert spec["wait_of_wall"] == pytest.approx(0.04 / (0.5 * 8))
    head = s["ratios"]["ours ngram [json] / ours target-only [json]"]
    assert head["pairs"] == 4 and head["tok_s"]["ratio"] == pytest.approx(2.0) and head["tok_s"]["low"] == pytest.approx(2.0)
    assert s["configs"]["ours ngram"] == {"runs": 0, "errors": ["GenerationError: boom"]}
    md = bench.to_markdown(s, {"model": "m", "target": "t", "drafter": "ngram", "mode": "ngram", "prompts": 2,
                               "ours": 1, "reps": 2, "max_new_tokens": 4, "genai": None, "peer_spec": "-",
                               "skipped": {"genai plain": "why"}})
    assert "| ours ngram [json] | " in md and "| 2/4 (2/2 0/2) |" in md and "| 2/4 |" in md and "| 8/12 |" in md
    assert "2.00x [2.00, 2.00]" in md and ">= 1.5x: met" in md and "failed: GenerationError: boom" in md
    assert "- skipped genai plain: why" in md
    table = [line for line in md.split("\n\n")[1].splitlines()]
    assert len(table) == 2 + 4 and len({line.count("|") for line in table}) == 1  # failed rows keep the columns


def test_the_script_on_a_tiny_model(tiny_model_dir, tiny_gguf, tmp_path, capsys):
    # Ours on the HF folder, GenAI on a GGUF of the same weights (--peer-model). Ours on that GGUF
    # fails: its tokenizer, rebuilt from the GGUF, has one id more than the model (<|endoftext|> at
    # 384 of 384), which llguidance refuses ("vocab size too small; 384 vs 385").
    model, gguf = tiny_model_dir("llama"), tiny_gguf("llama", "Q8_0")
    config = tmp_path / "ngram.yaml"
    config.write_text(f"target: {{model: {model}}}\ndrafter: {{kind: ngram, k: 3, min_ngram: 1, max_ngram: 3}}\n"
                      "memory: {kv_budget: 1MiB}\n")
    prompts = [{"id": "fox", "source": "ours", "prompt": "the quick brown fox jumps over the lazy dog. the quick",
                "schema": SCHEMA},
               {"id": "yes", "source": "heldout-style", "prompt": "Once upon a time there was a robot. Yes or no?",
                "schema": {"enum": ["yes", "no"]}}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "out"
    assert bench.main(["--config", str(config), "--prompts", str(tmp_path / "p.jsonl"), "--reps", "1",
                       "--max-new-tokens", "16", "--peer-model", str(gguf), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == (out / "constrained.md").read_text().strip()
    report = json.loads((out / "constrained.json").read_text())
    runs, skipped = report["runs"], report["meta"]["skipped"]
    assert not [r for r in runs if r["run"].startswith("ours") and "error" in r]
    by = {(r["run"], r["id"]): r for r in runs if "error" not in r}
    schemas = {p["id"]: p["schema"] for p in prompts}
    for (name, pid), r in by.items():
        assert r["new_tokens"] == len(r["token_ids"]) <= 16
        assert r["valid"] == bench.validity(r["text"], schemas[pid])[0]
        if name.endswith("[json]") and r["finish"] in ("grammar", "eos"):
            assert r["valid"], (name, r["text"])  # a constrained output that ended satisfies the schema
        if name.startswith("ours") and name.endswith("[json]"):
            assert r["mask_s"] > 0 and r["finish"] in ("grammar", "eos", "length")
    # The enum's language ends after a few tokens: ours stops there, with a valid answer.
    assert by[("ours target-only [json]", "yes")]["finish"] == "grammar"
    assert by[("ours target-only [json]", "yes")]["text"] in ('"yes"', '"no"')
    for pid in schemas:  # lossless: speculation changes no token, with or without the grammar
        for c in (" [json]", ""):
            assert by[(f"ours ngram{c}", pid)]["token_ids"] == by[(f"ours target-only{c}", pid)]["token_ids"]
            assert by[(f"ours ngram{c}", pid)]["equal_greedy"] is True
    configs = report["summary"]["configs"]
    assert configs["ours ngram [json]"]["equal_greedy"] == 2 and "ours ngram [json] / ours target-only [json]" in \
        report["summary"]["ratios"]
    genai = [n for n in configs if n.startswith("genai")]
    if "genai plain [json]" in skipped:  # only when GenAI cannot run this tiny GGUF here: reported, never fatal
        assert "- skipped genai plain [json]:" in printed
        return
    assert genai == ["genai plain [json]", "genai prompt-lookup [json]", "genai plain", "genai prompt-lookup"]
    assert by[("genai plain [json]", "yes")]["text"] in ('"yes"', '"no"')
    for pid in schemas:
        assert ("genai prompt-lookup [json]", pid) in by and ("genai plain", pid) in by


def test_a_failing_peer_configuration_is_reported_not_fatal(tiny_model_dir, tiny_gguf, tmp_path, monkeypatch, capsys):
    pytest.importorskip("openvino_genai")
    real = bench._generate

    def generate(ov, pipe, cfg, ids, max_new):  # GenAI refusing structured output under prompt lookup
        if cfg.structured_output_config is not None and cfg.max_ngram_size:
            raise RuntimeError("Check failed:\nstructured output is not supported\nwith prompt lookup")
        return real(ov, pipe, cfg, ids, max_new)

    monkeypatch.setattr(bench, "_generate", generate)
    config = tmp_path / "ngram.yaml"
    config.write_text(f"target: {{model: {tiny_model_dir('llama')}}}\ndrafter: {{kind: ngram, k: 2}}\n"
                      "memory: {kv_budget: 1MiB}\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "source": "ours", "prompt": "Yes?", "schema": SCHEMA}))
    out = tmp_path / "out"
    assert bench.main(["--config", str(config), "--prompts", str(tmp_path / "p.jsonl"), "--reps", "1",
                       "--max-new-tokens", "4", "--peer-model", str(tiny_gguf("llama", "Q8_0")),
                       "--out", str(out)]) == 0
    report = json.loads((out / "constrained.json").read_text())
    why = "RuntimeError: Check failed: structured output is not supported with prompt lookup"
    assert report["meta"]["skipped"] == {"genai prompt-lookup [json]": why}
    assert {r["run"] for r in report["runs"]} == {"ours target-only [json]", "ours ngram [json]", "ours target-only",
                                                 "ours ngram", "genai plain [json]", "genai plain",
                                                 "genai prompt-lookup"}
    assert f"- skipped genai prompt-lookup [json]: {why}" in capsys.readouterr().out
