"""Without a running cluster: process: ray fails with the commands that start
one, unless the config says start_local, in which case `hetero-sd generate`
starts a one-machine cluster, runs, and leaves no Ray process behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from helpers.ray_procs import ray_daemons
from hetero_sd.errors import ConfigError


def _config(tmp_path, model, start_local: bool) -> str:
    path = tmp_path / "local.yaml"
    path.write_text(f"""
target: {{model: {model}, process: ray, ray: {{start_local: {str(start_local).lower()}, num_cpus: 0.5}}}}
drafter: {{kind: model, k: 3, process: ray, threads: 1, ray: {{num_cpus: 0.5}}}}
generation: {{max_new_tokens: 16, chat_template: false}}
""")
    return str(path)


def test_no_cluster_is_a_clear_error(no_cluster, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        Engine.from_config(_config(tmp_path, tiny_model_dir("llama"), start_local=False))
    for words in ("no Ray cluster is running", "ray start --head", "ray start --address", "start_local: true"):
        assert words in str(err.value)


def test_start_local_runs_and_cleans_up(no_cluster, tiny_model_dir, tmp_path):
    config = _config(tmp_path, tiny_model_dir("llama"), start_local=True)
    cmd = [sys.executable, "-m", "hetero_sd.cli", "generate", "--config", config, "--prompt", "hello", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    plain = tmp_path / "plain.yaml"  # the same target in this process, alone
    plain.write_text(f"target: {{model: {tiny_model_dir('llama')}}}\n"
                     "generation: {max_new_tokens: 16, chat_template: false}\n")
    want = Engine.from_config(load_config(plain), target_only=True).generate("hello", target_only=True)
    assert got["token_ids"] == want.token_ids and got["stats"]["drafted"] > 0
    deadline = time.time() + 30
    while ray_daemons() and time.time() < deadline:
        time.sleep(0.5)
    assert not ray_daemons(), "the cluster hetero-sd started is still running after it exited"
