"""OpenAI-compatible request and response bodies: the subset vLLM and llama-server serve.

Requests are validated strictly (a number must be a JSON number, a bool is not
a number, "5" is not an int) so a client's mistake is a 400 naming the field,
not a silently converted value. Unknown fields are ignored, as OpenAI's own
server and vLLM do; fields that would change the output but are not
implemented (echo, tools) are refused rather than
ignored, so no client believes it got what it asked for.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hetero_sd.constraint import Constraint
from hetero_sd.errors import GenerationError

# One stop string is decoded against at every committed token (hetero_sd.stopping),
# so their number and length bound per-token work: a hostile list must cost nothing.
MAX_STOP = 16
MAX_STOP_CHARS = 256

# Engine finish reasons -> OpenAI's. "abort" (ended by a server shutdown) is vLLM's own.
FINISH = {"eos": "stop", "stop": "stop", "grammar": "stop", "length": "length", "context": "length",
          "abort": "abort", "cancelled": "abort", "timeout": "timeout"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Generate(_Body):
    """What both endpoints share."""
    model: str | None = None  # any name is served by the one model (as llama-server does)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extra field (vLLM's); -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1  # choices, each its own sequence in the batch
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # extra field: higher runs first (vLLM's priority is the opposite)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # extra field (vLLM's)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    response_format: dict | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's: a prefix-cache partition
    timeout: Annotated[float, Field(gt=0)] | None = None  # extra field: seconds, at most the server's --request-timeout

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stops(cls, value):
        # mode="before": a list of a million strings is refused before any is validated
        if isinstance(value, list):
            if len(value) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop strings, got {len(value)}")
            for s in value:
                if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
                    raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(s)}")
        elif isinstance(value, str) and len(value) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(value)}")
        return value

    def stops(self) -> list[str] | None:
        """The stop strings, without empty ones (an empty string would stop at once); None = not given."""
        if self.stop is None:
            return None
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]

    def unsupported(self) -> str | None:
        """The first field given that this server cannot honour, as a message; None if none."""
        return None

    def penalties(self) -> dict:
        """The penalty fields given, as SamplingParams takes them (it checks their ranges)."""
        out = {name: float(getattr(self, name)) for name in ("presence_penalty", "frequency_penalty",
                                                             "repetition_penalty") if getattr(self, name) is not None}
        if self.logit_bias:
            try:
                out["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items()))
            except ValueError:
                raise GenerationError("logit_bias keys must be token ids") from None
        return out

    def constraint(self) -> Constraint | None:
        """What response_format holds the output to (None: plain text), checked:
        OpenAI's {"type": "json_object"} and {"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}}}, decoded under the grammar (hetero_sd.constraint)."""
        rf = self.response_format
        kind = (rf or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            constraint = Constraint.any_json("response_format")
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise GenerationError('response_format json_schema needs {"json_schema": {"name": ..., '
                                      '"schema": {...}}}')
            constraint = Constraint.json_schema(spec["schema"], "response_format.json_schema.schema")
        else:
            raise GenerationError(f"response_format type {kind!r} is not supported; "
                                  "use text, json_object or json_schema")
        constraint.check()
        return constraint

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TopLogprobs = Annotated[int, Field(ge=0, le=20)]  # OpenAI's bound


class CompletionRequest(_Generate):
    # a string, a list of one string, token ids, or a list of one token-id list
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: TopLogprobs | None = None  # each token's log-probability and this many alternatives
    echo: bool = False

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        return super().unsupported()

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); ValueError for none or several."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"one prompt per request, got {len(p)}")
            p = p[0]
        if len(p) == 0:
            raise ValueError("the prompt is empty")
        return p


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool turn's answer to one
    name: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates read it (Hermes/Qwen: tool_calls' arguments as objects)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(part.text or "" for part in self.content)


def _template_call(call: dict) -> dict:
    import json

    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            raise ValueError("a tool call's arguments must be a JSON object") from None
    return {**call, "function": fn}


class ChatRequest(_Generate):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs_: TopLogprobs | None = Field(None, alias="top_logprobs")

    def unsupported(self) -> str | None:
        if self.top_logprobs_ is not None and not self.logprobs:
            return "top_logprobs needs logprobs: true"
        return super().unsupported()

    @property
    def top_logprobs(self) -> int | None:
        """How many alternatives each token reports (None: no logprobs)."""
        return (self.top_logprobs_ or 0) if self.logprobs else None

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt (raw text), or messages (through the chat template)."""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    tokens: list[int]


# ------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, results) -> dict:
    """OpenAI's usage over a request's choices (their GenerationResults, None for one
    that never ran), with prompt_tokens_details.cached_tokens: the prompt positions whose
    KV came from the prefix cache, for the first choice."""
    results = results if isinstance(results, list) else [results]
    completion = sum(len(r.token_ids) for r in results if r)
    cached = results[0].stats.cached_tokens if results and results[0] else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def speculation(stats) -> dict:
    """The request's own speculation summary (hetero_sd.stats.GenerationStats), an extra field."""
    if stats is None:  # ended before it ran (aborted while waiting)
        return {"mode": None, "drafted": 0, "accepted": 0, "acceptance_rate": 0.0, "mean_accepted": 0.0,
                "rounds": 0}
    return {"mode": stats.mode, "drafted": stats.drafted, "accepted": stats.accepted,
            "acceptance_rate": stats.acceptance_rate, "mean_accepted": stats.mean_accepted, "rounds": stats.rounds}


Kind = Literal["completion", "chat"]


def envelope(kind: Kind, rid: str, model: str, created: int, stream: bool) -> dict:
    """The fields every response and chunk of one request carries."""
    obj = "text_completion" if kind == "completion" else ("chat.completion.chunk" if stream else "chat.completion")
    return {"id": rid, "object": obj, "created": created, "model": model}


def choice(kind: Kind, text: str | None, finish_reason: str | None, stream: bool,
           logprobs: dict | None = None, index: int = 0) -> dict:
    """One choice: `text` for completions; `message` (whole) or `delta` (streamed) for chat;
    `logprobs` as logprobs_body made it (None: not asked for)."""
    out: dict = {"index": index}
    if kind == "completion":
        out.update(text=text or "", logprobs=logprobs)
    else:
        if stream:
            out["delta"] = {} if text is None else {"content": text}
        else:
            out["message"] = {"role": "assistant", "content": text or ""}
        out["logprobs"] = logprobs
    out["finish_reason"] = finish_reason
    return out


def logprobs_body(kind: Kind, entries, decode, text_offset: int = 0) -> dict:
    """OpenAI's logprobs of some committed tokens (hetero_sd.scoring.TokenLogprob): for chat
    {"content": [{token, logprob, bytes, top_logprobs}]}; for completions the legacy
    {tokens, token_logprobs, top_logprobs, text_offset}, offsets counted from `text_offset`."""
    def piece(token: int) -> str:
        return decode([token])

    if kind == "chat":
        def item(token, logprob):
            text = piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        tokens.append(piece(e.token))
        text_offset += len(tokens[-1])
    def top(entry) -> dict:  # keyed by text: of ids that decode alike, the likeliest (listed first) stays
        out: dict = {}
        for t, lp in entry.top:
            out.setdefault(piece(t), lp)
        return out

    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": offsets}


def now() -> int:
    return int(time.time())


def error_body(message: str, status: int, kind: str) -> dict:
    """OpenAI's error shape; `code` is the HTTP status, as vLLM gives it."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
