"""benchmarks/bench_vs_llamacpp.py on a tiny GGUF, with a stand-in llama-bench: every
round measures both sides, ratios are taken round by round, the padded twin loads
(figures are measured, never asserted)."""
from __future__ import annotations

import json
import sys

from helpers.benchmarks import load_benchmark


def test_interleaves_llama_bench_and_our_target(tiny_gguf, tmp_path, capsys):
    mod = load_benchmark("bench_vs_llamacpp")
    log = tmp_path / "calls.txt"
    tool = tmp_path / "llama-bench"
    tool.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + "
                    "'\\n')\nargs = sys.argv[1:]\nn = int(args[args.index('-n') + 1])\n"
                    "print(json.dumps([{'avg_ts': 50.0 if n else 400.0}]))\n")
    tool.chmod(0o755)
    model = tiny_gguf("llama", "Q8_0")
    out = tmp_path / "r.json"
    assert mod.main(["--llamacpp-bin", str(tmp_path), "--model", str(model), "--rounds", "2", "--new-tokens", "6",
                     "--prefill", "20", "--context", "30", "--padded", "--json", str(out),
                     "--target", "onnxruntime:cpu:int4", "--target", "onnxruntime:cpu:int4:pool"]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"llama.cpp", "onnxruntime:cpu:int4", "onnxruntime:cpu:int4 padded",
                            "onnxruntime:cpu:int4:pool", "onnxruntime:cpu:int4:pool padded"}
    assert results["onnxruntime:cpu:int4:pool"]["kernel"].startswith("attention gathered from the pool")
    assert results["llama.cpp"]["rounds"] == {"decode": [50.0, 50.0], "prefill": [400.0, 400.0]}
    ours = results["onnxruntime:cpu:int4"]
    assert len(ours["rounds"]["decode"]) == 2 and len(ours["verify_curve"]) == 9 and ours["verify_curve"][0] == 1.0
    assert "forced" not in ours["kernel"] and "(one-token calls to two) (pad_single_row: pairs)" in results[
        "onnxruntime:cpu:int4 padded"]["kernel"]
    assert log.read_text().count(f"-m {model}") == 4  # decode and prefill, in each round
    assert "| llama.cpp |" in capsys.readouterr().out
