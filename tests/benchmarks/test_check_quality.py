"""benchmarks/check_quality.py: each precision's distance from the reference, teacher-forced
over a text, on a tiny GGUF (real loading, real lowering)."""
from __future__ import annotations

from helpers.benchmarks import load_benchmark


def test_the_reference_against_itself_is_zero_and_a_coarser_precision_is_not(tiny_gguf, tmp_path, capsys):
    mod = load_benchmark("check_quality")
    text = tmp_path / "text.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 20)
    assert mod.main(["--model", str(tiny_gguf("llama", "Q8_0")), "--precision", "fp32", "--precision", "int4",
                     "--tokens", "96", "--text", str(text)]) == 0
    rows = [[c.strip() for c in line.split("|")[1:6]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line][1:]  # (after the header)
    assert [r[0] for r in rows] == ["fp32", "fp32", "int4"]
    reference, itself, int4 = rows
    assert reference[1:4] == ["-", "-", "-"]
    assert itself[1:4] == ["0.0000", "0.0000", "1.000"] and itself[4] == reference[4]  # deterministic
    kl, p99, agree, nll = (float(v) for v in int4[1:])
    assert kl > 0 and p99 >= kl and 0 <= agree <= 1 and nll > 0
