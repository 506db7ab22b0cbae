"""benchmarks/check_paths.py on a tiny model: the command line's answers against two
real servers (target-only and speculating), alone and two at a time, counted."""
from __future__ import annotations

import json

from helpers.benchmarks import load_benchmark
from helpers.serving import write_config


def test_counts_every_path_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    mod = load_benchmark("check_paths")
    config = write_config(tmp_path / "tiny.yaml", tiny_model_dir("llama"), backend="onnxruntime")
    out, prompts = tmp_path / "paths.json", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "kind": "open", "prompt": text}) + "\n"
                               for i, text in enumerate(["Say hello.", "Count to three.", "Name a colour."])))
    code = mod.main(["--config", config, "--prompts", str(prompts), "--max-tokens", "6", "--together", "2",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["paths"]) == {f"{s}, {h}" for s in ("serve --no-speculation", "serve")
                                    for h in ("alone", "2 at a time")}
    assert all(r["equal"] == 3 and not r["differ"] for r in report["paths"].values()), report
    assert code == 0 and "| serve, 2 at a time | 3/3 |" in capsys.readouterr().out
