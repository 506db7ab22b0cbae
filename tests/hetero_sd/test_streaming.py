"""Streamed text: `hetero-sd generate` writes the text as it is committed, on a
terminal and into a pipe, the bytes equal to the non-streamed text; the
stream's deltas add up exactly, never split a character, and cost a few
tokens' decode each (incremental detokenization), not the whole output's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from hetero_sd.ir.work import TokenHistory
from hetero_sd.stopping import StopChecker, TextStream
from helpers.serving import REPO, SLOW_ENV, write_slow_config

TEXT = "Grüße aus Köln! 日本語のテキスト ✓ — naïve café, 12 345 € and emoji 🙂🙃 at the end."


class _Counting:
    """The tokenizer, recording how many ids each decode call was given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def _stream(tok, ids, stop=()):
    counting = _Counting(tok)
    history = TokenHistory([0])
    checker = StopChecker(history, 10_000, set(), list(stop), counting)
    stream, deltas = TextStream(checker), []
    for t in ids:
        done = checker.feed(t)
        deltas.append(stream.delta())
        if done:
            break
    streamed = list(counting.sizes)  # the decodes the streamed deltas made
    deltas.append(stream.delta(final=True))
    return deltas, checker, streamed


@pytest.mark.parametrize("repeat", [1, 8])
def test_deltas_add_up_and_each_decodes_a_few_tokens(tiny_model_dir, repeat):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    ids = tok.encode(TEXT * repeat, add_special_tokens=False)
    assert len(ids) > 40 * repeat  # multi-byte characters span several byte-level tokens
    deltas, checker, sizes = _stream(tok, ids)
    assert "".join(deltas) == checker.text() == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)  # no character split across deltas
    # incremental: the window a delta decodes stays a few tokens long however long the output
    window = max(sizes)  # (the final delta decodes the whole text once)
    assert window <= 16, f"a delta decoded {window} tokens"


def test_stop_string_is_never_streamed(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    ids = tok.encode("one two three STOP four five", add_special_tokens=False)
    deltas, checker, _ = _stream(tok, ids, stop=["STOP"])
    assert checker.reason == "stop" and "".join(deltas) == checker.text() == "one two three "
    assert all("S" not in d for d in deltas)


def _cli(config, *args, **kw):
    env = {**os.environ, **SLOW_ENV, "PYTHONIOENCODING": "utf-8"}
    return [sys.executable, "-m", "hetero_sd.cli", "generate", "--config", config, "--prompt", "a b c a b c",
            "--max-new-tokens", "24", *args], dict(cwd=REPO, env=env, **kw)


def _first_output_and_exit(proc, read) -> tuple[float, float, bytes]:
    start, first, out = time.monotonic(), None, b""
    while True:
        chunk = read()
        if not chunk:
            break
        if first is None:
            first = time.monotonic() - start
        out += chunk
    proc.wait(timeout=120)
    return first, time.monotonic() - start, out


@pytest.mark.parametrize("where", ["pipe", "pty"])
def test_generate_streams_before_it_exits(tiny_model_dir, tmp_path, where):
    """24 tokens at a declared 0.05 s each (the fake device sleeps them): the first
    text arrives about a second before the process ends, and the bytes streamed equal
    the --json run's text."""
    config = write_slow_config(tmp_path / "slow.yaml", tiny_model_dir("llama"))
    cmd, kw = _cli(config, "--json")
    whole = json.loads(subprocess.run(cmd, capture_output=True, check=True, **kw).stdout)["text"]
    cmd, kw = _cli(config)
    if where == "pipe":
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        first, total, out = _first_output_and_exit(proc, lambda: proc.stdout.read1(65536))
    else:
        import pty

        leader, follower = pty.openpty()
        proc = subprocess.Popen(cmd, stdout=follower, stderr=subprocess.PIPE, **kw)
        os.close(follower)

        def read():
            try:
                return os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                return b""

        first, total, out = _first_output_and_exit(proc, read)
        os.close(leader)
        out = out.replace(b"\r\n", b"\n")  # the terminal's line discipline
    assert proc.returncode == 0, proc.stderr.read().decode()
    assert out.decode("utf-8") == whole + "\n"
    assert first is not None and total - first > 0.5, f"first text at {first:.2f}s of {total:.2f}s"
