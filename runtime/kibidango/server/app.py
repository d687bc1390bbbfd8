"""OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Binds 127.0.0.1 by
default. Requests are validated (types, bounds, prompt length) and refused with a 400 and an
OpenAI-style error body; a bad request never takes the server down. Errors never carry exception
text or tracebacks to the client (the server log has them).

Under load: one generation decodes at a time (the models hold one KV cache each), or with
``parallel`` > 1 up to that many, their forward passes merged by :class:`kibidango.decode.batching.Batcher`
(continuous batching: a request joins and leaves the batch between forwards); at most
``max_queue`` requests wait for them, the next is refused at once with 429 and Retry-After; a
request not finished ``request_timeout_s`` after it came is cancelled (504). A client that
disconnects cancels its generation after the current decoding round, streaming or not;
``/health`` answers 503 when a generation has made no progress for ``stall_seconds``. On SIGTERM
the server stops accepting, refuses what is still queued (503), lets running requests finish for
the grace period, then cancels them.

With a cascade (``serve --cascade CONFIG``) the model ``<model>-cascade`` answers through
:mod:`kibidango.cascade.pipeline`: the local phase holds the models, the cloud call does not, so
other requests decode while one waits for the cloud. Chat requests with a session id (field
``session_id`` or header ``X-Session-Id``) get that session's last exchanges as context (6D).

Besides the OpenAI fields, a request may set the decoding of this runtime: ``mode``,
``variant``, ``k``, ``l_D``, ``l_Q``, ``tau_Q``, ``tau_T``, ``divergence``, ``adapter`` (with the
openai client: ``extra_body={...}``). Responses carry ``usage`` and a ``kibidango`` field with
the request's speculative-decoding metrics (and ``cascade``: tier, confidence, cost, budget left)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request

from kibidango.cascade.memory import SessionMemory
from kibidango.cascade.pipeline import CascadePipeline
from kibidango.decode.batching import Batcher
from kibidango.pipeline import Pipeline
from kibidango.server import errors
from kibidango.server.auth import BearerAuth, BodyLimit
from kibidango.server.chat_template import TemplateBoundError, render_chat
from kibidango.server.errors import ApiError
from kibidango.server.metrics import Stats, scheduler_metrics
from kibidango.server.scheduler import HEALTH_STALL_S, Scheduler
from kibidango.server.schema import ChatRequest, CompletionRequest, Decoding
from kibidango.server.service import CompletionService

log = logging.getLogger("kibidango.server")


def _chat_prompt(tokenizer, turns: list[dict[str, str]]) -> str:
    """The chat's prompt: the bundle's chat template rendered within bounds
    (:func:`kibidango.server.chat_template.render_chat`; call it off the event loop)."""
    if getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, turns)
    # No chat template (a bare story model): a plain transcript ending with the assistant's turn.
    return "".join(f"{m['role']}: {m['content']}\n" for m in turns) + "assistant:"


def _chat_ids(tokenizer, prompt: str, turns: list[dict[str, str]]) -> list[int]:
    """The chat's token ids, as transformers' apply_chat_template makes them (the rendered text
    holds the BOS token already, so it is encoded without adding special tokens) — except that a
    message's text is text: ``</s><s>`` or ``<|im_start|>`` typed by a user stays those characters,
    never the special tokens the template alone places (:func:`_literal_ids`). Without a template,
    the transcript is encoded as a completion prompt is (the tokenizer's BOS), its text all literal."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(prompt, split_special_tokens=True)["input_ids"])
    if not _holds_special_text(tokenizer, turns):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    return _literal_ids(tokenizer, turns)


def _holds_special_text(tokenizer, turns: list[dict[str, str]]) -> bool:
    specials = set(getattr(tokenizer, "all_special_tokens", []))
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return any(s and s in m["content"] for m in turns for s in specials)


def _literal_ids(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """The template rendered around placeholders, its own text encoded with its special tokens and
    each message's text encoded with none (``split_special_tokens``) where its placeholder stands."""
    marks = [f"\ue000{i}\ue001" for i in range(len(turns))]  # private-use characters: no message holds them
    rendered = render_chat(tokenizer, [{**m, "content": marks[i]} for i, m in enumerate(turns)])
    ids: list[int] = []
    pieces = re.split("(\ue000\\d+\ue001)", rendered)
    for piece in pieces:
        if piece in marks:
            content = turns[marks.index(piece)]["content"]
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def create_app(
    pipe: Pipeline,
    model_name: str = "kibidango",
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int = 1024,
    max_request_bytes: int = 4 << 20,
    stall_seconds: float = HEALTH_STALL_S,
    cascade: CascadePipeline | None = None,
    memory: SessionMemory | None = None,
    max_queue: int = 64,
    request_timeout_s: float = 600.0,
    api_keys: list[str] | None = None,
    parallel: int = 1,
):
    """The FastAPI app. ``parallel``: generations decoded together (1: one at a time; more: a
    :class:`kibidango.decode.batching.Batcher` over ``pipe``, which it rewires). ``api_keys``: every
    ``/v1/`` request must bear one (:class:`BearerAuth`); session memory is then kept per key.
    ``stall_seconds``: a generation that makes no progress for this long turns ``/health`` to 503
    ("wedged"), so a supervisor can restart the server. ``cascade``: requests for the model
    ``<model_name>-cascade`` go through it (tier, confidence, cost and budget left in the response's
    ``kibidango.cascade``). ``memory``: chat requests with a session id (the ``session_id`` field or
    the ``X-Session-Id`` header) get the session's last exchanges as context. ``max_queue``:
    requests waiting for the models beyond it are refused (429 + Retry-After);
    ``request_timeout_s``: a request not done this long after it came is cancelled (504).
    What a completion does is :class:`kibidango.server.service.CompletionService`'s; the app routes."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    stats = Stats()
    batcher = Batcher(pipe, parallel) if parallel > 1 else None
    scheduler = Scheduler(pipe, stall_seconds, max_queue, request_timeout_s, batcher)
    service = CompletionService(
        pipe, scheduler, stats, model_name, max_prompt_tokens, max_tokens_limit, cascade, memory
    )

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.closing.set()  # shutdown: every generation stops after its current round
        if batcher is not None:
            batcher.close()

    app = FastAPI(title="kibidango", version="0.1.0", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.stats = stats
    app.state.service = service

    def reply(err: ApiError) -> JSONResponse:
        if err.counted:
            stats.count_error()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    _install_error_handlers(app, reply)
    _add_status_routes(app, service, scheduler, stats, pipe, cascade)
    _add_completion_routes(app, service, pipe, reply)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, on_refuse=stats.count_error)
    if api_keys:  # outermost: a request without a key is refused before its body is read
        app.add_middleware(BearerAuth, keys=list(api_keys), on_refuse=stats.count_error)
    return app


def _install_error_handlers(app, reply: Callable[[ApiError], Any]) -> None:
    """Every error the app answers is OpenAI-shaped (:mod:`kibidango.server.errors`) and counted."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return reply(errors.invalid_request(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return reply(errors.http_error(exc.status_code, exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        ref = uuid.uuid4().hex[:12]
        log.error(f"request {ref} failed", exc_info=exc)
        return reply(errors.unexpected(ref))


def scope_of(request: Request) -> str:
    """Whose sessions a request may use: its API key's digest ("" on a server without keys)."""
    return getattr(request.state, "key_scope", "")


def _add_status_routes(
    app, service: CompletionService, scheduler: Scheduler, stats: Stats, pipe: Pipeline, cascade
) -> None:
    """``/health``, ``/v1/models`` and ``/metrics``."""
    from fastapi.responses import JSONResponse, PlainTextResponse

    model_name = service.model_name

    @app.get("/health")
    def health():
        status, body = scheduler.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "kibidango"} for m in service.served],
        }

    @app.get("/metrics")
    def metrics():
        text = stats.prometheus(model_name, scheduler.cancelled, pipe.adapters.loads if pipe.adapters else 0)
        text += scheduler_metrics(model_name, scheduler)
        if cascade is not None:
            text += stats.cascade_metrics(model_name, cascade)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _add_completion_routes(app, service: CompletionService, pipe: Pipeline, reply: Callable[[ApiError], Any]) -> None:
    """``/v1/completions``, ``/v1/chat/completions`` and ``DELETE /v1/sessions/{id}``: each prepares
    its prompt and hands it to the service."""
    from fastapi.responses import StreamingResponse

    async def respond(
        request: Request,
        req: Decoding,
        prompt: str,
        object_name: str,
        choice,
        query: str,
        messages: list[dict[str, str]] | None = None,
        session: str | None = None,
        ids: list[int] | None = None,
    ):
        """The body of both endpoints: ``choice(text, finish_reason, streaming)`` builds one
        choice of the endpoint's response or stream chunk; ``query`` is what the router reads;
        ``messages``: the conversation a cloud tier answers."""
        prepared = service.prepare(req, prompt, query, ids)
        if isinstance(prepared, ApiError):
            return reply(prepared)
        running = service.run(prepared, req.stop, messages)
        if isinstance(running, ApiError):
            return reply(running)
        prefix = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}[object_name]
        head = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": running.model}

        async def done(text: str) -> None:
            await service.remember(session, query, text, scope_of(request))

        if req.stream:

            def chunk(text, reason):
                return {
                    **head,
                    "object": object_name + (".chunk" if object_name.startswith("chat") else ""),
                    "choices": [choice(text, reason, True)],
                }

            return StreamingResponse(service.stream(running, chunk, done), media_type="text/event-stream")
        end = await service.collect(running, request.is_disconnected)
        if end is None:  # nobody to answer
            return reply(errors.CLIENT_CLOSED)
        if isinstance(end, ApiError):
            return reply(end)
        await done(end.text)
        body = {**head, "object": object_name, "choices": [choice(end.text, end.reason, False)]}
        return {**body, **service.usage(end)}

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        def choice(text, reason, streaming):
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        return await respond(request, req, req.prompt, "text_completion", choice, req.prompt)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest):
        def choice(text, reason, streaming):
            if streaming:
                return {
                    "index": 0,
                    "delta": {"role": "assistant", "content": text} if text else {},
                    "finish_reason": reason,
                }
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}

        session = req.session_id or request.headers.get("x-session-id")
        history: list[dict[str, str]] = []
        if session is not None:
            history = await service.session_context(session, scope_of(request))
            if isinstance(history, ApiError):
                return reply(history)
        turns = history + [{"role": m.role, "content": m.content} for m in req.messages]
        query = next((m.content for m in reversed(req.messages) if m.role == "user"), req.messages[-1].content)
        try:  # the bundle's template is code: rendered off the event loop, within time and size bounds
            prompt = await asyncio.to_thread(_chat_prompt, pipe.tokenizer, turns)
        except TemplateBoundError as e:
            return reply(ApiError(400, str(e), "messages", code="chat_template"))
        fits = len(prompt.encode("utf-8")) <= service.limits(req.model)[1]
        ids = await asyncio.to_thread(_chat_ids, pipe.tokenizer, prompt, turns) if fits else None
        return await respond(request, req, prompt, "chat.completion", choice, query, turns, session, ids)

    @app.delete("/v1/sessions/{session_id}")
    async def forget(request: Request, session_id: str):
        """Forget a session's memory (only the calling key's session of that id)."""
        result = await service.forget(session_id, scope_of(request))
        return reply(result) if isinstance(result, ApiError) else result
