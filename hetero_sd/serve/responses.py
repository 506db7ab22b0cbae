"""A request's response, whole or streamed as SSE, over its n choices: each
choice is its own sequence in the batch (a Submission), its events read from
its own asyncio queue; streamed chunks carry the choice's index.

A stream whose client reads nothing for the stall timeout (its socket's buffers
full, so a write waits) is cancelled: its sequences are freed and its
connection closed, rather than generating into a buffer nobody empties."""
from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hetero_sd.serve import protocol as p
from hetero_sd.serve import tools
from hetero_sd.serve.batch import Event, Submission

POLL_S = 0.5  # how often a waiting response checks that its client is still there
log = logging.getLogger("hetero_sd.serve")


class _ClientStalled(Exception):
    pass


class StallGuardedStream(StreamingResponse):
    """A StreamingResponse whose every write must complete within `stall_s`."""

    def __init__(self, content, stall_s: float, **kwargs):
        super().__init__(content, **kwargs)
        self.stall_s = stall_s

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_s)
            except asyncio.TimeoutError:
                raise _ClientStalled from None

        try:
            await super().stream_response(timed)
        except _ClientStalled:  # returning unfinished makes uvicorn close the connection
            log.warning("a stream's client read nothing for %g s: cancelled", self.stall_s)
        finally:  # the generator's own finally frees the choices' sequences
            await self.body_iterator.aclose()


class _Pending:
    """One submitted choice as the event loop sees it: its queue of Events."""

    def __init__(self, state, req: Submission):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.done = False
        # The batch engine calls back on its thread; the queue belongs to this loop.
        self.handle = state.batch.submit(req, lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, ev))
        self.logprobs = req.logprobs is not None
        self.tool_calls = False

    async def next(self, request: HTTPRequest) -> Event | None:
        """The next event; None once the client has gone."""
        while True:
            try:
                event = await asyncio.wait_for(self.queue.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            self.done = event.finish_reason is not None
            return event

    def close(self) -> None:
        """Free the sequence of a choice whose client left (a no-op once it finished)."""
        if not self.done:
            self.handle.cancel()


def _submit(state, subs: list[Submission]) -> list[_Pending]:
    """Every choice submitted, or none (a full queue for the third frees the first two)."""
    pendings: list[_Pending] = []
    try:
        for sub in subs:
            pendings.append(_Pending(state, sub))  # GenerationError / QueueFull / ShuttingDown: mapped by the app
    except BaseException:
        for pending in pendings:
            pending.close()
        raise
    return pendings


async def serve_choices(state, request: HTTPRequest, kind: p.Kind, body, ids: list[int], subs: list[Submission],
                        tool_calls: bool = False):
    """tool_calls: the reply may hold tool calls (serve/tools.py): whole, they become the
    message's tool_calls; streamed, the text is held until the end and sent as one delta
    with them, so no client sees a call's raw text."""
    pendings = _submit(state, subs)
    for pending in pendings:
        pending.tool_calls = tool_calls
    rid = p.new_id("cmpl" if kind == "completion" else "chatcmpl")
    head = p.envelope(kind, rid, state.model_name, p.now(), body.stream)
    decode = state.engine.tokenizer.decode
    if body.stream:
        return StallGuardedStream(_sse(pendings, request, kind, head, len(ids), body.include_usage, decode),
                                  state.limits.stall_timeout_s, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})
    return await _whole(pendings, request, kind, head, len(ids), decode)


async def _collect(pending: _Pending, request: HTTPRequest):
    """(text, logprob entries, the final event or None if the client left)."""
    text, entries, event = [], [], None
    try:
        while (event := await pending.next(request)) is not None:
            text.append(event.text)
            entries += event.logprobs or []
            if event.finish_reason is not None:
                break
    finally:
        pending.close()
    return "".join(text), entries, event


