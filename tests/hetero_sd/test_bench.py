"""`hetero-sd bench` end to end on tiny real models: files written and well
formed, tokens counted from the ids, identity flags checked against an
independent target-only run, absent and failing peers listed as skipped.
Speed is never asserted here."""
from __future__ import annotations

import json
import os
import re
import struct
import sys
from pathlib import Path

import pytest

from hetero_sd.bench.__main__ import main
from hetero_sd.engine import Engine
from hetero_sd.config import load_config

MAX_NEW = 10
PROMPTS = [
    {"id": "rep", "kind": "grounded", "prompt": "the quick brown fox jumps over the lazy dog. the quick brown fox"},
    {"id": "story", "kind": "open", "prompt": "Once upon a time there was a little robot"},
]


def write_prompts(path, prompts=PROMPTS):
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def write_config(path, model, drafter="{kind: ngram, k: 3, min_ngram: 1, max_ngram: 3}"):
    path.write_text(f"target: {{model: {model}}}\ndrafter: {drafter}\nmemory: {{kv_budget: 1MiB}}\n")
    return path


def bench(capsys, *argv) -> dict:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def target_only_ids(config, prompts, max_new) -> dict[str, list[int]]:
    """Our target-only greedy ids, computed without the bench (EOS ignored, chat template on)."""
    engine = Engine.from_config(load_config(config))
    engine.eos_ids = set()
    return {p["id"]: engine.generate_ids(engine.encode(p["prompt"], chat_template=True), max_new,
                                         target_only=True).token_ids for p in prompts}


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, tmp_path_factory):
    """One bench: target-only, an n-gram config and the transformers peer, on a tiny HF folder."""
    tmp = tmp_path_factory.mktemp("bench")
    model = tiny_model_dir("llama")
    config = write_config(tmp / "ngram.yaml", model)
    out = tmp / "out"
    code = main(["--model", str(model), "--config", str(config), "--prompts", str(write_prompts(tmp / "p.jsonl")),
                 "--peers", "genai,transformers", "--max-new-tokens", str(MAX_NEW), "--out", str(out)])
    assert code == 0
    return {"report": json.loads((out / "bench.json").read_text()), "out": out, "config": config}


def test_files_are_written_and_well_formed(tiny_run):
    out, report = tiny_run["out"], tiny_run["report"]
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # IHDR: a real image, not an empty file
    assert width > 200 and height > 100
    md = (out / "bench.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and "| run |" not in line
             and not line.startswith("| kind")]
    # One row per (run, kind) in the summary (grounded, open, all), then one headline row per kind.
    assert len(table) == len(report["summary"]) + 3
    for s in report["summary"]:
        assert f"| {s['kind']} | {s['run']} |" in md
    assert set(report) == {"meta", "runs", "skipped", "summary", "headline", "results"}
    assert report["meta"]["max_new_tokens"] == MAX_NEW and report["meta"]["eos_policy"] == "ignore"


def test_runs_and_skips(tiny_run):
    report = tiny_run["report"]
    names = [r["name"] for r in report["runs"]]
    assert names == ["ours target-only", "ours ngram", "transformers plain", "transformers prompt-lookup",
                     "transformers assisted"]
    # GenAI cannot read a safetensors folder: listed with the reason, not run, not fatal.
    (key, why), = report["skipped"].items()
    assert key == "genai (all runs)" and "OpenVINO IR" in why and str(tiny_run["config"].parent) not in why


def test_tokens_are_counted_from_the_ids(tiny_run):
    rows = tiny_run["report"]["results"]
    assert len(rows) == 5 * len(PROMPTS)
    for r in rows:
        assert r["new_tokens"] == len(r["token_ids"]) == MAX_NEW  # EOS ignored: equal lengths for all
        assert r["tok_s"] == pytest.approx(r["new_tokens"] / r["total_s"])
        assert 0 < r["prefill_s"] <= r["total_s"]
        assert r["decode_tok_s"] == pytest.approx((r["new_tokens"] - 1) / (r["total_s"] - r["prefill_s"]))


