"""The serving load benchmark: its statistics and table on made-up timings, and its load
generator, server start/stop and whole run against a tiny fake OpenAI-compatible SSE
server on 127.0.0.1 (no model). Speed is never asserted."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"
_spec = importlib.util.spec_from_file_location("bench_serve", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_serve", bench)  # dataclasses look their module up there
_spec.loader.exec_module(bench)

WORDS = ["Hello", " there", ",", " friend"]


class FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/models, /health, /metrics and streaming /v1/chat/completions. The prompt steers it:
    "fail" gets a 500, "cut" a stream that ends without finish_reason (as llama_cpp.server's
    interrupted streams do), anything else len(WORDS) content chunks, then usage if asked."""
    prompts: ClassVar[list[str]] = []  # what the server was sent, in arrival order

    def log_message(self, *args):  # quiet test output
        pass

    def _send(self, code: int, body: bytes, kind="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode())
        elif self.path == "/metrics":
            self._send(200, b"# TYPE hetero_sd:spec_decode_num_draft_tokens counter\n"
                            b"hetero_sd:spec_decode_num_draft_tokens_total 10.0\n"
                            b"hetero_sd:spec_decode_num_draft_tokens_created 1.7e9\n"
                            b"hetero_sd:spec_decode_num_accepted_tokens_total 4.0\n", "text/plain")
        else:
            self._send(200 if self.path == "/health" else 404, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        FakeOpenAI.prompts.append(prompt)
        if prompt == "fail":
            return self._send(500, b'{"error": {"message": "boom"}}')
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes

        def event(delta, finish=None, usage=None):
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                     "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if usage:
                chunk["usage"] = usage
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)

        event({"role": "assistant"})
        n = min(len(WORDS), body["max_tokens"])
        for word in WORDS[:n]:
            event({"content": word})
        if prompt != "cut":
            event({}, "length" if n == body["max_tokens"] else "stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                event({}, usage={"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server():
    FakeOpenAI.prompts = []
    server = ThreadingHTTPServer((bench.HOST, 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{bench.HOST}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 1.5]
    for q in (0, 50, 90, 99, 100):
        assert bench.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert bench.percentile([], 50) is None and bench.percentile([2.0], 99) == 2.0


def test_summary_of_made_up_requests():
    R = bench.Result
    results = [R(True, 2.0, 0.5, 11, "usage", "length"), R(True, 1.0, 0.2, 5, "usage", "stop"),
               R(True, 0.3, 0.3, 1, "usage", "stop"),  # one token: no TPOT
               R(False, 9.0, error="timeout"), R(False, 1.0, error="timeout"), R(False, 0.1, error="boom")]
    s = bench.summarize(results, 4.0)
    assert (s["requests"], s["done"], s["failed"]) == (6, 3, 3)
    assert s["output_tokens"] == 17 and s["output_tok_s"] == pytest.approx(17 / 4)
    assert s["tpot_s"]["p50"] == pytest.approx((0.15 + 0.2) / 2)  # (2.0-0.5)/10 and (1.0-0.2)/4
    assert s["ttft_s"]["p50"] == pytest.approx(0.3) and s["e2e_s"]["p99"] == pytest.approx(1.0 + 0.98)
    assert s["errors"] == {"timeout": 2, "boom": 1} and s["tokens_from"] == ["usage"]
    empty = bench.summarize([R(False, 1.0, error="x")], 1.0)
    assert empty["output_tok_s"] == 0 and empty["ttft_s"] == {"p50": None, "p99": None}
    # llama.cpp's streams have no usage: "length" means max_tokens, else the content chunks
    assert bench._tokens(None, "length", 7, 128) == (128, "length")
    assert bench._tokens(None, "stop", 7, 128) == (7, "chunks") and bench._tokens(9, "stop", 7, 128) == (9, "usage")


def _level(tok_s, done=4):
    p = {"p50": 0.01, "p99": 0.02}
    return {"done": done, "failed": 0, "output_tok_s": tok_s, "ttft_s": p, "tpot_s": p, "e2e_s": p}


def test_table_and_ratios():
    results = {"spec": {1: _level(100.0), 8: {**_level(400.0), "metrics": {"acceptance": 0.75}}}, "nospec": {1: _level(50.0), 8: _level(None, 0)},
               "peer": {1: _level(80.0), 8: _level(80.0)}}
    r = bench.ratios(results)
    assert r[1] == {"ours spec / llama-cpp-python": pytest.approx(1.25),
                    "ours no-spec / llama-cpp-python": pytest.approx(0.625),
                    "ours spec / ours no-spec": pytest.approx(2.0)}
    assert r[8] == {"ours spec / llama-cpp-python": pytest.approx(5.0)}  # no figure, no ratio
    rows = bench.table_rows(results)
    assert [row[:2] for row in rows] == [["1", "ours spec"], ["1", "ours no-spec"], ["1", "llama-cpp-python"],
                                         ["8", "ours spec"], ["8", "ours no-spec"], ["8", "llama-cpp-python"]]
    assert rows[3][-4:] == ["400.0", "4.00x", "75%", "-"] and rows[4][-4:] == ["-", "-", "-", "-"] \
        and rows[0][3] == "10"
    text = bench.render(results)
    assert len({line.count("|") for line in text.splitlines() if line.startswith("|")}) == 1
    assert "C=8: ours spec / llama-cpp-python 5.00x" in text


def test_load_loop_against_a_fake_sse_server(fake_server):
    prompts = ["a", "b", "fail", "cut", "c"]
    results, wall = asyncio.run(bench.run_level(f"{fake_server}/v1", "fake", prompts, 3, 7, 16, 30, 30))
    assert sorted(r.index for r in results) == list(range(7)) and wall > 0
    assert sorted(FakeOpenAI.prompts) == sorted(prompts + prompts[:2])  # cycled, each sent once per turn
    ok = [r for r in results if r.ok]
    assert len(ok) == 5 and all(r.tokens == 4 and r.tokens_from == "usage" and r.finish == "stop" for r in ok)
    assert all(r.text == "".join(WORDS) for r in ok)  # the streamed answer, kept to compare with C = 1
    assert all(r.ttft_s is not None and r.ttft_s <= r.e2e_s and r.tpot_s is not None for r in ok)
    errors = sorted(r.error for r in results if not r.ok)
    assert errors[0].startswith("InternalServerError") and errors[1] == "stream ended without finish_reason"
    # No usage asked (llama.cpp): tokens from finish_reason "length" or the chunks.
    results, _ = asyncio.run(bench.run_level(f"{fake_server}/v1", "fake", ["a"], 2, 2, 3, 30, 30, False))
    assert [(r.ok, r.tokens, r.tokens_from) for r in results] == [(True, 3, "length")] * 2
    assert bench.scrape_acceptance(fake_server) == {"num_draft_tokens": 10, "num_accepted_tokens": 4}
    assert bench.acceptance({"num_draft_tokens": 2, "num_accepted_tokens": 1},
                            {"num_draft_tokens": 10, "num_accepted_tokens": 4}) == {
        "num_draft_tokens": 8, "num_accepted_tokens": 3, "acceptance": 3 / 8}
    assert bench.acceptance(None, None) is None


def test_requests_stop_at_the_time_limit(fake_server):
    # A zero time limit: no request starts; the loop is bounded by time, not only by count.
    results, _ = asyncio.run(bench.run_level(f"{fake_server}/v1", "fake", ["a"], 2, 100, 4, 0, 30))
    assert results == []


def _fake_argv(port):
    code = ("import http.server, runpy; "
            f"m = runpy.run_path({str(Path(__file__))!r}); "
            f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), m['FakeOpenAI']).serve_forever()")
    return [sys.executable, "-c", code]


def test_server_lifecycle_and_a_whole_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "server_argv", lambda name, port, opts, level=None: _fake_argv(port))
    out = tmp_path / "r.json"
    assert bench.main(["--levels", "1,2", "--requests-per-level", "3", "--max-tokens", "8", "--servers",
                       "spec,peer", "--json", str(out), "--logdir", str(tmp_path)]) == 0
    report = json.loads(out.read_text())
    for name, source in (("spec", ["usage"]), ("peer", ["chunks"])):
        for level in ("1", "2"):
            s = report["results"][name][level]
            assert (s["done"], s["failed"], s["output_tokens"], s["tokens_from"]) == (3, 0, 12, source)
            assert [r["index"] for r in s["per_request"]] == [0, 1, 2]
    assert report["results"]["spec"]["1"]["metrics"] == {"num_draft_tokens": 0, "num_accepted_tokens": 0}
    assert set(report["ratios"]) == {"1", "2"} and report["meta"]["requests_per_level"] == {"1": 3, "2": 3}
    assert "| 2 | llama-cpp-python | 3/0 |" in capsys.readouterr().out
    assert report["results"]["spec"]["2"]["same_as_alone"] == "3/3"  # every answer is its prompt's at C = 1


def test_answers_are_compared_with_the_same_prompt_alone():
    def level(*texts):
        return {"per_request": [{"ok": True, "index": i, "text": t} for i, t in enumerate(texts)]}

    by_level = {1: level("a", "b"), 4: level("a", "b", "a", "x"), 8: {"per_request": [
        {"ok": False, "index": 0, "text": ""}, {"ok": True, "index": 1, "text": "b"}]}}
    assert bench.same_as_alone(by_level, 2) == {1: "2/2", 4: "3/4", 8: "1/1"}
    assert bench.same_as_alone({4: level("a")}, 2) == {}  # no C = 1 run: nothing to compare with


def test_a_server_that_dies_or_ignores_sigterm(tmp_path):
    dies = [sys.executable, "-c", "print('no model'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3"), bench.serving(dies, bench.free_port(),
                                                                           tmp_path / "log", 30):
        pass
    ignores = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
               "time.sleep(60)")
    stubborn = subprocess.Popen([sys.executable, "-c", ignores], stdout=subprocess.PIPE, start_new_session=True)
    stubborn.stdout.readline()  # SIGTERM is ignored from here on
    bench.stop(stubborn, grace_s=0.2)
    assert stubborn.returncode == -signal.SIGKILL


