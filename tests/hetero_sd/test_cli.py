"""The `hetero-sd` command line, in-process (hetero_sd.cli.main) and as the installed script."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_sd.cli import main

STATS_KEYS = {"acceptance_rate", "rounds", "finish_reason", "mode", "new_tokens", "prompt_tokens",
              "drafted", "accepted", "total_s", "lossless"}


@pytest.fixture
def cfg(tiny_model_dir, tmp_path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(f"target:\n  model: {tiny_model_dir('llama')}\n"
                    "drafter:\n  kind: ngram\n  k: 4\n"
                    "generation:\n  max_new_tokens: 12\n"
                    "memory:\n  kv_budget: 1MiB\n")
    return str(path)


def run_json(capsys, *argv: str) -> dict:
    code = main(list(argv) + ["--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, out  # exactly one JSON object, nothing else on stdout
    return json.loads(lines[0])


# ------------------------------------------------------------------ generate
def test_generate_json(cfg, capsys):
    result = run_json(capsys, "generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "5")
    assert set(result) == {"text", "token_ids", "stats"}
    assert isinstance(result["text"], str)
    assert 1 <= len(result["token_ids"]) <= 5
    assert all(isinstance(t, int) and 0 <= t < 384 for t in result["token_ids"])
    stats = result["stats"]
    assert STATS_KEYS <= set(stats)
    assert stats["mode"] == "ngram"
    assert stats["new_tokens"] == len(result["token_ids"])
    assert stats["finish_reason"] in ("length", "eos")
    if stats["finish_reason"] == "length":
        assert len(result["token_ids"]) == 5
    assert stats["rounds"] >= 1 or len(result["token_ids"]) <= 1
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["lossless"] == "exact"  # the CPU fp32 target is batch-invariant


def test_target_only_gives_the_same_tokens(cfg, capsys):
    args = ("generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "5")
    spec = run_json(capsys, *args)
    base = run_json(capsys, *args, "--target-only")
    assert base["token_ids"] == spec["token_ids"]
    assert base["text"] == spec["text"]
    assert base["stats"]["mode"] == "target-only"
    assert base["stats"]["drafted"] == 0


def test_target_only_matches_speculation_when_drafts_are_accepted(cfg, capsys):
    """A repetitive raw prompt makes the n-gram drafter propose; the output must not change."""
    prompt = "the cat sat on the mat. " * 6
    args = ("generate", "--config", cfg, "--prompt", prompt, "--max-new-tokens", "40", "--no-chat-template")
    spec = run_json(capsys, *args)
    base = run_json(capsys, *args, "--target-only")
    assert spec["token_ids"] == base["token_ids"]
    assert spec["stats"]["drafted"] > 0
    assert base["stats"]["rounds"] == len(base["token_ids"]) - 1 or base["stats"]["finish_reason"] == "eos"


def test_prompt_from_stdin(cfg, capsys, monkeypatch):
    from_flag = run_json(capsys, "generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "5")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello"))
    from_stdin = run_json(capsys, "generate", "--config", cfg, "--max-new-tokens", "5")
    assert from_stdin["token_ids"] == from_flag["token_ids"]
    assert from_stdin["stats"]["prompt_tokens"] == from_flag["stats"]["prompt_tokens"]


def test_empty_stdin_is_a_clear_error(cfg, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    code = main(["generate", "--config", cfg])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip() == "hetero-sd: error: no prompt: pass --prompt TEXT or pipe text on stdin"


def test_max_new_tokens_flag_overrides_the_file(cfg, capsys):
    result = run_json(capsys, "generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "2")
    assert len(result["token_ids"]) <= 2
    # Without the flag the file's 12 applies.
    result = run_json(capsys, "generate", "--config", cfg, "--prompt", "hello")
    assert 2 < len(result["token_ids"]) <= 12 or result["stats"]["finish_reason"] == "eos"


def test_no_chat_template_changes_the_prompt(cfg, capsys):
    chat = run_json(capsys, "generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "1")
    raw = run_json(capsys, "generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "1",
                   "--no-chat-template")
    assert raw["stats"]["prompt_tokens"] < chat["stats"]["prompt_tokens"]


def test_plain_output_text_on_stdout_summary_on_stderr(cfg, capsys):
    code = main(["generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "5"])
    out, err = capsys.readouterr()
    assert code == 0
    json_result = run_json(capsys, "generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "5")
    assert out == json_result["text"] + "\n"
    assert "tokens in" in err and "finish:" in err and "ngram" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------ devices
def test_devices_json_lists_torch_cpu_fp32(capsys):
    code = main(["devices", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"devices", "broken", "families"}
    cpu = [d for d in data["devices"] if d["backend"] == "torch" and d["device"] == "cpu"]
    assert len(cpu) == 1
    cpu = cpu[0]
    assert cpu["default_precision"] == "fp32"
    names = [p["name"] for p in cpu["precisions"]]
    assert "fp32" in names
    fp32 = cpu["precisions"][names.index("fp32")]
    assert fp32["batch_invariant"] is True
    assert set(fp32) == {"name", "batch_invariant", "note"}
    assert "torch" not in data["broken"]


def test_devices_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code = main(["devices"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "torch" in out and "cpu" in out and "fp32*" in out


# ------------------------------------------------------------------ help and usage
@pytest.mark.parametrize("argv, expected", [
    (["--help"], ["generate", "devices"]),
    (["generate", "--help"], ["--config", "--prompt", "--max-new-tokens", "--target-only",
                              "--no-chat-template", "--json", "--progress"]),
    (["devices", "--help"], ["--json"]),
])
def test_help_exits_0(argv, expected, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hetero-sd")
    for word in expected:
        assert word in out


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage: hetero-sd" in capsys.readouterr().err


# ------------------------------------------------------------------ the installed console script
def test_console_script_devices():
    exe = shutil.which("hetero-sd")
    assert exe is not None, "the `hetero-sd` console script is not on PATH (pip install -e .)"
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.run([exe, "devices"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "torch" in proc.stdout and "cpu" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_console_script_reports_errors_with_exit_2(tmp_path):
    exe = shutil.which("hetero-sd")
    assert exe is not None
    proc = subprocess.run([exe, "generate", "--config", str(tmp_path / "absent.yaml"), "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("hetero-sd: error: config file")
    assert "Traceback" not in proc.stderr


def test_python_dash_m(tmp_path):
    """`python -m hetero_sd.cli` runs the same main (sys.exit of its return code)."""
    proc = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "devices", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=Path(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert any(d["device"] == "cpu" for d in json.loads(proc.stdout)["devices"])


# ------------------------------------------------------------------ sampling
def test_sampling_flags_reproduce_with_a_seed(cfg, capsys):
    args = ("generate", "--config", cfg, "--prompt", "hello", "--max-new-tokens", "12", "--no-chat-template",
            "--temperature", "1.2", "--top-k", "50", "--top-p", "0.95")
    first = run_json(capsys, *args, "--seed", "11")
    again = run_json(capsys, *args, "--seed", "11")
    assert first["token_ids"] == again["token_ids"]
    assert first["stats"]["sampling"] == "T=1.2 top_k=50 top_p=0.95 seed=11"
    others = {tuple(run_json(capsys, *args, "--seed", str(s))["token_ids"]) for s in range(3)}
    assert len(others | {tuple(first["token_ids"])}) > 1, "different seeds gave the same text every time"


def test_sampling_from_yaml(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "sampled.yaml"
    path.write_text(f"target:\n  model: {tiny_model_dir('llama')}\n"
                    "generation:\n  max_new_tokens: 8\n  temperature: 0.9\n  top_p: 0.8\n  seed: 5\n")
    a = run_json(capsys, "generate", "--config", str(path), "--prompt", "hi")
    b = run_json(capsys, "generate", "--config", str(path), "--prompt", "hi")
    assert a["token_ids"] == b["token_ids"] and a["stats"]["sampling"] == "T=0.9 top_k=0 top_p=0.8 seed=5"


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "temperature must be >= 0"),
    ("--top-p", "0", "top_p must be in (0, 1]"),
    ("--top-p", "1.01", "top_p must be in (0, 1]"),
    ("--top-k", "-4", "top_k must be an integer >= 0"),
])
def test_bad_sampling_flags_exit_2(cfg, capsys, flag, value, message):
    assert main(["generate", "--config", cfg, "--prompt", "hi", flag, value]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("key, value, message", [
    ("temperature", "-0.1", "generation.temperature"),
    ("top_p", "2", "generation.top_p"),
    ("top_k", "-1", "generation.top_k"),
    ("seed", "-5", "generation.seed"),
])
def test_bad_sampling_yaml_names_the_key(tiny_model_dir, tmp_path, capsys, key, value, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"target:\n  model: {tiny_model_dir('llama')}\ngeneration:\n  {key}: {value}\n")
    assert main(["generate", "--config", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err


def test_models_and_devices_list_the_families_that_load(capsys):
    for command in (["models", "--json"], ["devices", "--json"]):
        assert main(command) == 0
        rows = {f["family"]: f for f in json.loads(capsys.readouterr().out)["families"]}
        assert set(rows) == {"llama", "qwen3", "qwen3_moe", "mixtral", "gemma3", "phi3", "smollm3"}
        assert rows["gemma3"]["hf_model_types"] == ["gemma3_text"] and rows["qwen3_moe"]["gguf_archs"] == ["qwen3moe"]
        assert rows["mixtral"]["gguf_archs"] == ["llama (with experts)"]
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "model families" in out and "qwen3moe" in out