def test_identity_flags_match_an_independent_target_only_run(tiny_run):
    report = tiny_run["report"]
    expected = target_only_ids(tiny_run["config"], PROMPTS, MAX_NEW)
    rows = report["results"]
    for r in rows:
        assert r["identical_to_target_only"] == (r["token_ids"] == expected[r["id"]]), r["run"]
    base = {r["id"]: r["token_ids"] for r in rows if r["run"] == "ours target-only"}
    assert base == expected
    hf = {r["id"]: r["token_ids"] for r in rows if r["run"] == "transformers plain"}
    for r in rows:
        own = base if r["run"].startswith("ours") else hf
        assert r["identical_to_own_greedy"] == (r["token_ids"] == own[r["id"]]), r["run"]
    for s in report["summary"]:
        mine = [r for r in rows if r["run"] == s["run"] and s["kind"] in ("all", r["kind"])]
        assert s["prompts"] == len(mine)
        assert s["identical_to_target_only"] == sum(r["token_ids"] == expected[r["id"]] for r in mine)
    spec = [r for r in rows if r["run"] == "ours ngram"]
    assert all(r["drafted"] is not None for r in spec) and sum(r["drafted"] for r in spec) > 0


def test_absent_peer_is_listed_as_skipped(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # `import openvino_genai` now fails
    model = tiny_model_dir("llama")
    report = bench(capsys, "--model", str(model), "--config", str(write_config(tmp_path / "ngram.yaml", model)),
                   "--prompts", str(write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])), "--peers", "genai",
                   "--max-new-tokens", "3", "--out", str(tmp_path / "out"))
    assert [r["name"] for r in report["runs"]] == ["ours target-only", "ours ngram"]
    assert "not installed" in report["skipped"]["genai (all runs)"]
    assert (tmp_path / "out" / "bench.md").exists()


def test_failing_configuration_is_listed_not_fatal(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama")
    broken = write_config(tmp_path / "broken.yaml", model, "{kind: model, model: /nonexistent/draft, k: 2}")
    report = bench(capsys, "--model", str(model), "--config", str(write_config(tmp_path / "ngram.yaml", model)),
                   "--config", str(broken), "--prompts", str(write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])),
                   "--peers", "none", "--max-new-tokens", "3", "--out", str(tmp_path / "out"))
    assert [r["name"] for r in report["runs"]] == ["ours target-only", "ours ngram"]
    assert "/nonexistent/draft" in report["skipped"]["ours broken"]


def test_failing_peer_is_listed_not_fatal(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from hetero_sd.bench import hf_peer

    def broken(self, value):
        raise RuntimeError("boom inside generate")

    monkeypatch.setattr(hf_peer._FirstToken, "put", broken)
    model = tiny_model_dir("llama")
    report = bench(capsys, "--model", str(model), "--config", str(write_config(tmp_path / "ngram.yaml", model)),
                   "--prompts", str(write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])), "--peers", "transformers",
                   "--max-new-tokens", "3", "--out", str(tmp_path / "out"))
    assert [r["name"] for r in report["runs"]] == ["ours target-only", "ours ngram"]
    assert set(report["skipped"]) == {"transformers plain", "transformers prompt-lookup", "transformers assisted"}
    assert all("RuntimeError: boom inside generate" in why for why in report["skipped"].values())


def test_peers_on_a_tiny_gguf(tiny_gguf, tmp_path, capsys):
    """Both peers on the same GGUF: GenAI reads it directly (its draft model through the cached
    IR), transformers through a dequantized copy cached as safetensors."""
    gguf = tiny_gguf("llama", "Q8_0")
    report = bench(capsys, "--model", str(gguf), "--config", str(write_config(tmp_path / "ngram.yaml", gguf)),
                   "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--peers", "genai,transformers",
                   "--max-new-tokens", "6", "--out", str(tmp_path / "out"))
    names = [r["name"] for r in report["runs"]]
    assert names[-3:] == ["transformers plain", "transformers prompt-lookup", "transformers assisted"]
    converted = list((Path(os.environ["HETERO_SD_CACHE"]) / "transformers").glob(f"{gguf.stem}-*/config.json"))
    assert len(converted) == 1 and "quantization_config" not in converted[0].read_text()
    try:
        import openvino_genai  # noqa: F401
    except ImportError:  # the peers extra is optional: then it must be reported as skipped
        assert "genai (all runs)" in report["skipped"]
        return
    assert names[2:-3] == [f"genai-{m} {v}" for m in ("exact", "default")
                           for v in ("plain", "prompt-lookup", "draft-model")], report["skipped"]
    rows = [r for r in report["results"] if r["run"].startswith(("genai", "transformers"))]
    assert len(rows) == 9 * len(PROMPTS)
    for r in rows:
        assert r["new_tokens"] == len(r["token_ids"]) == 6
        # Acceptance is what GenAI reports: its draft-model runs do; nothing else among the peers does.
        assert (r["drafted"] is not None) == (r["run"].startswith("genai") and r["run"].endswith("draft-model"))
        own = next(o for o in report["results"] if o["run"] == r["run"].split()[0] + " plain" and o["id"] == r["id"])
        assert r["identical_to_own_greedy"] == (r["token_ids"] == own["token_ids"])


