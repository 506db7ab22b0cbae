"""`hetero-sd chat` under a pseudo-terminal: three turns on the embedded
SmolLM2, a /reset, and Ctrl-C in the middle of a reply. Each reply equals
`generate` on the same conversation; the second turn prefills only what the
first did not hold (the first turn's KV is copied), as /stats shows; Ctrl-C
stops the reply and the session goes on.

The model runs on the fake device wrapping onnxruntime int4 (the default
config's target): the same tokens, each decode step lasting a declared
0.04 s, so a reply is still running when Ctrl-C arrives on any host.

The child is started by subprocess (no Python runs between fork and exec: a
pytest process that has loaded native runtimes may crash a child forked the
way pexpect.spawn forks), its stdin, stdout and stderr on a pseudo-terminal
that pexpect drives; Ctrl-C is the SIGINT a terminal sends for it."""
from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys

import pytest
from pexpect import fdpexpect

from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from hetero_sd.testing.fake_backend import ENV as FAKE_ENV
from helpers.serving import REPO

SLOW = {FAKE_ENV: json.dumps({"simulate_time": True, "devices": [{
    "device": "fake:0", "inner_backend": "onnxruntime", "precisions": [{"name": "int4", "runs_as": "int4"}],
    "costs": {"prefill_per_token_s": 0.0005, "decode_per_token_s": 0.12, "verify_base_s": 0.12}}]})}
TURNS = ["What is the capital of France?", "And of Italy?"]
STATS = re.compile(r"last turn: prompt (\d+) tokens, (\d+) reused from the previous turn, (\d+) prefilled")


def _config(path, model, backend, device, precision, max_new):
    path.write_text(f"target: {{model: {model}, backend: {backend}, device: {device}, precision: {precision}}}\n"
                    f"drafter: {{kind: ngram, k: 4}}\ngeneration: {{max_new_tokens: {max_new}}}\n")
    return str(path)


def _reply(child) -> str:
    child.expect(r"\r\n> ", timeout=120)  # the reply ends with a newline, then the next prompt
    return child.before.replace("\r\n", "\n")


def test_chat_session_under_a_terminal(smollm2_gguf, tmp_path):
    config = _config(tmp_path / "slow.yaml", smollm2_gguf, "fake", "fake:0", "int4", 24)
    env = {**os.environ, **SLOW, "PYTHONIOENCODING": "utf-8", "COLUMNS": "200"}
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "hetero_sd.cli", "chat", "--config", config], cwd=REPO, env=env,
                            stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    child = fdpexpect.fdspawn(leader, encoding="utf-8", timeout=180)
    child.expect("> ")
    replies, stats = [], []
    for turn in TURNS:
        child.sendline(turn)
        child.expect_exact(turn + "\r\n")  # the terminal echoes the line
        replies.append(_reply(child))
        child.sendline("/stats")
        child.expect(STATS)
        stats.append(tuple(int(g) for g in child.match.groups()))
        child.expect("> ")
    child.sendline("/reset")
    child.expect_exact("(conversation reset)")
    child.expect("> ")
    child.sendline("Write a long story about a robot.")
    child.expect_exact("story about a robot.\r\n")
    child.expect(r"\S", timeout=120)  # the reply has begun
    # (a 24-token reply lasts about 2.5 s at SLOW's costs: Ctrl-C lands inside it even when this
    # process waits for the CPU; at 0.04 s a token it lasted 0.9 s, and a loaded run missed it)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    child.expect_exact("(reply stopped)")
    child.expect("> ")
    child.sendline("/stats")
    child.expect("interrupted")
    child.expect("> ")
    child.sendline("/exit")
    assert proc.wait(timeout=60) == 0
    child.close()

    # each reply equals generate on the same conversation (greedy: speculation changes nothing)
    engine = Engine.from_config(load_config(_config(tmp_path / "ort.yaml", smollm2_gguf, "onnxruntime", "cpu",
                                                    "int4", 24)))
    messages = []
    for turn, got in zip(TURNS, replies):
        messages.append({"role": "user", "content": turn})
        want = engine.generate_ids(engine.encode_chat(messages)).text
        assert got == want
        messages.append({"role": "assistant", "content": want})
    # the second turn copied the first turn's prompt and more, and prefilled only the rest
    (first_prompt, _, _), (prompt, reused, prefilled) = stats
    assert reused >= first_prompt and prefilled == prompt - reused and prefilled < prompt - first_prompt + 8
    engine.close()


def _tiny_session(tiny_model_dir, tmp_path, backend="onnxruntime"):
    from hetero_sd.chat import ChatSession

    cfg = load_config(_config(tmp_path / "tiny.yaml", tiny_model_dir("llama"), backend, "cpu", "fp32", 16))
    return ChatSession(Engine.from_config(cfg))


def test_history_is_trimmed_to_the_context_with_a_count(tiny_model_dir, tmp_path):
    """The tiny model holds 256 positions: long turns push the oldest exchanges out, and
    each turn's prompt plus its reply still fits."""
    session = _tiny_session(tiny_model_dir, tmp_path)
    notices = []
    for i in range(8):
        session.reply(f"turn {i}: " + "the quick brown fox jumps over the lazy dog " * 6, lambda _: None)
        assert session.last.prompt_tokens + 16 <= 256
        if session.last.trimmed:
            notices.append(session.stats())
    assert notices and all("dropped to fit the context" in n for n in notices)
    assert session.messages[0]["role"] == "user" and session.messages[0]["content"].startswith("turn ")
    session.close()


def test_an_interrupted_reply_keeps_what_was_shown(tiny_model_dir, tmp_path):
    session = _tiny_session(tiny_model_dir, tmp_path)
    shown = []

    def write(text):
        shown.append(text)
        raise KeyboardInterrupt  # Ctrl-C as the first text is written

    with pytest.raises(KeyboardInterrupt):
        session.reply("hello there", write)
    assert session.messages[-1] == {"role": "assistant", "content": "".join(shown)}
    assert session.last.summary == "interrupted"
    assert session.reply("and again", lambda _: None)  # the session goes on
    session.close()


def test_a_target_without_exact_kv_copies_prefills_every_turn(tiny_model_dir, tmp_path):
    session = _tiny_session(tiny_model_dir, tmp_path, backend="torch")
    for turn in TURNS:
        session.reply(turn, lambda _: None)
    assert session.last.reused_tokens == 0 and "prefills the whole conversation" in session.stats()
    session.close()
