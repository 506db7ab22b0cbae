"""tools / tool_choice through the real `openai` client, on the tiny model with a
Hermes-style tool template (Qwen2.5's way: tools rendered in the system turn,
calls written as <tool_call> JSON </tool_call>). A forced call (a named function
or "required") is decoded under the functions' schemas, so its arguments are
valid by construction: tool_calls in the message and in the stream,
finish_reason "tool_calls"; bad tools and tool_choice values are 400s."""
from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from helpers.serving import ServerProcess, write_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:\n"
    "{% for tool in tools %}{{ tool.function.name }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "celsius"],
                                                           "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                                          "celsius": {"type": "boolean"}}}}}
TIME = {"type": "function", "function": {"name": "get_time",
                                         "parameters": {"type": "object", "additionalProperties": False,
                                                        "required": ["zone"],
                                                        "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools") / "llama-tools"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    srv = ServerProcess(write_config(folder.parent / "tools.yaml", folder))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)


def _schema(name):
    return next(t for t in (WEATHER, TIME) if t["function"]["name"] == name)["function"]["parameters"]


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
def test_a_forced_call_has_valid_arguments(client, choice):
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                          max_tokens=160, temperature=0)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))
    assert call.id.startswith("call_") and call.type == "function"
    # streamed: the same call, as one delta, and the same finish reason
    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                            max_tokens=160, temperature=0, stream=True)
    calls, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and [(x.function.name, x.function.arguments) for x in calls] == \
        [(call.function.name, call.function.arguments)]


def test_the_call_goes_back_through_the_template(client):
    """A second turn carrying the assistant's call and the tool's answer renders and runs."""
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=160,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"}]
    again = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_renders_no_tools(client):
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0)
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls


@pytest.mark.parametrize("extra,field", [({"tools": [{"type": "function"}]}, "tools[0]"),
                                         ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                               "function": {"name": "nope"}}},
                                          "tool_choice"),
                                         ({"tool_choice": "required"}, "tool_choice"),
                                         ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice")])
def test_bad_tools_are_400s(server, extra, field):
    resp = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]