@pytest.mark.parametrize("content, message", [
    ('{"id": "a", "kind": "open", "prompt": "hi"}\n{"id": "b", "kind": "open", "prompt": \n',
     r"p\.jsonl:2: not valid JSON"),
    ('{"id": "a", "kind": "open"}\n', r"p\.jsonl:1: missing key\(s\) prompt"),
    ('["a", "open", "hi"]\n', r"p\.jsonl:1: expected a JSON object"),
    ('{"id": "a", "kind": "open", "prompt": ""}\n', r"p\.jsonl:1: 'prompt' must be a non-empty string"),
    ('{"id": "a", "kind": "open", "prompt": "x"}\n\n{"id": "a", "kind": "open", "prompt": "y"}\n',
     r"p\.jsonl:3: duplicate id 'a' \(first on line 1\)"),
    ("\n\n", r"p\.jsonl: no prompts"),
])
def test_malformed_prompts_file_is_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    assert main(["--prompts", str(path), "--peers", "none", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetero-sd: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


@pytest.mark.parametrize("argv, message", [
    (["--peers", "genai,vllm"], "--peers: unknown vllm; allowed: genai, transformers, llamacpp or none"),
    (["--config", "none", "--config", "a.yaml"], "--config none runs none of our configurations"),
    (["--config", "none", "--peers", "none"], "--config none with --peers none leaves nothing to run"),
    (["--kinds", "chat"], "--kinds: chat not in"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_bad_options_are_clear_errors(tmp_path, capsys, argv, message):
    assert main(["--prompts", str(write_prompts(tmp_path / "p.jsonl")), *argv, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_add_parser_registers_the_subcommand():
    import argparse

    from hetero_sd.bench import add_parser, run

    parser = argparse.ArgumentParser(prog="hetero-sd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--config", "a.yaml", "--config", "b.yaml", "--peers", "none"])
    assert args.func is run and args.config == ["a.yaml", "b.yaml"] and args.max_new_tokens == 128


def test_every_configuration_is_divided_by_its_own_placements_target_only():
    """A configuration on a second target placement is compared with that placement's
    target-only run, not with the first placement's (the reference)."""
    from types import SimpleNamespace

    from hetero_sd.bench.ours import _plan
    from hetero_sd.config import Config

    def engine(device, precision):
        return SimpleNamespace(target=SimpleNamespace(device=SimpleNamespace(device=device),
                                                      precision=SimpleNamespace(name=precision)), drafter=object())

    placements: dict = {}
    first = _plan(Config(), engine("cpu", "int4"), "a", ("onnxruntime", "cpu", "int4"), placements, 0.0)
    second = _plan(Config(), engine("cpu", "fp32"), "b", ("torch", "cpu", "fp32"), placements, 0.0)
    again = _plan(Config(), engine("cpu", "fp32"), "c", ("torch", "cpu", "fp32"), placements, 0.0)
    (base_a, _), (run_a, _) = first
    (base_b, _), (run_b, _) = second
    (paired_c, _), (run_c, _) = again
    assert run_a.baseline == base_a.name and run_b.baseline == base_b.name != base_a.name
    assert run_c.baseline == paired_c.name and paired_c.hidden  # a later config gets a fresh paired run


def test_packaged_prompt_sets_are_selected_by_name(tmp_path, monkeypatch):
    from hetero_sd.bench.prompts import default_prompts_path, load_prompts, prompts_path

    code = load_prompts("code")
    assert [p.kind for p in code].count("grounded") == 5 and [p.kind for p in code].count("open") == 5
    assert prompts_path("code").name == "code-prompts.jsonl" and prompts_path(None) == default_prompts_path()
    assert load_prompts("default") == load_prompts(None)
    monkeypatch.chdir(tmp_path)  # a file the user named "code" wins over the packaged set
    write_prompts(tmp_path / "code", PROMPTS[:1])
    assert [p.id for p in load_prompts("code")] == ["rep"]


def test_default_peers_include_llamacpp_only_where_installed(monkeypatch):
    import importlib.util

    from hetero_sd.bench import runner
    from hetero_sd.bench.cli import add_arguments, options

    real = importlib.util.find_spec
    for present in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if present else None) if name == "llama_cpp" else real(name, *a))
        expected = ("genai", "transformers") + (("llamacpp",) if present else ())
        assert runner.default_peers() == expected and runner.BenchOptions().peers == expected
        import argparse

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        assert options(parser.parse_args([])).peers == expected
        assert options(parser.parse_args(["--peers", "none"])).peers == ()


def test_draft_model_feeds_our_draft_model_configs(tiny_model_dir, tmp_path):
    """--draft-model replaces the draft of our draft-model configurations (peers get it too)."""
    from hetero_sd.bench.ours import load_configs

    model, other = tiny_model_dir("llama"), tiny_model_dir("llama", seed=1)
    drafted = write_config(tmp_path / "dm.yaml", model, "{kind: model, k: 2}")
    ngram = write_config(tmp_path / "ng.yaml", model)
    cfgs = load_configs([str(drafted), str(ngram)], str(model), 4, str(other))
    assert cfgs[0].drafter.model == str(other) and cfgs[1].drafter.kind == "ngram"
    assert load_configs([str(drafted)], str(model), 4)[0].drafter.model == str(model)  # the default: the target
    from hetero_sd.bench.ours import _drafter_label

    assert f"draft model {Path(other).name} on " in _drafter_label(cfgs[0])  # the report names the draft in use


def test_peers_get_a_fixed_draft_length_when_ours_adapts(tmp_path):
    """A `k: auto` configuration hands the peers their fixed defaults, not the
    string (a peer given "auto" failed every run)."""
    from hetero_sd.bench.runner import _peer_spec
    from hetero_sd.config import load_config

    ngram, model = tmp_path / "n.yaml", tmp_path / "m.yaml"
    ngram.write_text("drafter: {kind: ngram, k: auto}\n")
    model.write_text("drafter: {kind: model, k: auto}\n")
    spec = _peer_spec([load_config(ngram), load_config(model)], tmp_path / "x.gguf")
    assert (spec["ngram_k"], spec["draft_k"]) == (5, 4)
    model.write_text("drafter: {kind: model, k: 3}\n")
    assert _peer_spec([load_config(model)], tmp_path / "x.gguf")["draft_k"] == 3


def _fake_llama_bench(folder: Path, log: Path) -> Path:
    """An executable that answers as `llama-bench -o json` does, and logs its arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "llama-bench"
    tool.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                    "args = sys.argv[1:]\nn = int(args[args.index('-n') + 1])\n"
                    "print(json.dumps([{'avg_ts': 40.0 if n else 300.0}]))\n")
    tool.chmod(0o755)
    return folder


def test_llamacpp_tools_run_beside_our_target_only(tiny_model_dir, tmp_path, capsys):
    """--llamacpp-bin: llama-bench's decode and prefill on the same model file and threads,
    before our runs and after the peers, reported beside our target-only decode."""
    model = tiny_model_dir("llama")
    log = tmp_path / "calls.txt"
    folder = _fake_llama_bench(tmp_path / "bin", log)
    report = bench(capsys, "--model", str(model), "--config", str(write_config(tmp_path / "c.yaml", model)),
                   "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--peers", "none",
                   "--max-new-tokens", str(MAX_NEW), "--out", str(tmp_path / "out"), "--llamacpp-bin", str(folder))
    tools = report["llamacpp_tools"]
    assert tools["decode_tok_s"] == [40.0, 40.0] and tools["prefill_tok_s"] == [300.0, 300.0]
    ours = [r for r in report["results"] if r["run"] == "ours target-only"]
    assert tools["ours_vs_llamacpp_decode"] == pytest.approx(tools["ours_target_only_decode_tok_s"] / 40.0)
    assert ours and tools["ours_target_only_decode_tok_s"] > 0
    calls = log.read_text().splitlines()
    threads = str(len(os.sched_getaffinity(0)))
    assert calls == [f"-m {model} -t {threads} -p 0 -n {MAX_NEW} -r 1 -o json",
                     f"-m {model} -t {threads} -p 512 -n 0 -r 1 -o json"] * 2
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "llama.cpp's C++ `llama-bench`" in md
    # the ratio says which model ours was: fp32 here; a re-quantized one is said to be coarser
    assert tools["ours_precision"] == "fp32" and "Our target-only decode (precision fp32):" in md
    from hetero_sd.bench.llamacpp_tools import markdown

    for precision, coarser in (("int4", True), ("int8", True), ("gguf", False), ("fp32", False)):
        said = "\n".join(markdown({**tools, "ours_precision": precision}))
        assert f"Our target-only decode (precision {precision}" in said
        assert ("the file's weights quantized again, a coarser model" in said) == coarser


def test_a_folder_without_llama_bench_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama")
    code = main(["--model", str(model), "--config", str(write_config(tmp_path / "c.yaml", model)), "--peers", "none",
                 "--llamacpp-bin", str(tmp_path), "--out", str(tmp_path / "out")])
    assert code == 2 and "--llamacpp-bin: no llama-bench in" in capsys.readouterr().err
