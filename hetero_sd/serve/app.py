"""The HTTP server: an OpenAI-compatible FastAPI app over a BatchEngine.

    state = ServerState(engine, "smollm2-135m", max_running=16, max_waiting=64)
    app = create_app(state)   # its lifespan starts the batch engine and closes the engine

Requests become hetero_sd.serve.batch.Submission objects; the batch engine calls
back on its own thread with Events, which are handed to the request's asyncio
queue with call_soon_threadsafe. A streamed response writes one SSE chunk per
event with text (TextStream guarantees the deltas add up to the final text),
so streamed and whole responses carry the same text.

Every error is OpenAI's JSON error body with the right status: validation and
request errors 400, a bad key 401, a full queue 429 with Retry-After, a
draining server 503.
"""
from __future__ import annotations

import asyncio
import hmac
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
from hetero_sd.serve.metrics import Metrics, placement
from hetero_sd.serve.responses import serve_choices

log = logging.getLogger("hetero_sd.serve")

MAX_BODY = 8 * 2**20  # bytes; a request body past it is refused before it is read


class ServerState:
    """The engine, its batch engine and metrics, and whether the server is draining."""

    def __init__(self, engine, model_name: str, *, max_running: int = 16, max_waiting: int = 64,
                 api_key: str | dict[str, float] | None = None, drain_s: float = 30.0, speculate: bool = True,
                 prefix_cache: int = 8):
        # key -> the priority its requests get when they name none ({} = no key needed)
        self.api_keys = {api_key: 0.0} if isinstance(api_key, str) else dict(api_key or {})
        self.engine, self.model_name = engine, model_name
        self.drain_s, self.speculate = drain_s, speculate
        self.metrics = Metrics(model_name, **placement(engine))
        self.batch = BatchEngine(engine, max_running=max_running, max_waiting=max_waiting,
                                 on_finish=self.metrics.on_finish, on_step=self.metrics.on_step,
                                 prefix_cache=prefix_cache)
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
    app.add_middleware(Guard, api_keys=state.api_keys)
    return app


# ------------------------------------------------------------------ errors
def error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
    return JSONResponse(p.error_body(message, status, kind), status_code=status, headers=headers)


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


class Guard:
    """ASGI middleware run before any body is read: the API key (every path but /health) and
    the body size bound, so an unauthenticated or oversized request costs nothing."""

    def __init__(self, app, api_keys: dict[str, float]):
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            refusal = self._refuse(scope, headers)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refuse(self, scope, headers: dict):
        if self.api_keys and scope["path"] != "/health":
            given = headers.get(b"authorization", b"").decode("latin-1").encode()
            # every key compared in constant time, so timing tells nothing about any of them
            matches = [key for key in self.api_keys if hmac.compare_digest(given, f"Bearer {key}".encode())]
            if not matches:
                return error(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                             "authentication_error", {"WWW-Authenticate": "Bearer"})
            scope.setdefault("state", {})["key_priority"] = self.api_keys[matches[0]]
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > MAX_BODY:
            return error(413, f"the request body must be at most {MAX_BODY} bytes")
        return None


# ------------------------------------------------------------------ routes
def _routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
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
            ids = _chat_ids(state, p.ChatRequest(messages=body.messages))
        else:
            ids = list(state.engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
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
        _refuse_unsupported(body)
        try:
            prompt = body.single_prompt()
        except ValueError as exc:
            raise GenerationError(str(exc)) from None
        ids = state.engine.encode(prompt, chat_template=False) if isinstance(prompt, str) else \
            _checked_ids(state, prompt)
        return await serve_choices(state, request, "completion", body, ids, _submissions(state, request, body, ids,
                                                                                          body.max_tokens))

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatRequest, request: HTTPRequest):
        _refuse_unsupported(body)
        ids = _chat_ids(state, body)
        return await serve_choices(state, request, "chat", body, ids, _submissions(state, request, body, ids,
                                                                                    body.budget),
                                   tool_calls=bool(body.tools) and body.tool_choice != "none")


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
    return [Submission(ids, engine.max_new_tokens if max_tokens is None else max_tokens,
                       SamplingParams(base.temperature if body.temperature is None else body.temperature, top_k,
                                      base.top_p if body.top_p is None else body.top_p,
                                      None if seed is None else seed + i, **penalties),
                       list(engine.stop) if stops is None else stops, _priority(request, body), state.speculate,
                       constraint, body.top_logprobs)
            for i in range(body.n)]


def _priority(request: HTTPRequest, body: p._Generate) -> float:
    if "priority" in body.model_fields_set:
        return float(body.priority)
    return float(getattr(request.state, "key_priority", 0.0))