async def _whole(pendings: list[_Pending], request: HTTPRequest, kind: p.Kind, head: dict, prompt_tokens: int,
                 decode):
    collected = await asyncio.gather(*[_collect(pending, request) for pending in pendings])
    if any(event is None for _, _, event in collected):  # the client left; nobody reads this
        return Response(status_code=499)
    failed = next((event for _, _, event in collected if event.finish_reason == "error"), None)
    if failed is not None:
        return _error(f"generation failed: {failed.error}")
    choices = []
    for i, (pending, (text, entries, event)) in enumerate(zip(pendings, collected)):
        logprobs = p.logprobs_body(kind, entries, decode) if pending.logprobs else None
        one = p.choice(kind, text, p.FINISH.get(event.finish_reason, "stop"), False, logprobs, i)
        if pending.tool_calls:
            one["message"]["content"], calls = tools.parse(text)
            if calls:
                one["message"]["tool_calls"], one["finish_reason"] = calls, "tool_calls"
        choices.append(one)
    results = [event.result for _, _, event in collected]
    return {**head, "choices": choices, "usage": p.usage(prompt_tokens, results),
            "speculation": p.speculation(results[0].stats if results[0] else None)}


def _error(message: str):
    return JSONResponse(p.error_body(message, 500, "server_error"), status_code=500)


def _sse(pendings: list[_Pending], request: HTTPRequest, kind: p.Kind, head: dict, prompt_tokens: int,
         include_usage: bool, decode):
    def chunk(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events(i: int, pending: _Pending, out: asyncio.Queue):
        while (event := await pending.next(request)) is not None:
            await out.put((i, event))
            if event.finish_reason is not None:
                return
        await out.put((i, None))  # the client left

    async def stream():
        out: asyncio.Queue = asyncio.Queue()
        readers = [asyncio.create_task(events(i, pending, out)) for i, pending in enumerate(pendings)]
        try:
            if kind == "chat":  # OpenAI's first chat chunk names the role
                for i in range(len(pendings)):
                    yield chunk({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]})
            offsets, results, open_ = [0] * len(pendings), [None] * len(pendings), len(pendings)
            held = [""] * len(pendings)  # a tools request's text, sent at its end
            while open_:
                i, event = await out.get()
                if event is None:
                    return
                if pendings[i].tool_calls:
                    held[i] += event.text
                    if event.finish_reason is not None:
                        yield chunk(_tool_delta(head, held[i], i))
                elif event.text or event.logprobs:
                    logprobs = None
                    if pendings[i].logprobs:
                        logprobs = p.logprobs_body(kind, event.logprobs or [], decode, offsets[i])
                        offsets[i] += sum(len(decode([e.token])) for e in event.logprobs or [])
                    yield chunk({**head, "choices": [p.choice(kind, event.text, None, True, logprobs, i)]})
                if event.finish_reason is not None:
                    open_ -= 1
                    results[i] = event.result
                    final = _final(kind, head, event, i)
                    if pendings[i].tool_calls and tools.parse(held[i])[1] and final["choices"]:
                        final["choices"][0]["finish_reason"] = "tool_calls"
                    yield chunk(final)
            if include_usage:
                yield chunk({**head, "choices": [], "usage": p.usage(prompt_tokens, results)})
            yield "data: [DONE]\n\n"
        finally:  # also runs when the client disconnects (the stream task is cancelled)
            for reader in readers:
                reader.cancel()
            for pending in pendings:
                pending.close()

    return stream()


def _tool_delta(head: dict, text: str, index: int) -> dict:
    """A tools request's whole reply as one streamed delta: its text and its tool calls."""
    content, calls = tools.parse(text)
    delta = {"content": content}
    if calls:
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
    return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}


def _final(kind: p.Kind, head: dict, event: Event, index: int) -> dict:
    """A choice's last chunk: its finish reason and its speculation summary (or the error)."""
    if event.finish_reason == "error":
        return {**head, "choices": [], "error": p.error_body(f"generation failed: {event.error}", 500,
                                                                "server_error")["error"]}
    stats = event.result.stats if event.result is not None else None
    reason = p.FINISH.get(event.finish_reason, "stop")
    return {**head, "choices": [p.choice(kind, None if kind == "chat" else "", reason, True, None, index)],
            "speculation": p.speculation(stats)}
