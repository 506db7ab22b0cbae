"""The HTTP server: an OpenAI-compatible FastAPI app over a BatchEngine.

    state = ServerState(engine, "smollm2-135m", max_running=16, max_waiting=64)
    app = create_app(state)   # its lifespan starts the batch engine and closes the engine

Requests become hetero_sd.serve.batch.Submission objects; the batch engine calls
back on its own thread with Events, which are handed to the request's asyncio
queue with call_soon_threadsafe. A streamed response writes one SSE chunk per
event with text (TextStream guarantees the deltas add up to the final text),
so streamed and whole responses carry the same text.

Every error is OpenAI's JSON error body with the right status: validation and
request errors 400, a bad key 401, a Host not served 403, a slow body 408, a
large one 413, a full queue 429 with Retry-After, a draining server or a dead
batch engine 503 (serve/guard.py checks hosts, keys and bodies first).

Tokenizing, chat templates, schema checks and grammar compiles run on a worker
thread, never on the event loop nor under the batch engine's lock, so a slow
compile stalls neither /health, /metrics nor running streams.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hetero_sd.errors import GenerationError, HeteroSDError
from hetero_sd.sampling import SamplingParams
from hetero_sd.serve import protocol as p
from hetero_sd.serve import tools
from hetero_sd.serve.batch import BatchEngine, QueueFull, ShuttingDown, Submission
from hetero_sd.serve.guard import Guard, error
from hetero_sd.serve.limits import ServeLimits
from hetero_sd.serve.metrics import Metrics, placement
from hetero_sd.serve.responses import serve_choices

log = logging.getLogger("hetero_sd.serve")


class ServerState:
    """The engine, its batch engine and metrics, and whether the server is draining."""

    def __init__(self, engine, model_name: str, *, max_running: int = 16, max_waiting: int = 64,
                 api_key: str | dict[str, float] | None = None, drain_s: float = 30.0, speculate: bool = True,
                 prefix_cache: int = 8, limits: ServeLimits = ServeLimits(), bind: str = "127.0.0.1",
                 faults=None, on_death=None):
        # key -> its priority: what its requests get when they name none, and the most they may name
        # ({} = no key needed)
        self.api_keys = {api_key: 0.0} if isinstance(api_key, str) else dict(api_key or {})
        self.engine, self.model_name = engine, model_name
        self.drain_s, self.speculate, self.limits, self.bind = drain_s, speculate, limits, bind
        self.metrics = Metrics(model_name, **placement(engine))
        self.batch = BatchEngine(engine, max_running=max_running, max_waiting=max_waiting,
                                 on_finish=self.metrics.on_finish, on_step=self.metrics.on_step,
                                 prefix_cache=prefix_cache, faults=faults, on_death=on_death)
        self.metrics.watch(self.batch)
        self.created = p.now()
        self.draining = False
        self._lock = threading.Lock()
        self._started = self._closed = False

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self.batch.start()

    def drain(self) -> None:
        """Stop admission and let running requests finish within drain_s (the rest end with
        finish_reason "abort"); blocks until the batch engine stopped. Idempotent."""
        with self._lock:  # a second caller waits for the first drain to end
            if not self.draining:
                self.draining = True
                self.batch.shutdown(self.drain_s)

    def close(self) -> None:
        """Drain, then stop the engine's worker processes (their shared memory goes with them)."""
        self.drain()
        with self._lock:
            if not self._closed:
                self._closed = True
                self.engine.close()


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        state.start()
        yield
        await asyncio.to_thread(state.close)

    app = FastAPI(title="hetero-sd", lifespan=lifespan)
    app.state.server = state
    _errors(app)
    _routes(app, state)
    app.add_middleware(Guard, api_keys=state.api_keys, limits=state.limits, bind=state.bind)
    return app


# ------------------------------------------------------------------ errors

def _validation_message(exc: RequestValidationError) -> str:
    """One readable line per offending field, never echoing the input (it may be huge)."""
    seen, parts = set(), []
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = loc[0] if loc else "body"
        if field in seen:  # a union reports one error per branch: the first says enough
            continue
        seen.add(field)
        msg = err.get("msg", "invalid")
        if err.get("type") == "json_invalid":
            return f"the body is not valid JSON: {err.get('ctx', {}).get('error', msg)}"
        parts.append(f"{field}: {msg}")
    return "; ".join(parts[:5]) or "invalid request body"


def _errors(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):  # FastAPI says 422; OpenAI clients and vLLM say 400
        return error(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                     "invalid_request_error", getattr(exc, "headers", None))

    @app.exception_handler(GenerationError)
    async def _bad_request(request, exc):
        return error(400, str(exc))

    @app.exception_handler(QueueFull)
    async def _full(request, exc):
        return error(429, str(exc), "rate_limit_error", {"Retry-After": str(max(1, math.ceil(exc.retry_after)))})

    @app.exception_handler(ShuttingDown)
    async def _draining(request, exc):
        return error(503, str(exc), "service_unavailable")

    @app.exception_handler(HeteroSDError)
    async def _engine_error(request, exc):  # a config-level error raised while building a request
        return error(400, str(exc))

    @app.exception_handler(Exception)
    async def _bug(request, exc):  # a bug of ours: logged, and still a JSON body
        log.exception("unhandled error")
        return error(500, f"internal error: {type(exc).__name__}", "server_error")


