"""The model and draft flags (hetero_sd/flags.py): each, alone and with a YAML file, gives
the config (and the output ids) of the equivalent YAML; --print-config round-trips; a
flag or key that configures another drafter kind is an error naming the kind; a model
and a draft model run from flags alone, with no YAML."""
from __future__ import annotations

import json

import pytest
import yaml

from hetero_sd import flags
from hetero_sd.cli import build_parser, main
from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from hetero_sd.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = {"target": {"backend": "torch", "device": "cpu", "precision": "fp32"},
        "drafter": {"kind": "ngram", "k": 4, "min_ngram": 1, "max_ngram": 3},
        "generation": {"max_new_tokens": 8, "chat_template": False}, "memory": {"kv_budget": "4MiB"}}


def _yaml(tmp_path, data: dict, name="c.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _args(command: str, *argv: str):
    return build_parser().parse_args([command, *argv])


def _same(a, b) -> bool:
    return a.model_dump(exclude={"source"}) == b.model_dump(exclude={"source"})


def _with(data: dict, dotted: str, value) -> dict:
    out = json.loads(json.dumps(data))
    section, key = dotted.split(".")
    out.setdefault(section, {})[key] = value
    return out


@pytest.mark.parametrize("argv,key,value", [
    (["-m", "{model}"], "target.model", "{model}"),
    (["--backend", "onnxruntime"], "target.backend", "onnxruntime"),
    (["-dev", "cpu"], "target.device", "cpu"),
    (["--precision", "int8"], "target.precision", "int8"),
    (["--kv-budget", "8MiB"], "memory.kv_budget", "8MiB"),
    (["--draft-max", "6"], "drafter.k", 6),
    (["--draft", "auto"], "drafter.k", "auto"),
    (["--drafter", "ngram"], "drafter.kind", "ngram"),
])
def test_each_flag_equals_its_yaml_key(tmp_path, tiny_model_dir, argv, key, value):
    model = str(tiny_model_dir("llama"))
    argv = [a.replace("{model}", model) for a in argv]
    value = value.replace("{model}", model) if isinstance(value, str) else value
    data = {**BASE, "target": {**BASE["target"], "model": model}}
    base = _yaml(tmp_path, data)
    for command in ("generate", "chat", "serve", "profile"):
        got = flags.load(_args(command, "--config", base, *argv))
        assert _same(got, load_config(_yaml(tmp_path, _with(data, key, value), "want.yaml"))), (command, argv)


def test_draft_flags_switch_the_kind_and_run_as_the_yaml_does(tmp_path, tiny_model_dir):
    """-md on an n-gram YAML: a draft model, and the n-gram keys of the file dropped."""
    model = str(tiny_model_dir("llama"))
    base = _yaml(tmp_path, {**BASE, "target": {**BASE["target"], "model": model}})
    got = flags.load(_args("generate", "--config", base, "-md", model, "--draft-backend", "torch",
                           "--draft-precision", "fp32", "--draft-max", "3"))
    want = load_config(_yaml(tmp_path, {**BASE, "target": {**BASE["target"], "model": model}, "drafter": {
        "kind": "model", "model": model, "backend": "torch", "precision": "fp32", "k": 3}}, "want.yaml"))
    assert _same(got, want)
    prompt = [1, 5, 9, 5, 9, 5, 9, 12]
    outs = []
    for cfg in (got, want):
        engine = Engine.from_config(cfg)
        try:
            outs.append(engine.generate_ids(prompt, 8).token_ids)
        finally:
            engine.close()
    assert outs[0] == outs[1]


def test_print_config_round_trips(tmp_path, tiny_model_dir, capsys):
    model = tiny_model_dir("llama")
    data = {**BASE, "target": {**BASE["target"], "model": model.name}}  # relative to the YAML
    (tmp_path / model.name).symlink_to(model)
    base = _yaml(tmp_path, data)
    with pytest.raises(SystemExit) as stop:
        flags.load(_args("generate", "--config", base, "--draft-max", "2", "--print-config"))
    assert stop.value.code == 0
    printed = capsys.readouterr().out
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    again = load_config(_yaml(elsewhere, yaml.safe_load(printed)))
    first = flags.load(_args("generate", "--config", base, "--draft-max", "2"))
    assert again.drafter.k == 2 and str(model) in again.target.model
    ids = []
    for cfg in (first, again):
        engine = Engine.from_config(cfg)
        try:
            ids.append(engine.generate_ids([1, 4, 4, 7, 4, 4, 7], 8).token_ids)
        finally:
            engine.close()
    assert ids[0] == ids[1]


def test_a_flag_for_another_kind_says_why(tmp_path, tiny_model_dir):
    base = _yaml(tmp_path, {**BASE, "target": {**BASE["target"], "model": str(tiny_model_dir("llama"))}})
    with pytest.raises(ConfigError, match=r"drafter.backend configures drafter.kind: model or head or hybrid.*"
                                          r"--draft-backend sets drafter.backend"):
        flags.load(_args("generate", "--config", base, "--draft-backend", "onnxruntime"))


@pytest.mark.parametrize("drafter,kind", [({"model": "x"}, "model"), ({"kind": "suffix", "min_ngram": 2}, "ngram"),
                                          ({"kind": "ngram", "suffix_factor": 2.0}, "suffix"),
                                          ({"kind": "model", "hybrid_min_match": 3}, "hybrid"),
                                          ({"kind": "ngram", "min_prob": 0.5}, "model")])
def test_a_drafter_key_under_another_kind_names_its_kind(tmp_path, drafter, kind):
    with pytest.raises(ConfigError, match=f"add kind: {kind}"):
        load_config(_yaml(tmp_path, {"drafter": drafter}))


def test_model_and_draft_from_flags_alone(tiny_gguf, capsys):
    """llama.cpp's shape: -m, -md, --draft-max, -p; the packaged YAML supplies the rest."""
    model = str(tiny_gguf("llama"))
    assert main(["generate", "-m", model, "-md", model, "--draft-backend", "onnxruntime", "--draft-precision",
                 "gguf", "--draft-max", "6", "-p", "hello", "-n", "6", "--no-chat-template", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 6
    assert main(["generate", "-m", model, "--target-only", "-p", "hello", "-n", "6", "--no-chat-template",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]


def test_the_docs_table_lists_every_flag():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert flags.table() in doc
