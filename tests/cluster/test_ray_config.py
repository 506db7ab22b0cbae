"""Bad Ray configuration fails at load, naming the file, the key and the fix
(no cluster needed: nothing gets as far as Ray)."""
from __future__ import annotations

import pytest

from hetero_sd.config import load_config
from hetero_sd.errors import ConfigError
from hetero_sd.spec import spec_from_config


def _load(tmp_path, text: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("text, words", [
    ("drafter: {kind: model, ray: {resources: {gpu: 1}}}", ["drafter.ray", "process: ray"]),
    ("drafter: {kind: model, process: worker, ray: {}}", ["drafter.ray", "process: ray"]),
    ("drafter: {kind: model, process: ray, transport: tcp}", ["drafter.transport", "Ray actor", "process: worker"]),
    ("drafter: {kind: model, process: ray, cpus: [1]}", ["drafter.cpus", "Ray actor"]),
    ("drafter: {kind: model, process: ray, ray: {resourcez: {a: 1}}}", ["drafter.ray.resourcez", "unknown key",
                                                                       "resources, labels, node_id"]),
    ("drafter: {kind: model, process: ray, ray: {resources: {a: 0}}}", ["drafter.ray.resources.a", "greater than 0"]),
    ("drafter: {kind: head, process: ray}", ["drafter.process", "ngram or model"]),
    ("target: {ray: {resources: {gpu_box: 1}}}", ["target.ray", "target.process: ray"]),
    ("target: {process: ray, ray: {fallback: [{address: x}]}}", ["target.ray.fallback.0.address", "unknown key"]),
    ("placement: auto\ntarget: {process: ray}", ["target.process: ray", "placement: manual"]),
    ("target: {process: ray, ray: {address: 'a:6379'}}\ndrafter: {kind: model, process: ray, ray: {address: 'b:6379'}}",
     ["a:6379", "b:6379", "one Ray cluster"]),
    ("drafter: {kind: model, stages: [{process: ray}], process: ray}", ["drafter.process: ray", "drafter.stages.0"]),
    ("target: {process: ray, ray: {strategy: STRICT_SPREAD}}\ndrafter: {kind: model, process: ray, ray: {labels: {a: b}}}",
     ["drafter.ray.labels", "placement group", "resources, num_cpus and num_gpus"]),
    ("target: {process: ray, ray: {strategy: SPREAD_OUT}}", ["target.ray.strategy", "STRICT_SPREAD"]),
    ("target: {process: ray, ray: {namespace: a}}\ndrafter: {kind: model, process: ray, ray: {namespace: b}}",
     ["ray.namespace differs between drafter and target", "set it once"]),
    ("target: {process: ray, ray: {start_local: true, address: 'h:6379'}}", ["target.ray.start_local", "h:6379"]),
    ("target: {device: 'cuda:0', process: ray}", ["target.device: cuda:0", "target.ray.num_gpus"]),
    ("target: {device: 'cuda:1', process: ray, ray: {num_gpus: 1}}", ["target.device: cuda:1", "use cuda:0"]),
])
def test_bad_ray_keys_name_the_key(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    message = str(err.value)
    for word in ["bad.yaml"] + words:
        assert word in message, (word, message)


def test_ray_sections_become_placements(tmp_path):
    spec = spec_from_config(_load(tmp_path, """
target: {process: ray, ray: {address: 'head:6379', resources: {gpu_box: 1}, num_gpus: 1, timeout_s: 9, prefill_timeout_s: 99,
                             fallback: [{labels: {role: spare}}, {node_id: abc}]}}
drafter: {kind: ngram, process: ray, mode: async, ray: {address: 'head:6379', resources: {npu: 1}}}
"""))
    t, d = spec.target_ray, spec.drafter
    assert (t.address, t.resources, t.num_gpus, t.timeout_s, t.prefill_timeout_s) == (
        "head:6379", (("gpu_box", 1.0),), 1.0, 9.0, 99.0)
    assert {(p.timeout_s, p.prefill_timeout_s) for p in t.fallback} == {(9.0, 99.0)}  # the spares' too
    assert [(p.labels, p.node_id, p.address) for p in t.fallback] == [
        ((("role", "spare"),), None, "head:6379"), ((), "abc", "head:6379")]
    assert (d.transport, d.mode, d.ray.resources, d.ray.label) == ("ray", "async", (("npu", 1.0),), "ray[npu=1]")
