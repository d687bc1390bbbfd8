"""OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Binds 127.0.0.1 by
default. Requests are validated (types, bounds, prompt length) and refused with a 400 and an
OpenAI-style error body; a bad request never takes the server down. Errors never carry exception
text or tracebacks to the client (the server log has them).

Under load: one generation decodes at a time (the models hold one KV cache each), or with
``parallel`` > 1 up to that many, their forward passes merged by :class:`kibidango.batching.Batcher`
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
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from kibidango.batching import Batcher
from kibidango.cascade.memory import SessionMemory
from kibidango.cascade.pipeline import CascadePipeline, CascadeResult, Draft
from kibidango.pipeline import Pipeline
from kibidango.server.auth import BearerAuth, BodyLimit
from kibidango.server.chat_template import TemplateBoundError, render_chat
from kibidango.server.metrics import Stats, scheduler_metrics
from kibidango.server.scheduler import HEALTH_STALL_S, Generation, Scheduler
from kibidango.server.schema import ChatRequest, CompletionRequest, Decoding
from kibidango.speculative import REQUEST_SETTINGS, TIERS, Metrics

log = logging.getLogger("kibidango.server")


_CLOUD_PROMPT_TOKENS = 32_768  # the cascade model's prompt bound without --max-prompt-tokens


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


def _max_token_bytes(tokenizer) -> int:
    """The longest vocabulary entry in UTF-8 bytes: no token stands for more bytes of text than its
    spelling (sentencepiece's "▁" and byte-fallback pieces only overstate), so a prompt of
    more than ``limit * this`` bytes has more than ``limit`` tokens and is refused untokenised."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 64
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=64)


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
    :class:`kibidango.batching.Batcher` over ``pipe``, which it rewires). ``api_keys``: every
    ``/v1/`` request must bear one (:class:`BearerAuth`); session memory is then kept per key.
    ``stall_seconds``: a generation that makes no progress for this long turns ``/health`` to 503
    ("wedged"), so a supervisor can restart the server. ``cascade``: requests for the model
    ``<model_name>-cascade`` go through it (tier, confidence, cost and budget left in the response's
    ``kibidango.cascade``). ``memory``: chat requests with a session id (the ``session_id`` field or
    the ``X-Session-Id`` header) get the session's last exchanges as context. ``max_queue``:
    requests waiting for the models beyond it are refused (429 + Retry-After);
    ``request_timeout_s``: a request not done this long after it came is cancelled (504)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    stats = Stats()
    batcher = Batcher(pipe, parallel) if parallel > 1 else None
    scheduler = Scheduler(pipe, stall_seconds, max_queue, request_timeout_s, batcher)
    cascade_name = f"{model_name}-cascade" if cascade is not None else None
    served = [model_name] + ([cascade_name] if cascade_name else [])

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.closing.set()  # shutdown: every generation stops after its current round
        if batcher is not None:
            batcher.close()

    app = FastAPI(title="kibidango", version="0.1.0", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.stats = stats
    context = min(m.context_length for m in pipe.models.values())
    prompt_limit = min(max_prompt_tokens or context, context - 1)
    token_bytes = _max_token_bytes(pipe.tokenizer)
    # The cascade's model takes prompts past the local context: its cloud tier answers them.
    cloud_limit = max_prompt_tokens or _CLOUD_PROMPT_TOKENS
    if cascade is None or cascade.client is None:
        cloud_limit = prompt_limit

    def limits(model: str | None) -> tuple[int, int]:
        """(tokens, bytes) a prompt to ``model`` may have."""
        tokens = cloud_limit if model is not None and model == cascade_name else prompt_limit
        return tokens, tokens * token_bytes

    def error(
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
        count: bool = True,
    ) -> JSONResponse:
        if count:
            stats.count_error()
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": param, "code": code}},
            status_code=status,
            headers=headers,
        )

    def refuse(why: str) -> JSONResponse:
        """A request the server cannot take now: 429 (queue full) or 503 (shutting down), both
        with Retry-After; counted in kibidango_requests_refused_total, not as errors."""
        wait = scheduler.retry_after()
        if why == "queue_full":
            message = f"the server is at its limit of {scheduler.max_queue} queued requests; retry after {wait} s"
            return error(
                429,
                message,
                kind="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(wait)},
                count=False,
            )
        return error(
            503,
            "the server is shutting down; retry on another replica",
            kind="server_unavailable",
            code="shutting_down",
            headers={"Retry-After": str(wait)},
            count=False,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            at = first["loc"][-1] if first.get("loc") else "?"
            detail = (first.get("ctx") or {}).get("error", "")
            return error(400, f"the request body is not valid JSON (at character {at}): {detail}")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) + ': ' if loc else ''}{first.get('msg', 'invalid request')}"
        return error(400, message, ".".join(loc) or None)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        # FastAPI's own refusals (a body it cannot parse, e.g. JSON nested past Python's
        # recursion limit; unknown paths; wrong methods), in OpenAI's error shape.
        message = "the request body could not be parsed as JSON" if exc.status_code == 400 else str(exc.detail)
        return error(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        ref = uuid.uuid4().hex[:12]
        log.error(f"request {ref} failed", exc_info=exc)
        return error(500, f"internal error (reference {ref}; the server log has the details)", kind="server_error")

    def prepare(
        req: Decoding, prompt: str, query: str, ids: list[int] | None = None
    ) -> tuple[list[int], dict[str, Any]] | JSONResponse:
        if req.model is not None and req.model not in served:
            return error(
                404,
                f"The model '{req.model}' does not exist; this server serves {', '.join(repr(m) for m in served)}",
                "model",
                code="model_not_found",
            )
        token_limit, bytes_limit = limits(req.model)
        size = len(prompt.encode("utf-8"))
        if size > bytes_limit:
            return error(
                400,
                f"prompt: {size} bytes, more than {token_limit} tokens can spell; this server accepts at most "
                f"{token_limit} tokens",
                "prompt",
            )
        ids = ids if ids is not None else pipe.encode(prompt)
        if len(ids) > token_limit:
            return error(400, f"prompt: {len(ids)} tokens; this server accepts at most {token_limit}", "prompt")
        max_tokens = req.max_tokens or 16
        if max_tokens > max_tokens_limit:
            return error(
                400, f"max_tokens: {max_tokens} exceeds this server's limit of {max_tokens_limit}", "max_tokens"
            )
        kw = {k: getattr(req, k) for k in ("mode", *REQUEST_SETTINGS)}
        kw["max_new_tokens"] = max_tokens
        if kw["mode"] and any(t not in pipe.models for t in TIERS[kw["mode"]]):
            return error(400, f"mode: {kw['mode']} needs tiers this server did not load", "mode")
        try:
            cfg = pipe.config(**kw)
        except ValueError as e:
            return error(400, str(e))
        if why := pipe.decoder.table_missing(cfg):
            return error(400, why, "ngram_table")
        if req.adapter is not None:
            known = pipe.adapters.adapters.domains if pipe.adapters is not None else []
            if req.adapter not in ("auto", "none", *known):
                return error(
                    400, f"adapter: {req.adapter!r} is not auto, none or one of: {', '.join(known) or '-'}", "adapter"
                )
            kw["adapter"] = req.adapter
        kw["query"] = query
        return ids, kw

    def finish(metrics: Metrics, result: CascadeResult | None) -> dict:
        stats.count(metrics, result)
        usage = {
            "prompt_tokens": metrics.prompt_tokens,
            "completion_tokens": metrics.generated_tokens,
            "total_tokens": metrics.prompt_tokens + metrics.generated_tokens,
        }
        extra = metrics.to_dict()
        if result is not None:
            extra["cascade"] = {k: v for k, v in result.to_dict().items() if k != "local"}
        return {"usage": usage, "kibidango": extra}

    def outcome(
        value: Any, metrics: Metrics, parts: list[str]
    ) -> tuple[str, str | None, Metrics, CascadeResult | None]:
        """(text, finish reason, metrics, cascade result) of a finished request."""
        if isinstance(value, Draft):  # cancelled after the local phase: the cloud was not asked
            value = value.result
        if isinstance(value, CascadeResult):
            local = value.local.metrics if value.local is not None else metrics
            reason = local.finish_reason if value.tier in ("local", "validated") else "stop"
            return value.text, reason, local, value
        return "".join(parts), metrics.finish_reason, metrics, None

    def failure(kind: str, exc: Any) -> JSONResponse:
        if kind == "error":
            return error(400, str(exc))
        if kind == "timeout":
            return error(
                504,
                f"the request did not finish within this server's {scheduler.request_timeout_s:g} s",
                kind="timeout",
                code="request_timeout",
            )
        if kind in ("shutting_down", "queue_full"):
            return refuse(kind)
        if kind == "cancelled":
            return JSONResponse({"error": {"message": "cancelled", "type": "cancelled"}}, status_code=499)
        return error(500, "internal error during generation (the server log has the details)", kind="server_error")

    def scope_of(request: Request) -> str:
        """Whose sessions a request may use: its API key's digest ("" on a server without keys)."""
        return getattr(request.state, "key_scope", "")

    async def remember(session: str | None, query: str, text: str, scope: str) -> None:
        if memory is not None and session is not None and text:
            await asyncio.to_thread(memory.add, session, query, text, scope)

    async def sse(gen: Generation, metrics: Metrics, chunk, done) -> AsyncIterator[str]:
        parts: list[str] = []
        try:
            while True:
                kind, value = await gen.queue.get()
                if kind == "text":
                    parts.append(value)
                    yield f"data: {json.dumps(chunk(value, None))}\n\n"
                    continue
                if kind == "end":
                    text, reason, used, result = outcome(value, metrics, parts)
                    if result is not None and text:  # the cascade's answer comes whole, once its tier is known
                        yield f"data: {json.dumps(chunk(text, None))}\n\n"
                    yield f"data: {json.dumps({**chunk('', reason), **finish(used, result)})}\n\n"
                    await done(text)
                else:
                    body = json.loads(failure(kind, value).body)
                    yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:  # the client went away (Starlette cancels this generator) or the stream ended
            gen.cancel.set()

    async def collect(gen: Generation, request: Request) -> tuple[str, Any, list[str]] | None:
        """How a non-streamed request ended (kind, value, text pieces), or None if the client
        disconnected (then the generation is cancelled)."""
        parts: list[str] = []
        checked = time.monotonic()
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(gen.queue.get(), timeout=0.25)
                except TimeoutError:
                    kind, value = "", None
                if time.monotonic() - checked >= 0.25:  # between pieces too: they may come faster
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return None
                if kind == "text":
                    parts.append(value)
                elif kind:
                    return kind, value, parts
        finally:
            gen.cancel.set()

    @app.get("/health")
    def health():
        status, body = scheduler.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "kibidango"} for m in served],
        }

    @app.get("/metrics")
    def metrics():
        text = stats.prometheus(model_name, scheduler.cancelled, pipe.adapters.loads if pipe.adapters else 0)
        text += scheduler_metrics(model_name, scheduler)
        if cascade is not None:
            text += stats.cascade_metrics(model_name, cascade)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

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
        prepared = prepare(req, prompt, query, ids)
        if isinstance(prepared, JSONResponse):
            return prepared
        ids, kw = prepared
        why = scheduler.admit()
        if why is not None:
            return refuse(why)
        prefix = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}[object_name]
        name = req.model or model_name
        head = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": name}
        metrics = Metrics(kw.get("mode") or pipe.defaults.mode)
        if name == cascade_name:

            def locked(should_stop, emit):
                return cascade.local(ids, messages=messages, should_stop=should_stop, stop=req.stop, **kw)

            gen = scheduler.start(locked, cascade.escalate)
        else:

            def locked(should_stop, emit):
                for piece in pipe.stream(ids, stop=req.stop, metrics=metrics, should_stop=should_stop, **kw):
                    emit(piece)

            gen = scheduler.start(locked)

        async def done(text: str) -> None:
            await remember(session, query, text, scope_of(request))

        if req.stream:

            def chunk(text, reason):
                return {
                    **head,
                    "object": object_name + (".chunk" if object_name.startswith("chat") else ""),
                    "choices": [choice(text, reason, True)],
                }

            return StreamingResponse(sse(gen, metrics, chunk, done), media_type="text/event-stream")
        ended = await collect(gen, request)
        if ended is None:  # nobody to answer; 499 is what proxies log for this
            return JSONResponse(
                {"error": {"message": "client closed the request", "type": "cancelled"}}, status_code=499
            )
        kind, value, parts = ended
        if kind != "end":
            return failure(kind, value)
        text, reason, used, result = outcome(value, metrics, parts)
        await done(text)
        return {**head, "object": object_name, "choices": [choice(text, reason, False)], **finish(used, result)}

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
            try:
                SessionMemory.check_id(session)
            except ValueError as e:
                return error(400, str(e), "session_id")
            if memory is None:
                return error(400, "session_id: this server keeps no session memory", "session_id")
            history = await asyncio.to_thread(memory.context, session, scope_of(request))
        turns = history + [{"role": m.role, "content": m.content} for m in req.messages]
        query = next((m.content for m in reversed(req.messages) if m.role == "user"), req.messages[-1].content)
        try:  # the bundle's template is code: rendered off the event loop, within time and size bounds
            prompt = await asyncio.to_thread(_chat_prompt, pipe.tokenizer, turns)
        except TemplateBoundError as e:
            return error(400, str(e), "messages", code="chat_template")
        fits = len(prompt.encode("utf-8")) <= limits(req.model)[1]
        ids = await asyncio.to_thread(_chat_ids, pipe.tokenizer, prompt, turns) if fits else None
        return await respond(request, req, prompt, "chat.completion", choice, query, turns, session, ids)

    @app.delete("/v1/sessions/{session_id}")
    async def forget(request: Request, session_id: str):
        """Forget a session's memory (only the calling key's session of that id)."""
        try:
            SessionMemory.check_id(session_id)
        except ValueError as e:
            return error(400, str(e), "session_id")
        if memory is None:
            return error(404, "this server keeps no session memory", "session_id", code="not_found")
        removed = await asyncio.to_thread(memory.forget, session_id, scope_of(request))
        return {"id": session_id, "object": "session", "deleted": True, "exchanges": removed}

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, on_refuse=stats.count_error)
    if api_keys:  # outermost: a request without a key is refused before its body is read
        app.add_middleware(BearerAuth, keys=list(api_keys), on_refuse=stats.count_error)
    return app