def test_llama_server_peer_arguments(tmp_path, capsys):
    """The C++ llama-server: one slot per concurrent request of the level, each --peer-ctx of
    context, our threads; cppspec adds its n-gram speculation; a folder without it is refused."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(SystemExit):
        bench.parse_args(["--servers", "spec,cpp", "--peer-model", str(model), "--llamacpp-bin", str(tmp_path)])
    assert "no llama-server in" in capsys.readouterr().err
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    opts = bench.parse_args(["--levels", "1,8", "--peer-model", str(model), "--llamacpp-bin", str(tmp_path)])
    assert opts.servers == ["spec", "nospec", "cpp"]  # the C++ server is the default peer when given
    argv = bench.server_argv("cpp", 1234, opts, 8)
    assert argv[0] == str(tmp_path.resolve() / "llama-server") and "--spec-type" not in argv
    assert argv[argv.index("--parallel") + 1] == "8" and argv[argv.index("--ctx-size") + 1] == str(2048 * 8)
    assert argv[argv.index("--threads") + 1] == str(bench.cores())
    spec = bench.server_argv("cppspec", 1234, opts, 1)
    assert spec[spec.index("--spec-type") + 1] == "ngram-simple" and spec[spec.index("--parallel") + 1] == "1"
    assert bench.parse_args(["--no-peer", "--llamacpp-bin", str(tmp_path)]).servers == ["spec", "nospec"]


def test_rounds_are_pooled():
    """Two rounds of a level: every request pooled, tok/s over the summed wall time, each
    round's own figure kept, acceptance from the summed counters."""
    R = bench.Result
    one = bench.summarize([R(True, 1.0, 0.1, 10, "usage", "length", index=0)], 2.0)
    two = bench.summarize([R(True, 2.0, 0.2, 30, "usage", "length", index=0),
                           R(False, 1.0, error="timeout", index=1)], 4.0)
    one["per_request"] = [{"ok": True, "e2e_s": 1.0, "ttft_s": 0.1, "tokens": 10, "tokens_from": "usage",
                           "finish": "length", "error": None, "index": 0}]
    two["per_request"] = [{"ok": True, "e2e_s": 2.0, "ttft_s": 0.2, "tokens": 30, "tokens_from": "usage",
                           "finish": "length", "error": None, "index": 0},
                          {"ok": False, "e2e_s": 1.0, "ttft_s": None, "tokens": 0, "tokens_from": "",
                           "finish": None, "error": "timeout", "index": 1}]
    one["metrics"] = {"num_draft_tokens": 4, "num_accepted_tokens": 2}
    two["metrics"] = {"num_draft_tokens": 6, "num_accepted_tokens": 5}
    p = bench.pooled([one, two])
    assert (p["requests"], p["done"], p["failed"], p["output_tokens"]) == (3, 2, 1, 40)
    assert p["output_tok_s"] == pytest.approx(40 / 6) and p["rounds_tok_s"] == [5.0, 7.5]
    assert p["metrics"]["acceptance"] == pytest.approx(7 / 10) and len(p["per_request"]) == 3
    assert bench.pooled([one])["rounds_tok_s"] == [5.0]
