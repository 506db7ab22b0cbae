"""A warm start on onnxruntime imports neither torch, nor onnx, nor
transformers: the lowered graph and the tokenizer come from the cache, the
tokenizer is read by ir/tokenizer.py, and the reference forward, the
lowering and the torch backend's runner are imported only when used. (Those
three imports took about 4 s of a 6.5 s warm `hetero-sd generate` on a
2-core host.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from helpers.serving import REPO

HEAVY = ("torch", "onnx", "transformers")
SCRIPT = """
import json, sys
from hetero_sd.config import load_config
from hetero_sd.engine import Engine
engine = Engine.from_config(load_config(sys.argv[1]))
text = engine.generate("Explain what a heat pump does.").text
print(json.dumps({"text": text, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _config(path, model, precision):
    path.write_text(f"target: {{model: {model}, backend: onnxruntime, device: cpu, precision: {precision}}}\n"
                    "drafter: {kind: ngram, k: 4}\ngeneration: {max_new_tokens: 8}\nmemory: {kv_budget: 1MiB}\n")
    return str(path)


@pytest.mark.parametrize("source,precision", [("hf", "int4"), ("gguf", "gguf")])
def test_warm_onnxruntime_start_imports_no_torch(tiny_model_dir, tiny_gguf, tmp_path, source, precision):
    model = tiny_model_dir("llama") if source == "hf" else tiny_gguf("llama", "Q8_0")
    config = _config(tmp_path / "ort.yaml", model, precision)
    engine = Engine.from_config(load_config(config))  # warms the caches: graph, row check, tokenizer
    want = engine.generate("Explain what a heat pump does.").text
    engine.close()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, config], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["text"] == want
    assert out["heavy"] == [], f"a warm onnxruntime start imported {out['heavy']}"
