"""benchmarks/bench_suffix.py end to end on a tiny model: three passes, the report's figures."""
from __future__ import annotations

import json

from helpers.benchmarks import load_benchmark

bench = load_benchmark("bench_suffix")


def test_three_passes_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(f"target: {{model: {tiny_model_dir('llama')}, backend: torch, precision: fp32}}\n"
                      "drafter: {kind: ngram, process: inproc}\nmemory: {kv_budget: 4MiB}\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "kind": kind, "prompt": text}) for i, (kind, text) in
                                 enumerate([("grounded", "copy: alpha beta gamma alpha beta gamma"),
                                            ("open", "tell me a story")])) + "\n")
    out = tmp_path / "suffix.json"
    assert bench.main(["--config", str(config), "--prompts", str(prompts), "--max-new-tokens", "10", "--k", "4",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["checks"] == {"outputs_equal_pass_1": True, "pass_3_figures_equal_pass_1": True}
    first, second, third = (report["summary"][name]["all"] for name in bench.PASSES)
    assert not first["global_share"] and second["global_share"] > 0  # pass 2 drafts from pass 1's outputs
    assert second["accepted"] > first["accepted"]
    assert (third["drafted"], third["accepted"], third["rounds"]) == (first["drafted"], first["accepted"],
                                                                      first["rounds"])
    assert report["meta"]["k"] == 4 and len(report["passes"]["pass 1"]) == 2
    assert report["draft_cost"]["calls"] > 0 and report["draft_cost"]["first_call_mean_ms"] > 0
    assert "| pass 2 | all |" in capsys.readouterr().out


def test_versus_ngram_on_a_tiny_model(tiny_model_dir, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(f"target: {{model: {tiny_model_dir('llama')}, backend: torch, precision: fp32}}\n"
                      "drafter: {kind: ngram, k: 3}\nmemory: {kv_budget: 4MiB}\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "g", "kind": "grounded", "prompt": "copy: one two three one two three"})
                       + "\n")
    out = tmp_path / "versus.json"
    assert bench.main(["--config", str(config), "--prompts", str(prompts), "--max-new-tokens", "12", "--eos", "ignore",
                       "--versus-ngram", "--reps", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["rep"], r["run"]) for r in report["rows"]] == [
        (0, "target-only"), (0, "ngram"), (0, "suffix"), (1, "ngram"), (1, "suffix"), (1, "target-only")]
    assert all(r["lossless"] for r in report["rows"])
    summary = report["summary"]["all"]
    assert summary["prompts"] == 2 and summary["suffix"]["lossless"] == "2/2" and summary["suffix/ngram"] > 0
    assert report["meta"]["k"] == 3  # the config's draft length
