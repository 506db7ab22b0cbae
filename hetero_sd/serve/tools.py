"""Function calling, as llama-server and vLLM serve it for Hermes/Qwen-style models.

The request's `tools` are rendered by the model's chat template; a tool call is
the text `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` in the
reply, parsed into OpenAI's `tool_calls`. With `tool_choice` "required" or a
named function, the reply is decoded under a grammar whose JSON part is the
functions' schemas (hetero_sd.constraint: lossless under speculation), so the
arguments are valid under their schema by construction; "auto" lets the model
choose, and "none" renders no tools.
"""
from __future__ import annotations

import json
import re
import uuid

from hetero_sd.constraint import Constraint
from hetero_sd.errors import GenerationError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def functions(tools: list[dict] | None) -> list[dict]:
    """The tools' function definitions, checked: [{"type": "function", "function": {"name", ...}}]."""
    out = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise GenerationError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                  '"parameters": {...}}}')
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise GenerationError(f"tools[{i}].function.parameters must be a JSON Schema object")
        out.append({**fn, "parameters": params})
    return out


def chosen(fns: list[dict], tool_choice) -> list[dict] | None:
    """The functions the reply must call (None: free text or a call, as the model likes)."""
    if tool_choice is None or tool_choice == "auto":
        return None
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        if not fns:
            raise GenerationError('tool_choice "required" needs tools')
        return fns
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name is None:
        raise GenerationError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}')
    match = [f for f in fns if f["name"] == name]
    if not match:
        raise GenerationError(f"tool_choice names {name!r}, which is not one of the tools")
    return match


def constraint(fns: list[dict]) -> Constraint:
    """One call of one of `fns`, its arguments valid under the function's parameters."""
    # (compact JSON: whitespace between tokens is the model's to waste otherwise)
    schema = {"x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
              "anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}}
                        for f in fns]}
    grammar = (f'start: "{OPEN}\\n" call "\\n{CLOSE}"\n'
               f"call: %json {json.dumps(schema)}\n")
    return Constraint.grammar(grammar, "tool_choice")


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(the reply's text outside tool calls, or None; its tool calls in OpenAI's form)."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue  # not a call: left in the text
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}})
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls
