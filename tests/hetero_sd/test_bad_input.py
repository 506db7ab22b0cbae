"""Bad input of every kind gives ONE clear error that names the problem and what is allowed,
through the Python API and through the CLI (exit code 2, one `hetero-sd: error:` line)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from hetero_sd.engine import Engine
from hetero_sd.cli import main
from hetero_sd.config import load_config
from hetero_sd.errors import (
    BackendError,
    ConfigError,
    GenerationError,
    HeteroSDError,
    KVBudgetError,
    ModelLoadError,
)

SMALL_VOCAB = 320  # the tiny models have 384


@pytest.fixture
def llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def small_vocab_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny Llama whose vocabulary differs from the tiny target's (same tokenizer files)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("small_vocab") / "llama-small-vocab"
    config = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def write_yaml(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def tiny_yaml(model: Path, **sections: str) -> str:
    """A config for the tiny model with `section="key: value\\n..."` extras merged in."""
    parts = {"target": f"  model: {model}\n", "generation": "  max_new_tokens: 4\n"}
    for section, body in sections.items():
        parts[section] = parts.get(section, "") + "".join(f"  {line}\n" for line in body.splitlines())
    return "".join(f"{section}:\n{body}" for section, body in parts.items())


def error_of(fn: Callable[[], object], kind: type[HeteroSDError]) -> str:
    with pytest.raises(kind) as info:
        fn()
    return str(info.value)


# ------------------------------------------------------------------ one case per kind of mistake
@dataclass
class Case:
    """`yaml(tmp_path, model_dir, small_vocab_dir)` -> file text; run through the API by
    `stage` ("load": load_config, "build": Engine.from_config, "generate": generate)."""

    name: str
    yaml: Callable[[Path, Path, Path], str]
    error: type[HeteroSDError]
    expected: Callable[[Path, Path, Path], list[str]]  # substrings the message must contain
    stage: str = "load"
    prompt: str = "hello"
    cli_args: list[str] = field(default_factory=list)


CASES = [
    Case("broken-yaml",
         lambda t, m, s: "target:\n  model: [unclosed\ndrafter: {k: 3\n",
         ConfigError, lambda t, m, s: ["bad.yaml", "not valid YAML"]),
    Case("top-level-not-a-mapping",
         lambda t, m, s: "- target\n- drafter\n",
         ConfigError, lambda t, m, s: ["bad.yaml", "mapping", "target, drafter, generation, memory"]),
    Case("unknown-key",
         lambda t, m, s: tiny_yaml(m, drafter="kk: 3"),
         ConfigError, lambda t, m, s: ["bad.yaml", "drafter.kk", "unknown key",
                                       "allowed: kind, k, k_max, min_ngram, max_ngram, suffix_max_depth",
                                       "model, head, hybrid_min_match, hybrid_with, backend, device, precision"]),
    Case("unknown-section",
         lambda t, m, s: tiny_yaml(m, drafterr="k: 3"),
         ConfigError, lambda t, m, s: ["bad.yaml", "drafterr", "allowed: placement, target, drafter, generation, memory, auto"]),
    Case("k-zero",
         lambda t, m, s: tiny_yaml(m, drafter="k: 0"),
         ConfigError, lambda t, m, s: ["bad.yaml", "drafter.k", "greater than or equal to 1"]),
    Case("k-too-big",
         lambda t, m, s: tiny_yaml(m, drafter="k: 99"),
         ConfigError, lambda t, m, s: ["bad.yaml", "drafter.k", "less than or equal to 16"]),
    Case("k-wrong-type",
         lambda t, m, s: tiny_yaml(m, drafter="k: five"),
         ConfigError, lambda t, m, s: ["bad.yaml", "drafter.k", "valid integer"]),
    Case("stop-not-a-list",
         lambda t, m, s: tiny_yaml(m, generation="stop: 7"),
         ConfigError, lambda t, m, s: ["bad.yaml", "generation.stop", "valid list"]),
    Case("drafter-kind",
         lambda t, m, s: tiny_yaml(m, drafter="kind: magic"),
         ConfigError, lambda t, m, s: ["bad.yaml", "drafter.kind",
                                                          "'ngram', 'suffix', 'model', 'head', 'hybrid', 'none'"]),
    Case("kv-budget-unit",
         lambda t, m, s: tiny_yaml(m, memory="kv_budget: 12 parsecs"),
         ConfigError, lambda t, m, s: ["bad.yaml", "memory.kv_budget", "'12 parsecs'"]),
    Case("unknown-backend",
         lambda t, m, s: tiny_yaml(m, target="backend: tensorrt"),
         BackendError, lambda t, m, s: ["unknown backend 'tensorrt'", "available:", "torch"], stage="build"),
    Case("unknown-draft-backend",
         lambda t, m, s: tiny_yaml(m, drafter=f"kind: model\nmodel: {m}\nbackend: nope"),
         BackendError, lambda t, m, s: ["unknown backend 'nope'", "available:", "torch"], stage="build"),
    Case("unknown-device",
         lambda t, m, s: tiny_yaml(m, target="device: tpu"),
         BackendError, lambda t, m, s: ["target", "no device 'tpu'", "available: cpu"], stage="build"),
    Case("unknown-draft-device",
         lambda t, m, s: tiny_yaml(m, drafter=f"kind: model\nmodel: {m}\ndevice: tpu"),
         BackendError, lambda t, m, s: ["draft model", "no device 'tpu'", "available: cpu"], stage="build"),
    Case("unsupported-precision",
         lambda t, m, s: tiny_yaml(m, target="precision: int3"),
         BackendError, lambda t, m, s: ["target", "precision 'int3'", "supported: fp32"], stage="build"),
    Case("missing-model",
         lambda t, m, s: f"target:\n  model: {t / 'no-such-model'}\n",
         ModelLoadError, lambda t, m, s: [str(t / "no-such-model"), "does not exist"], stage="build"),
    Case("missing-relative-model",
         lambda t, m, s: "target:\n  model: models/not-there\n",
         ModelLoadError, lambda t, m, s: ["models/not-there", "does not exist"], stage="build"),
    Case("missing-draft-model",
         lambda t, m, s: tiny_yaml(m, drafter=f"kind: model\nmodel: {t / 'no-draft'}"),
         ModelLoadError, lambda t, m, s: [str(t / "no-draft"), "does not exist"], stage="build"),
    Case("model-folder-without-config",
         lambda t, m, s: f"target:\n  model: {t}\n",
         ModelLoadError, lambda t, m, s: [str(t), "no config.json"], stage="build"),
    Case("vocab-mismatch",
         lambda t, m, s: tiny_yaml(m, drafter=f"kind: model\nmodel: {s}"),
         ConfigError, lambda t, m, s: [f"vocabulary of {SMALL_VOCAB} tokens", "the target has 384",
                                       s.name, "share a tokenizer"], stage="build"),
    Case("kv-budget-holds-nothing",
         lambda t, m, s: tiny_yaml(m, memory="kv_budget: 100B"),
         BackendError, lambda t, m, s: ["memory.kv_budget", "100 bytes", "holds no position"], stage="build"),
    Case("kv-budget-exhausted",
         lambda t, m, s: tiny_yaml(m, memory="kv_budget: 4KiB"),
         KVBudgetError, lambda t, m, s: ["KV budget exhausted", "memory.kv_budget", "only 8 of 8 are free"],
         stage="generate"),
    Case("prompt-longer-than-context",
         lambda t, m, s: tiny_yaml(m),
         GenerationError, lambda t, m, s: ["the prompt has", "context holds 256", "shorten the prompt"],
         stage="generate", prompt="hello " * 300, cli_args=["--no-chat-template"]),
]


def _materialise(case: Case, tmp_path: Path, llama_dir: Path, small_vocab_dir: Path):
    path = write_yaml(tmp_path, case.yaml(tmp_path, llama_dir, small_vocab_dir))
    return path, case.expected(tmp_path, llama_dir, small_vocab_dir)


def _run_api(case: Case, path: Path) -> None:
    cfg = load_config(path)
    if case.stage == "load":
        return
    engine = Engine.from_config(cfg)
    if case.stage == "build":
        return
    engine.generate(case.prompt, chat_template=False if case.cli_args else None)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_api_raises_one_clear_error(case, tmp_path, llama_dir, small_vocab_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, expected = _materialise(case, tmp_path, llama_dir, small_vocab_dir)
    with pytest.raises(HeteroSDError) as info:
        _run_api(case, path)
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    for part in expected:
        assert part in msg, f"{part!r} not in error message:\n{msg}"
    assert "Traceback" not in msg


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cli_exits_2_with_one_error_line(case, tmp_path, llama_dir, small_vocab_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path, expected = _materialise(case, tmp_path, llama_dir, small_vocab_dir)
    code = main(["generate", "--config", str(path), "--prompt", case.prompt, "--json", *case.cli_args])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    error_lines = [line for line in err.splitlines() if line.startswith("hetero-sd: error:")]
    assert len(error_lines) == 1, err
    assert err.startswith("hetero-sd: error:"), err  # nothing printed before it
    for part in expected:
        assert part in err, f"{part!r} not in stderr:\n{err}"


# ------------------------------------------------------------------ direct API checks
def test_prompt_of_max_position_embeddings_tokens(tmp_path, llama_dir):
    engine = Engine.from_config(load_config(write_yaml(tmp_path, tiny_yaml(llama_dir), "ok.yaml")))
    limit = engine.target.max_context
    assert limit == 256
    msg = error_of(lambda: engine.generate_ids([5] * limit), GenerationError)
    assert f"the prompt has {limit} tokens" in msg and f"context holds {limit}" in msg
    # One token fewer fits: generation runs and stops at the context's end at the latest.
    result = engine.generate_ids([5] * (limit - 1), max_new_tokens=4)
    assert 1 <= len(result.token_ids) <= 4


def test_empty_prompt_and_zero_budget(tmp_path, llama_dir):
    engine = Engine.from_config(load_config(write_yaml(tmp_path, tiny_yaml(llama_dir), "ok.yaml")))
    assert "the prompt is empty" in error_of(lambda: engine.generate_ids([]), GenerationError)
    msg = error_of(lambda: engine.generate_ids([5, 6], max_new_tokens=0), GenerationError)
    assert "max_new_tokens must be >= 1, got 0" in msg


def test_kv_budget_error_is_a_backend_error_and_the_pool_recovers(tmp_path, llama_dir):
    # 8KiB at 512 bytes a position (2 layers x 2 KV heads x 16 dims x K,V x fp32) = 16 positions.
    engine = Engine.from_config(load_config(write_yaml(tmp_path, tiny_yaml(llama_dir, memory="kv_budget: 8KiB"))))
    assert engine.target.usage().capacity_tokens == 16
    msg = error_of(lambda: engine.generate_ids(list(range(4, 24)), max_new_tokens=4), KVBudgetError)
    assert "memory.kv_budget" in msg and "needs" in msg and "16 of 16 are free" in msg
    assert issubclass(KVBudgetError, BackendError)
    # A request that fits the 16 positions still runs afterwards (nothing leaked).
    result = engine.generate_ids([4, 5], max_new_tokens=1)
    assert len(result.token_ids) == 1
    assert engine.target.usage().sequences == 0


def test_missing_config_file_via_cli(tmp_path, capsys):
    code = main(["generate", "--config", str(tmp_path / "absent.yaml"), "--prompt", "hi"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.strip() == f"hetero-sd: error: config file {str(tmp_path / 'absent.yaml')!r} does not exist"


def test_bad_cli_override_names_the_key(tmp_path, llama_dir, capsys):
    path = write_yaml(tmp_path, tiny_yaml(llama_dir), "ok.yaml")
    code = main(["generate", "--config", str(path), "--prompt", "hi", "--max-new-tokens", "0"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("hetero-sd: error:") and "generation.max_new_tokens" in err
    assert "Traceback" not in err


def test_unknown_subcommand_and_option_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["generate", "--num-beams", "4"])
    assert info.value.code == 2
    assert "unrecognized arguments: --num-beams" in capsys.readouterr().err
