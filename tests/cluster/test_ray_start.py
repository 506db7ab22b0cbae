"""The steps for two machines in docs/processes-and-ray.md, as far as one machine allows: a head
started with `ray start --head`, a second node joining it with `ray start
--address` (its own raylet, resources and label), `hetero-sd generate`
placing the target on the head's resource and the drafter on the other
node's label, then `ray stop`; with token authentication on, as the page
advises: every `ray start` and the engine get RAY_AUTH_MODE=token and the
same token (on two machines, the head's token file copied over)."""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time

from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from helpers.ray_procs import ray_daemons

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ray_cli(*args: str, env: dict | None = None) -> str:
    out = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, (args, out.stdout[-2000:], out.stderr[-2000:])
    return out.stdout + out.stderr


def test_the_readme_steps_on_one_machine(no_cluster, tiny_model_dir, tmp_path):
    from ray._private.services import get_node_ip_address

    head = f"{get_node_ip_address()}:{free_port()}"
    # the steps name the head themselves; one token for the head, the node and the engine
    env = {"RAY_ADDRESS": "", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    try:
        ray_cli("start", "--head", "--port", head.rsplit(":", 1)[1], "--num-cpus", "2",
                "--resources", '{"gpu_box": 1}', "--include-dashboard", "false", env=env)
        ray_cli("start", "--address", head, "--num-cpus", "2", "--resources", '{"draft_node": 1}',
                "--labels", '{"role": "draft"}', env=env)
        config = tmp_path / "two.yaml"
        model = tiny_model_dir("llama")
        config.write_text(f"""
target: {{model: {model}, process: ray, ray: {{address: '{head}', resources: {{gpu_box: 1}}}}}}
drafter: {{kind: model, k: 4, process: ray, mode: async, threads: 1, ray: {{labels: {{role: draft}}}}}}
generation: {{max_new_tokens: 16, chat_template: false}}
""")
        out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "generate", "--config", str(config),
                              "--prompt", "hello", "--json", "--explain"], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path, env={**os.environ, **env})
        assert out.returncode == 0, out.stderr[-3000:]
        assert "2 live nodes" in out.stderr and "another node than the target" in out.stderr, out.stderr[-2000:]
        got = json.loads(out.stdout)
        plain = tmp_path / "plain.yaml"
        plain.write_text(f"target: {{model: {model}}}\ngeneration: {{max_new_tokens: 16, chat_template: false}}\n")
        want = Engine.from_config(load_config(plain), target_only=True).generate("hello", target_only=True)
        assert got["token_ids"] == want.token_ids and got["stats"]["drafted"] > 0
    finally:
        ray_cli("stop", "--force")
    deadline = time.time() + 30
    while ray_daemons() and time.time() < deadline:
        time.sleep(0.5)
    assert not ray_daemons()
