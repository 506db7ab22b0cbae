"""Issue 15, point 1: the real `openai` client against `hetero-sd serve` (a subprocess).

Streamed text == non-streamed text == `hetero-sd generate --json` for the same
prompt and settings, for chat (the chat template) and completions (raw text,
`generate --no-chat-template`), greedy and seeded sampling.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from hetero_sd.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # beside the server process (see conftest.py)

CHAT_PROMPT = "Explain what a heat pump does."
RAW_PROMPT = "the cat sat on the mat. " * 6  # repetitive: the n-gram drafter proposes
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7}
MAX_TOKENS = 24
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def generate(capsys, config: str, prompt: str, chat: bool, sampling: dict | None) -> dict:
    """`hetero-sd generate --json` (in-process: the same main() the console script runs)."""
    argv = ["generate", "--config", config, "--prompt", prompt, "--max-new-tokens", str(MAX_TOKENS), "--json"]
    if not chat:
        argv.append("--no-chat-template")
    for key, value in (sampling or {}).items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def ask(client, chat: bool, prompt: str, sampling: dict | None, stream: bool):
    """(text, finish_reason, usage or None, speculation) from one request."""
    sampling = dict(sampling or {"temperature": 0})
    extra = {"top_k": sampling.pop("top_k")} if "top_k" in sampling else {}
    kwargs = dict(model="tiny", max_tokens=MAX_TOKENS, stream=stream, extra_body=extra, **sampling)
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    if chat:
        resp = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
    else:
        resp = client.completions.create(prompt=prompt, **kwargs)
    if not stream:
        c = resp.choices[0]
        return (c.message.content if chat else c.text), c.finish_reason, resp.usage, resp.model_extra["speculation"]
    text, finish, usage, spec = [], None, None, None
    for chunk in resp:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = (c.delta.content if chat else c.text) or ""
            text.append(piece)
            if c.finish_reason is not None:
                finish, spec = c.finish_reason, chunk.model_extra["speculation"]
    return "".join(text), finish, usage, spec


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_equals_whole_equals_generate(client, serve_config, capsys, chat, sampling):
    prompt = CHAT_PROMPT if chat else RAW_PROMPT
    solo = generate(capsys, serve_config, prompt, chat, sampling)
    whole, whole_finish, whole_usage, spec = ask(client, chat, prompt, sampling, stream=False)
    streamed, stream_finish, stream_usage, stream_spec = ask(client, chat, prompt, sampling, stream=True)
    assert whole == solo["text"]
    assert streamed == whole
    assert whole_finish == stream_finish == FINISH[solo["stats"]["finish_reason"]]
    for usage in (whole_usage, stream_usage):
        assert usage.prompt_tokens == solo["stats"]["prompt_tokens"]
        assert usage.completion_tokens == len(solo["token_ids"])
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # (draft lengths may differ between the two: the batch engine prices drafts by learnt costs)
    assert spec["mode"] == stream_spec["mode"] == "ngram" and spec["rounds"] >= 1
    if not chat and sampling is None:
        assert spec["drafted"] > 0  # the repetitive prompt did speculate


def test_models_and_health(client, server, tiny_model_dir):
    # the model is named by its folder (a catalog model by its catalog name)
    assert [m.id for m in client.models.list().data] == [tiny_model_dir("llama").name]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_token_id_prompt_equals_text_prompt(client, tiny_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))(RAW_PROMPT)["input_ids"]
    by_text = client.completions.create(model="tiny", prompt=RAW_PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_equals_generate(client, serve_config, capsys, stream, tmp_path):
    """OpenAI's response_format decodes under the grammar: the text validates and
    equals `hetero-sd generate --json-schema` for the same request."""
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA}}
    kwargs = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0, response_format=fmt,
                  messages=[{"role": "user", "content": CHAT_PROMPT}])
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    code = main(["generate", "--config", serve_config, "--prompt", CHAT_PROMPT, "--max-new-tokens", str(MAX_TOKENS),
                 "--json", "--json-schema", str(schema_file)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert text == json.loads(out)["text"]
    assert isinstance(json.loads(text)["ok"], bool)


def test_response_format_errors_are_400(client):
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                {"type": "json_schema"}, {"type": "yaml"}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", max_tokens=4, response_format=fmt,
                                           messages=[{"role": "user", "content": "hi"}])
