"""The config's `options:` section (hetero_sd/options.py): typed keys with today's
defaults, unknown keys refused by name and file, the old HETERO_SD_* switches read
once when a config loads (the YAML's own keys win), and every placed model's spec
carrying the record (backends/options.py) the backends take."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_sd.backends.options import DEFAULT, BackendOptions
from hetero_sd.config import load_config
from hetero_sd.errors import ConfigError
from hetero_sd.options import ENV_KEYS, config_options
from hetero_sd.spec import spec_from_config


def _config(tmp_path: Path, text: str, environ=None):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path, environ={} if environ is None else environ)


def test_left_out_every_option_is_todays_default(tmp_path):
    assert config_options(_config(tmp_path, "")) == DEFAULT == BackendOptions()
    assert DEFAULT.native == ("matmul", "attention") and DEFAULT.native_matmul == "auto"
    assert DEFAULT.pad_single_row == "auto" and DEFAULT.forced_padding is None
    assert (DEFAULT.native_cflags, DEFAULT.plugins, DEFAULT.fake) == ("", (), "")


def test_yaml_keys_become_the_record(tmp_path):
    got = config_options(_config(tmp_path, "options:\n  native: off\n  native_matmul: always\n"
                                           "  native_cflags: -mno-avx512f\n  pad_single_row: 1\n"
                                           "  plugins: [a=b:C]\n  fake_backend: {devices: [{}]}\n"))
    assert got == BackendOptions((), "always", "-mno-avx512f", "pairs", ("a=b:C",), json.dumps({"devices": [{}]}))
    assert got.forced_padding == "pairs"
    for value, kernels in (("auto", ("matmul", "attention")), ("[attention]", ("attention",)), ("matmul", ("matmul",))):
        assert config_options(_config(tmp_path, f"options: {{native: {value}}}\n")).native == kernels


@pytest.mark.parametrize("text,says", [
    ("options: {colour: red}\n", "options.colour: unknown key; allowed: native, native_matmul"),
    ("options: {native: flash}\n", "options.native"),
    ("options: {native_matmul: never}\n", "options.native_matmul"),
    ("options: {pad_single_row: triple}\n", "options.pad_single_row"),
])
def test_bad_keys_are_refused_naming_key_and_file(tmp_path, text, says):
    with pytest.raises(ConfigError, match="c.yaml") as err:
        _config(tmp_path, text)
    assert says in str(err.value)


def test_the_old_switches_are_read_when_the_config_loads(tmp_path):
    env = {"HETERO_SD_NATIVE": "matmul", "HETERO_SD_NATIVE_MATMUL": "always", "HETERO_SD_NATIVE_CFLAGS": "-O3",
           "HETERO_SD_PAD_SINGLE_ROW": "0", "HETERO_SD_BACKENDS": "a=b:C, d=e:F", "HETERO_SD_FAKE_BACKEND": "[{}]"}
    assert set(env) == set(ENV_KEYS)
    got = config_options(_config(tmp_path, "", env))
    assert got == BackendOptions(("matmul",), "always", "-O3", "none", ("a=b:C", "d=e:F"), "[{}]")
    # the YAML's own keys win over the environment's
    mine = config_options(_config(tmp_path, "options: {pad_single_row: single, native: on}\n", env))
    assert (mine.pad_single_row, mine.native, mine.native_matmul) == ("single", ("matmul", "attention"), "always")


def test_every_placed_model_carries_the_options(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    cfg = _config(tmp_path, f"target: {{model: {model}}}\n"
                            f"drafter: {{kind: model, model: {model}, process: worker}}\n"
                            "options: {native: attention, pad_single_row: none}\n")
    spec = spec_from_config(cfg)
    want = BackendOptions(native=("attention",), pad_single_row="none")
    assert spec.target.options == want and spec.drafter.inner.options == want


def test_a_relative_fake_backend_file_is_the_yamls(tmp_path):
    (tmp_path / "fake.yaml").write_text("devices: [{}]\n")
    got = config_options(_config(tmp_path, "options: {fake_backend: fake.yaml}\n"))
    assert got.fake == str(tmp_path / "fake.yaml")