# ------------------------------------------------------------------ routes
def _routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        if state.batch.failure is not None:  # what a supervisor's probe sees before the process exits
            return JSONResponse({"status": "failed", "error": state.batch.failure}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest):
        """vLLM's shape: {tokens, count, max_model_len}."""
        if (body.prompt is None) == (body.messages is None):
            raise GenerationError("give one of prompt or messages")
        if body.messages is not None:
            ids = await asyncio.to_thread(_chat_ids, state, p.ChatRequest(messages=body.messages))
        else:
            ids = await asyncio.to_thread(lambda: list(state.engine.tokenizer(
                body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]))
        return {"tokens": ids, "count": len(ids), "max_model_len": state.batch.target.max_context}

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest):
        return {"prompt": state.engine.tokenizer.decode(_checked_ids(state, body.tokens))}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "hetero-sd",
                                            "max_model_len": state.batch.target.max_context}]}

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: HTTPRequest):
        ids, subs = await asyncio.to_thread(_prepare, state, request, body, _completion_ids, body.max_tokens)
        return await serve_choices(state, request, "completion", body, ids, subs)

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatRequest, request: HTTPRequest):
        ids, subs = await asyncio.to_thread(_prepare, state, request, body, _chat_ids, body.budget)
        return await serve_choices(state, request, "chat", body, ids, subs,
                                   tool_calls=bool(body.tools) and body.tool_choice != "none")


def _prepare(state: ServerState, request: HTTPRequest, body: p._Generate, encode, max_tokens: int | None):
    """(prompt ids, one Submission per choice), on a worker thread: everything slow a request
    needs before it can queue (templates, tokenizing, schema checks, the grammar's compile)."""
    _refuse_unsupported(body)
    _bounded_schemas(state, body)
    ids = encode(state, body)
    subs = _submissions(state, request, body, ids, max_tokens)
    if subs[0].constraint is not None:  # compiled (and cached) here: the batch thread finds it ready
        state.engine.compile_constraint(subs[0].constraint)
    return ids, subs


def _completion_ids(state: ServerState, body: p.CompletionRequest) -> list[int]:
    try:
        prompt = body.single_prompt()
    except ValueError as exc:
        raise GenerationError(str(exc)) from None
    return state.engine.encode(prompt, chat_template=False) if isinstance(prompt, str) else \
        _checked_ids(state, prompt)


def _bounded_schemas(state: ServerState, body: p._Generate) -> None:
    cap = state.limits.max_schema_bytes
    for name in ("response_format", "tools"):
        value = getattr(body, name, None)
        if value is not None and len(json.dumps(value)) > cap:
            raise GenerationError(f"{name} is larger than this server's limit of {cap} bytes as JSON")


def _refuse_unsupported(body: p._Generate) -> None:
    message = body.unsupported()
    if message is not None:
        raise GenerationError(message)


def _checked_ids(state: ServerState, ids: list[int]) -> list[int]:
    vocab = state.batch.target.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise GenerationError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    return ids


def _chat_ids(state: ServerState, body: p.ChatRequest) -> list[int]:
    tok = state.engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise GenerationError("this model has no chat template; use /v1/completions")
    fns = tools.functions(body.tools) if body.tool_choice != "none" else []
    try:
        messages = [m.for_template() for m in body.messages]
        return state.engine.encode_chat(messages, fns or None)
    except Exception as exc:  # the template's own checks (roles must alternate, ...) are the client's errors
        raise GenerationError(f"the messages do not fit the model's chat template: {exc}") from None


def _submissions(state: ServerState, request: HTTPRequest, body: p._Generate, ids: list[int],
                 max_tokens: int | None) -> list[Submission]:
    """One batch Submission per choice (n); absent fields take the engine's (the config's)
    defaults, as `generate` does, and an absent priority the API key's. With a seed, choice i
    samples with seed + i: the choices differ, and each reproduces."""
    engine, base = state.engine, state.engine.sampling
    top_k = base.top_k if body.top_k is None else max(body.top_k, 0)  # vLLM's -1 means off
    seed = base.seed if body.seed is None else body.seed
    stops, constraint = body.stops(), body.constraint()
    calls = tools.chosen(tools.functions(body.tools), body.tool_choice) if isinstance(body, p.ChatRequest) else None
    if calls is not None:
        if constraint is not None:
            raise GenerationError("give response_format or a tool_choice that forces a call, not both")
        constraint = tools.constraint(calls)
    penalties = body.penalties()
    if max_tokens is None:  # the config's default, as much of it as the context leaves (never the client's fault)
        max_tokens = max(1, min(engine.max_new_tokens, state.batch.target.max_context - len(ids)))
    timeout = state.limits.request_timeout_s if body.timeout is None else \
        min(body.timeout, state.limits.request_timeout_s)
    tenant = f"{getattr(request.state, 'tenant', '')}/{body.cache_salt or ''}"
    return [Submission(ids, max_tokens,
                       SamplingParams(base.temperature if body.temperature is None else body.temperature, top_k,
                                      base.top_p if body.top_p is None else body.top_p,
                                      None if seed is None else seed + i, **penalties),
                       list(engine.stop) if stops is None else stops, _priority(request, body), state.speculate,
                       constraint, body.top_logprobs, tenant, timeout)
            for i in range(body.n)]


def _priority(request: HTTPRequest, body: p._Generate) -> float:
    """The body's priority, capped at its key's own (a key's priority is also its default);
    an open server has no keys, and no cap."""
    key = getattr(request.state, "key_priority", None)
    if "priority" not in body.model_fields_set:
        return float(key or 0.0)
    return float(body.priority) if key is None else min(float(body.priority), key)
