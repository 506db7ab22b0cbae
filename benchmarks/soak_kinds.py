"""What the soak's modules share (benchmarks/soak.py runs the soak, benchmarks/soak_hostile.py
sends its hostile traffic): the mix of request kinds (KINDS, DETERMINISTIC, VALID), the
malformed bodies (HOSTILE), the injected faults (FAULTS) and every hostile kind
(HOSTILE_KINDS); the records (Outcome, SoakOptions); what each hostile kind must get and
within what bound (`expected`); and the well-formed requests both send (`_body`, `_key`,
`_auth`, `_send`), with the fault markers and messages (`_marker`, `_fault_message`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

KINDS = ("chat-stream", "chat", "sampled", "completion", "json", "chat-stream", "logprobs", "cancel", "hostile",
         "chat-stream", "hostile", "hostile", "hostile", "hostile", "hostile")
DETERMINISTIC = ("chat-stream", "chat", "sampled", "completion", "json", "logprobs")
VALID = ("chat-stream", "chat", "sampled", "completion", "json", "logprobs", "cancel")
# Bodies that must be refused: (what is wrong, the body; None = not JSON at all)
HOSTILE = (
    ("not JSON", None),
    ("no messages", {"max_tokens": 4}),
    ("messages not a list", {"messages": "hi", "max_tokens": 4}),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}),
    ("temperature a string", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
    ("negative max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}),
    ("max_tokens past the context", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}),
    ("n too large", {"messages": [{"role": "user", "content": "hi"}], "n": 10 ** 4}),
    ("top_logprobs out of range", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                   "top_logprobs": 99}),
    ("a bad response_format", {"messages": [{"role": "user", "content": "hi"}],
                               "response_format": {"type": "yaml"}}),
)
# (phase, the exception raised there) of the injected failures: one hostile kind each
FAULTS = (("admit", "RuntimeError"), ("prefill", "ValueError"), ("propose", "KeyError"), ("score", "MemoryError"),
          ("accept", "AssertionError"))
HOSTILE_KINDS = tuple(what for what, _ in HOSTILE) + (
    "no key", "wrong key", "rebinding Host", "look-alike Host", "oversized Content-Length", "oversized chunked body",
    "slow headers", "idle connection", "slow second head", "not HTTP", "huge header", "slow body",
    "stop reading mid-stream",
    "disconnect mid-prefill") + tuple(f"fault in {phase}" for phase, _ in FAULTS)
MAX_BODY = 8 * 2**20  # the server's bound on a request body


@dataclass
class Outcome:
    index: int
    kind: str
    ok: bool
    latency_s: float
    text: str = ""
    finish: str | None = None
    status: int | None = None
    error: str = ""
    key: tuple | None = None  # requests with the same key must answer alike (_key)
    note: str = ""  # how a hostile request ended, when more than one ending passes


@dataclass
class SoakOptions:
    requests: int = 2000
    concurrency: int = 32
    max_tokens: int = 24
    warm: int = 200  # RSS is compared against its value after this many requests
    rss_tolerance: float = 0.05
    time_limit_s: float = 3600.0
    request_timeout_s: float = 300.0
    seed: int = 0
    model: str = "default"
    prompts: list[str] = field(default_factory=list)
    # the server's side of the hostile traffic (server_args passes them as its flags)
    api_key: str = "soak-key"
    header_timeout_s: float = 2.0
    body_timeout_s: float = 2.0
    stall_timeout_s: float = 3.0
    margin_s: float = 5.0  # a timeout may fire this late on a loaded host
    hostile_timeout_s: float = 30.0  # the bound on a refusal that needs no timeout of the server's
    long_prompt_tokens: int = 1024  # disconnect mid-prefill: at most this long (and 3/4 of the context)
    stall_max_tokens: int = 2048  # stop reading mid-stream: at most this many tokens (and the context)
    oversize_bytes: int = MAX_BODY + 2**20  # oversized Content-Length: what it announces
    chunked_bytes: int = 4 * MAX_BODY  # oversized chunked body: the most it sends before a refusal
    fd_tolerance: int = 4
    settle_s: float = 20.0  # after the load, how long the server may take to come back to idle

def _marker(phase: str) -> str:
    return f"SOAK-FAULT-{phase.upper()}"


def _fault_message(phase: str, error: str) -> str:
    return f"soak: injected {error} in {phase}"


def expected(name: str, opts: SoakOptions) -> tuple[str, float]:
    """(what the server must do, the time bound in seconds) for a hostile kind."""
    quick, head, body = opts.hostile_timeout_s, opts.header_timeout_s + opts.margin_s, \
        opts.body_timeout_s + opts.margin_s
    if name in dict(HOSTILE):
        return "400, error body", quick
    return {
        "no key": ("401, error body", quick),
        "wrong key": ("401, error body", quick),
        "rebinding Host": ("403, error body", quick),
        "look-alike Host": ("403, error body", quick),
        "oversized Content-Length": ("413, error body", quick),
        "oversized chunked body": (f"413, or closed, before all {opts.chunked_bytes // 2**20} MiB is sent", quick),
        "slow headers": ("closed (or 4xx), not before half the header timeout", head),
        "idle connection": ("closed (or 4xx), not before half the header timeout", head),
        "slow second head": ("200, then closed (or 4xx) on the half-sent second head", head),
        "not HTTP": ("closed, or 4xx", head),
        "huge header": ("431 or another 4xx, or closed", head),
        "slow body": ("408, or closed, not before half the body timeout", body),
        "stop reading mid-stream": ("200 and a first chunk; /health answers while stalled",
                                    opts.stall_timeout_s + 2 + quick),
        "disconnect mid-prefill": ("sent and dropped; nothing leaks (end checks)", quick),
    }.get(name) or ("500 or an error chunk naming the fault", opts.request_timeout_s)


def _body(kind: str, prompt: str, i: int, opts: SoakOptions, stream: bool) -> tuple[str, dict]:
    """(path, body) of a well-formed request of `kind`."""
    base = {"model": opts.model, "max_tokens": opts.max_tokens, "temperature": 0}
    if kind == "completion":
        return "/v1/completions", {**base, "prompt": prompt, "stream": stream}
    body = {**base, "messages": [{"role": "user", "content": prompt}], "stream": stream}
    if kind == "sampled":
        body.update(temperature=0.8, top_p=0.9, seed=1000 + i % 7)
    elif kind == "json":
        body["response_format"] = {"type": "json_object"}
    elif kind == "logprobs":
        body.update(logprobs=True, top_logprobs=2, frequency_penalty=0.5)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions", body


def _key(kind: str, prompt_index: int, i: int) -> tuple:
    """Requests that must answer alike: the same kind, prompt and (sampled) seed."""
    return (kind, prompt_index, 1000 + i % 7 if kind == "sampled" else None)


def _auth(opts: SoakOptions) -> dict:
    return {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}


async def _send(client, path: str, body: dict | None, stream: bool, cancel_after: int | None = None,
                headers: dict | None = None) -> tuple[int, str, str | None]:
    """(HTTP status, the text, the finish reason) of one request; a stream's error chunk is
    (500, its error object as JSON, None)."""
    content = b"{not json" if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    if not stream:
        r = await client.post(path, content=content, headers=headers)
        if r.status_code != 200:
            return r.status_code, r.text, None
        choice = r.json()["choices"][0]
        return 200, choice.get("message", {}).get("content") if "message" in choice else choice["text"], \
            choice["finish_reason"]
    text, finish, chunks = [], None, 0
    async with client.stream("POST", path, content=content, headers=headers) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(errors="replace"), None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 500, json.dumps(chunk["error"]), None
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                text.append(delta.get("content") or choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return 200, "".join(text), "cancelled"  # leaving the block closes the connection
    return 200, "".join(text), finish

