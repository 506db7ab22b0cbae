"""llama.cpp's speculation peer (benchmarks/bench_llamacpp_spec.py): the llama-server
flags per mode, and a whole run against a fake `llama-server` on 127.0.0.1 (no model
behind it) whose draft mode changes one output, so the "= own greedy" and "= ours"
counts are checked against known answers. Speed is never asserted."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_llamacpp_spec.py"
_spec = importlib.util.spec_from_file_location("bench_llamacpp_spec", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

FAKE = r'''#!PYTHON
"""A stand-in llama-server: /v1/models, and /completion answering n_predict tokens
(prompt length + i, i = 0..) with timings; with a draft model it drafts, and for a
prompt of an odd length its output differs from plain greedy at the last token."""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
drafting = "--spec-type" in argv
draft_model = "--model-draft" in argv
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self._send({"data": [{"id": "fake"}]})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0.0 and req["ignore_eos"] and not req["cache_prompt"], req
        n, ids = req["n_predict"], req["prompt"]
        tokens = [len(ids) + i for i in range(n)]
        if draft_model and len(ids) % 2:
            tokens[-1] += 1
        timings = {"predicted_per_second": 50.0 if drafting else 40.0}
        if drafting:
            timings.update(draft_n=10, draft_n_accepted=8)
        self._send({"tokens": tokens, "timings": timings, "content": ""})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_server_flags_per_mode(tmp_path):
    model, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    plain = bench.server_argv(tmp_path, model, None, "plain", 1234, 512, "--spec-draft-n-max 4")
    assert plain[0] == str(tmp_path / "llama-server") and "--spec-type" not in plain
    assert "--spec-draft-n-max" not in plain  # (speculative flags only where it speculates)
    assert plain[plain.index("--threads") + 1] == str(bench.cores()) and plain[plain.index("--parallel") + 1] == "1"
    ngram = bench.server_argv(tmp_path, model, None, "ngram-simple", 1234, 512)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple" and "--model-draft" not in ngram
    dm = bench.server_argv(tmp_path, model, draft, "draft-simple", 1234, 512, "--spec-draft-n-max 4")
    assert dm[dm.index("--spec-type") + 1] == "draft-simple" and dm[dm.index("--model-draft") + 1] == str(draft)
    assert dm[-2:] == ["--spec-draft-n-max", "4"]
    with pytest.raises(SystemExit, match="draft-model"):
        bench.server_argv(tmp_path, model, None, "draft-simple", 1234, 512)


def test_a_run_against_a_fake_server(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    server = bin_dir / "llama-server"
    server.write_text(FAKE.replace("PYTHON", sys.executable))
    server.chmod(0o755)
    from hetero_sd.bench.prompts import load_prompts, packaged_prompts
    from hetero_sd.engine import encode_text
    from hetero_sd.ir import load_model_ir

    prompts = load_prompts(packaged_prompts("default"))
    tok = load_model_ir(model).load_tokenizer()
    lengths = {p.id: len(encode_text(tok, p.prompt, chat_template=True)) for p in prompts}
    odd = sum(n % 2 for n in lengths.values())
    assert 0 < odd < len(prompts)  # (both outcomes occur, or the counts below prove nothing)
    ours = tmp_path / "bench.json"  # our target-only ids: equal to the fake's plain ones but for the first prompt
    first = prompts[0].id
    ours.write_text(json.dumps({"results": [
        {"run": "ours target-only", "id": p.id,
         "token_ids": [lengths[p.id] + i + (p.id == first) for i in range(6)]} for p in prompts]}))
    out = bench.main(["--llamacpp-bin", str(bin_dir), "--model", str(model), "--draft-model", str(model),
                      "--prompts", "default", "--max-new-tokens", "6", "--ours", str(ours),
                      "--json", str(tmp_path / "out.json")])
    table = capsys.readouterr().out
    n = len(prompts)
    assert f"| plain | all | 40.0 | - | {n}/{n} | {n - 1}/{n} |" in table
    assert f"| ngram-simple | all | 50.0 | 80% | {n}/{n} | {n - 1}/{n} |" in table
    assert f"| draft-simple | all | 50.0 | 80% | {n - odd}/{n} |" in table
    assert set(json.loads((tmp_path / "out.json").read_text())["runs"]) == set(bench.MODES)


def test_bad_flags_fail_before_any_server_starts(tmp_path, capsys):
    """A draft mode without a draft model, an unknown mode or a folder without llama-server is
    refused up front, so no measured mode is lost to a later error."""
    (tmp_path / "llama-server").write_text("#!/bin/sh\nexit 1\n")
    for argv, said in ((["--modes", "plain,draft-simple"], "needs --draft-model"),
                       (["--modes", "plain,lookup"], "each one of"),
                       (["--modes", "plain", "--llamacpp-bin", str(tmp_path / "nowhere")], "no llama-server in")):
        with pytest.raises(SystemExit):
            bench.main(["--llamacpp-bin", str(tmp_path), "--model", "default", *argv])
        assert said in capsys.readouterr().err
