"""OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Binds 127.0.0.1 by
default. Requests are validated (types, bounds, prompt length) and refused with a 400 and an
OpenAI-style error body; a bad request never takes the server down. One generation runs at a
time (the models hold one KV cache each); others wait their turn. A client that disconnects
cancels its generation after the current decoding round, streaming or not; ``/health`` answers 503
when a generation has made no progress for ``stall_seconds``; shutdown cancels what runs.
Errors never carry exception text or tracebacks to the client (the server log has them).

Besides the OpenAI fields, a request may set the decoding of this runtime: ``mode``,
``variant``, ``k``, ``l_D``, ``l_Q``, ``tau_Q``, ``tau_T``, ``divergence`` (with the openai client:
``extra_body={...}``). Responses carry ``usage`` and a ``kibidango`` field with the request's
speculative-decoding metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request  # the server extra; this module is imported only to serve
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kibidango.backends.base import ContextLengthError
from kibidango.pipeline import Pipeline
from kibidango.speculative import TIERS, Metrics

__all__ = ["create_app", "serve"]

log = logging.getLogger("kibidango.server")


def _valid_text(value: str, field: str) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: not valid Unicode (a lone surrogate at character {e.start})") from None
    return value


class _Decoding(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    mode: Literal["ar", "sd", "pyramid"] | None = None
    variant: Literal["fuzzy", "assisted", "exact"] | None = None
    k: int | None = Field(None, ge=1, le=32)
    l_D: int | None = Field(None, ge=1, le=32)
    l_Q: int | None = Field(None, ge=1, le=64)
    tau_Q: float | None = Field(None, ge=0, le=1)
    tau_T: float | None = Field(None, ge=0, le=1)
    divergence: Literal["tv", "js", "kl"] | None = None
    adapter: str | None = Field(None, max_length=64, description="auto, none or a domain; default: the server's")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop: at most 4 non-empty strings")
        return [_valid_text(s, "stop") for s in stops] if stops is not None else None


class CompletionRequest(_Decoding):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("prompt: exactly one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("prompt: must not be empty")
        return _valid_text(v, "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return _valid_text(v, "content")


class ChatRequest(_Decoding):
    messages: list[ChatMessage] = Field(min_length=1)


class _Stats:
    """Counters for /metrics."""

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.totals = Metrics("all")
        self.domains: dict[str, int] = {}
        self.adapters: dict[str, int] = {}
        self.confidence_sum = 0.0
        self.confidence_count = 0
        self.lock = threading.Lock()

    def count(self, metrics: Metrics) -> None:
        with self.lock:
            self.requests += 1
            self.totals.add(metrics)
            if metrics.domain is not None:
                self.domains[metrics.domain] = self.domains.get(metrics.domain, 0) + 1
            name = metrics.adapter or "none"
            self.adapters[name] = self.adapters.get(name, 0) + 1
            if metrics.confidence is not None:
                self.confidence_sum += metrics.confidence
                self.confidence_count += 1

    def count_error(self) -> None:
        with self.lock:
            self.errors += 1

    def prometheus(self, model: str, cancelled: int = 0, adapter_loads: int = 0) -> str:
        t = self.totals
        lines = [
            "# HELP kibidango_requests_total Generation requests served.",
            "# TYPE kibidango_requests_total counter",
            f'kibidango_requests_total{{model="{model}"}} {self.requests}',
            "# TYPE kibidango_request_errors_total counter",
            f'kibidango_request_errors_total{{model="{model}"}} {self.errors}',
            "# HELP kibidango_requests_cancelled_total Generations stopped because the client went away (or at shutdown).",
            "# TYPE kibidango_requests_cancelled_total counter",
            f'kibidango_requests_cancelled_total{{model="{model}"}} {cancelled}',
            "# TYPE kibidango_prompt_tokens_total counter",
            f'kibidango_prompt_tokens_total{{model="{model}"}} {t.prompt_tokens}',
            "# TYPE kibidango_generation_tokens_total counter",
            f'kibidango_generation_tokens_total{{model="{model}"}} {t.generated_tokens}',
            "# TYPE kibidango_target_forward_passes_total counter",
            f'kibidango_target_forward_passes_total{{model="{model}"}} {t.forward_calls.get("target", 0)}',
            "# TYPE kibidango_generation_seconds_total counter",
            f'kibidango_generation_seconds_total{{model="{model}"}} {t.seconds:.6f}',
            "# TYPE kibidango_spec_decode_num_draft_tokens_total counter",
            *(
                f'kibidango_spec_decode_num_draft_tokens_total{{model="{model}",stage="{s}"}} {n}'
                for s, n in t.num_draft_tokens.items()
            ),
            "# TYPE kibidango_spec_decode_num_accepted_tokens_total counter",
            *(
                f'kibidango_spec_decode_num_accepted_tokens_total{{model="{model}",stage="{s}"}} {n}'
                for s, n in t.num_accepted_tokens.items()
            ),
            "# HELP kibidango_requests_by_domain_total Requests by the domain the router chose.",
            "# TYPE kibidango_requests_by_domain_total counter",
            *(
                f'kibidango_requests_by_domain_total{{model="{model}",domain="{d}"}} {n}'
                for d, n in self.domains.items()
            ),
            "# HELP kibidango_requests_by_adapter_total Requests by the adapter the target ran with.",
            "# TYPE kibidango_requests_by_adapter_total counter",
            *(
                f'kibidango_requests_by_adapter_total{{model="{model}",adapter="{a}"}} {n}'
                for a, n in self.adapters.items()
            ),
            "# HELP kibidango_adapter_loads_total Domain adapters loaded (an evicted one asked for again loads again).",
            "# TYPE kibidango_adapter_loads_total counter",
            f'kibidango_adapter_loads_total{{model="{model}"}} {adapter_loads}',
            "# HELP kibidango_answer_confidence Calibrated answer confidence (2G) over the requests scored.",
            "# TYPE kibidango_answer_confidence summary",
            f'kibidango_answer_confidence_sum{{model="{model}"}} {self.confidence_sum:.6f}',
            f'kibidango_answer_confidence_count{{model="{model}"}} {self.confidence_count}',
        ]
        return "\n".join(lines) + "\n"


def _chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    turns = [m.model_dump() for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    # No chat template (the tiny story models): a plain transcript ending with the assistant's turn.
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


_HEALTH_STALL_S = 120.0


class _Generation:
    """One request's generation, run on a worker thread and handed to the event loop piece by
    piece. Setting ``cancel`` stops it after the current decoding round (or before it starts,
    while it waits its turn)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancel = threading.Event()

    def put(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


class _Scheduler:
    """One generation at a time (the models hold one KV cache each), each on its own daemon
    thread. The lock is held by that thread only while it decodes, never across a network write,
    so a client that disconnects cannot keep it; ``closing`` cancels everything at shutdown."""

    def __init__(self, pipe: Pipeline, stall_seconds: float):
        self.pipe = pipe
        self.stall_seconds = stall_seconds
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.waiting = 0
        self.counts = threading.Lock()
        self.active_since: float | None = None
        self.last_progress: float | None = None
        self.cancelled = 0

    def start(self, ids: list[int], kw: dict[str, Any], stop: list[str] | None, metrics: Metrics) -> _Generation:
        gen = _Generation()
        threading.Thread(
            target=self._work, args=(gen, ids, kw, stop, metrics), name="kibidango-generate", daemon=True
        ).start()
        return gen

    def _stopped(self, gen: _Generation) -> bool:
        self.last_progress = time.monotonic()  # asked once per decoding round
        return gen.cancel.is_set() or self.closing.is_set()

    def _work(
        self, gen: _Generation, ids: list[int], kw: dict[str, Any], stop: list[str] | None, metrics: Metrics
    ) -> None:
        with self.counts:
            self.waiting += 1
        try:
            while not self.lock.acquire(timeout=0.05):
                if gen.cancel.is_set() or self.closing.is_set():
                    with self.counts:
                        self.cancelled += 1
                    gen.put("end")
                    return
        finally:
            with self.counts:
                self.waiting -= 1
        try:
            self.active_since = self.last_progress = time.monotonic()
            for piece in self.pipe.stream(
                ids, stop=stop, metrics=metrics, should_stop=lambda: self._stopped(gen), **kw
            ):
                gen.put("text", piece)
            if metrics.finish_reason == "cancelled":
                with self.counts:
                    self.cancelled += 1
            gen.put("end")
        except (ContextLengthError, ValueError) as e:
            gen.put("error", e)
        except Exception as e:  # a bug: logged here with its traceback, never sent to the client
            log.exception("generation failed")
            gen.put("crash", e)
        finally:
            self.active_since = None
            self.lock.release()

    def health(self) -> tuple[int, dict[str, Any]]:
        now = time.monotonic()
        active, last = self.active_since, self.last_progress
        body: dict[str, Any] = {"status": "ok", "generating": active is not None, "waiting": self.waiting}
        if active is not None and last is not None:
            body["generating_for_s"] = round(now - active, 3)
            body["no_progress_for_s"] = round(now - last, 3)
            if now - last > self.stall_seconds:
                body["status"] = "wedged"
                return 503, body
        if self.closing.is_set():
            body["status"] = "shutting down"
            return 503, body
        return 200, body


class _BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is refused (413) before it is parsed;
    the declared Content-Length is checked first, then the bytes as they arrive."""

    def __init__(self, app, max_bytes: int, on_refuse=lambda: None):
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            self.on_refuse()
            return await _send_error(
                send, 413, f"request body of {int(declared)} bytes exceeds this server's limit of {self.max_bytes}"
            )
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    from starlette.exceptions import HTTPException

                    raise HTTPException(413, f"request body exceeds this server's limit of {self.max_bytes} bytes")
            return message

        return await self.app(scope, counted, send)


async def _send_error(send, status: int, message: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    ).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


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
    stall_seconds: float = _HEALTH_STALL_S,
):
    """The FastAPI app. ``stall_seconds``: a generation that makes no progress for this long turns
    ``/health`` to 503 ("wedged"), so a supervisor can restart the server."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    stats = _Stats()
    scheduler = _Scheduler(pipe, stall_seconds)

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.closing.set()  # shutdown: every generation stops after its current round

    app = FastAPI(title="kibidango", version="0.1.0", lifespan=lifespan)
    app.state.scheduler = scheduler
    context = min(m.context_length for m in pipe.models.values())
    prompt_limit = min(max_prompt_tokens or context, context - 1)
    prompt_bytes_limit = prompt_limit * _max_token_bytes(pipe.tokenizer)

    def error(
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> JSONResponse:
        stats.count_error()
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status
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

    def prepare(req: _Decoding, prompt: str, query: str) -> tuple[list[int], dict[str, Any]] | JSONResponse:
        if req.model is not None and req.model != model_name:
            return error(
                404,
                f"The model '{req.model}' does not exist; this server serves '{model_name}'",
                "model",
                code="model_not_found",
            )
        size = len(prompt.encode("utf-8"))
        if size > prompt_bytes_limit:
            return error(
                400,
                f"prompt: {size} bytes, more than {prompt_limit} tokens can spell; this server accepts at most {prompt_limit} tokens",
                "prompt",
            )
        ids = pipe.encode(prompt)
        if len(ids) > prompt_limit:
            return error(400, f"prompt: {len(ids)} tokens; this server accepts at most {prompt_limit}", "prompt")
        max_tokens = req.max_tokens or 16
        if max_tokens > max_tokens_limit:
            return error(
                400, f"max_tokens: {max_tokens} exceeds this server's limit of {max_tokens_limit}", "max_tokens"
            )
        kw = {
            k: getattr(req, k)
            for k in (
                "temperature",
                "top_p",
                "seed",
                "mode",
                "variant",
                "k",
                "l_D",
                "l_Q",
                "tau_Q",
                "tau_T",
                "divergence",
            )
        }
        kw["max_new_tokens"] = max_tokens
        if kw["mode"] and any(t not in pipe.models for t in TIERS[kw["mode"]]):
            return error(400, f"mode: {kw['mode']} needs tiers this server did not load", "mode")
        try:
            pipe.config(**kw)
        except ValueError as e:
            return error(400, str(e))
        if req.adapter is not None:
            known = pipe.adapters.adapters.domains if pipe.adapters is not None else []
            if req.adapter not in ("auto", "none", *known):
                return error(
                    400, f"adapter: {req.adapter!r} is not auto, none or one of: {', '.join(known) or '-'}", "adapter"
                )
            kw["adapter"] = req.adapter
        kw["query"] = query
        return ids, kw

    def finish(metrics: Metrics) -> dict:
        stats.count(metrics)
        usage = {
            "prompt_tokens": metrics.prompt_tokens,
            "completion_tokens": metrics.generated_tokens,
            "total_tokens": metrics.prompt_tokens + metrics.generated_tokens,
        }
        return {"usage": usage, "kibidango": metrics.to_dict()}

    def failure(kind: str, exc: Exception) -> tuple[int, str, str]:
        if kind == "error":
            return 400, str(exc), "invalid_request_error"
        return 500, "internal error during generation (the server log has the details)", "server_error"

    async def sse(gen: _Generation, metrics: Metrics, chunk) -> AsyncIterator[str]:
        try:
            while True:
                kind, value = await gen.queue.get()
                if kind == "text":
                    yield f"data: {json.dumps(chunk(value, None))}\n\n"
                    continue
                if kind in ("error", "crash"):
                    stats.count_error()
                    _, message, err_type = failure(kind, value)
                    yield f"data: {json.dumps({'error': {'message': message, 'type': err_type, 'param': None, 'code': None}})}\n\n"
                else:
                    yield f"data: {json.dumps({**chunk('', metrics.finish_reason), **finish(metrics)})}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:  # the client went away (Starlette cancels this generator) or the stream ended
            gen.cancel.set()

    async def collect(gen: _Generation, request: Request) -> tuple[str, Any] | None:
        """The whole text of a non-streamed generation, or None if the client disconnected
        (then the generation is cancelled)."""
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
                elif kind == "end":
                    return "text", "".join(parts)
                elif kind:
                    return kind, value
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
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kibidango"}],
        }

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(
            stats.prometheus(model_name, scheduler.cancelled, pipe.adapters.loads if pipe.adapters else 0),
            media_type="text/plain; version=0.0.4",
        )

    async def respond(request: Request, req: _Decoding, prompt: str, object_name: str, choice, query: str):
        """The body of both endpoints: ``choice(text, finish_reason, streaming)`` builds one
        choice of the endpoint's response or stream chunk; ``query`` is what the router reads."""
        prepared = prepare(req, prompt, query)
        if isinstance(prepared, JSONResponse):
            return prepared
        ids, kw = prepared
        prefix = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}[object_name]
        head = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}
        metrics = Metrics(kw.get("mode") or pipe.defaults.mode)
        gen = scheduler.start(ids, kw, req.stop, metrics)
        if req.stream:

            def chunk(text, reason):
                return {
                    **head,
                    "object": object_name + (".chunk" if object_name.startswith("chat") else ""),
                    "choices": [choice(text, reason, True)],
                }

            return StreamingResponse(sse(gen, metrics, chunk), media_type="text/event-stream")
        outcome = await collect(gen, request)
        if outcome is None:  # nobody to answer; 499 is what proxies log for this
            return JSONResponse(
                {"error": {"message": "client closed the request", "type": "cancelled"}}, status_code=499
            )
        kind, value = outcome
        if kind != "text":
            status, message, err_type = failure(kind, value)
            return error(status, message, kind=err_type)
        return {
            **head,
            "object": object_name,
            "choices": [choice(value, metrics.finish_reason, False)],
            **finish(metrics),
        }

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

        query = next((m.content for m in reversed(req.messages) if m.role == "user"), req.messages[-1].content)
        prompt = _chat_prompt(pipe.tokenizer, req.messages)
        return await respond(request, req, prompt, "chat.completion", choice, query)

    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes, on_refuse=stats.count_error)
    return app


def serve(
    bundle: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    backend: str = "torch",
    mode: str | None = None,
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int = 1024,
    max_request_bytes: int = 4 << 20,
    stall_seconds: float = _HEALTH_STALL_S,
    expect_sha256: str | None = None,
    adapter: str = "auto",
    adapter_cache: int = 2,
    **overrides: Any,
) -> None:
    import uvicorn

    # Loads the tiers of the default mode; a request may choose any mode those tiers serve
    # (a pyramid server also serves sd and ar).
    pipe = Pipeline.from_bundle(
        bundle,
        backend=backend,
        mode=mode,
        expect_sha256=expect_sha256,
        adapter=adapter,
        adapter_cache=adapter_cache,
        **overrides,
    )
    name = pipe.bundle.meta.get("preset", "kibidango") if pipe.bundle else "kibidango"
    app = create_app(
        pipe,
        model_name=f"kibidango-{name}",
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        max_request_bytes=max_request_bytes,
        stall_seconds=stall_seconds,
    )
    # Open streams get 5 s to finish after SIGTERM; then they are cancelled, which cancels their
    # generations (uvicorn's default waits for them however long they take).
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
