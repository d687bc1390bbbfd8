"""OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Binds 127.0.0.1 by
default. Requests are validated (types, bounds, prompt length) and refused with a 400 and an
OpenAI-style error body; a bad request never takes the server down. One generation runs at a
time (the models hold one KV cache each); others wait their turn.

Besides the OpenAI fields, a request may set the decoding of this runtime: ``mode``,
``variant``, ``k``, ``l_D``, ``l_Q``, ``tau_Q``, ``tau_T``, ``divergence`` (with the openai client:
``extra_body={...}``). Responses carry ``usage`` and a ``kibidango`` field with the request's
speculative-decoding metrics."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kibidango.backends.base import ContextLengthError
from kibidango.pipeline import Pipeline
from kibidango.speculative import TIERS, Metrics

__all__ = ["create_app", "serve"]


class _Decoding(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    mode: Literal["ar", "sd", "pyramid"] | None = None
    variant: Literal["fuzzy", "assisted", "exact"] | None = None
    k: int | None = Field(None, ge=1, le=32)
    l_D: int | None = Field(None, ge=1, le=32)
    l_Q: int | None = Field(None, ge=1, le=64)
    tau_Q: float | None = Field(None, ge=0, le=1)
    tau_T: float | None = Field(None, ge=0, le=1)
    divergence: Literal["tv", "js", "kl"] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop: at most 4 non-empty strings")
        return stops


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
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Decoding):
    messages: list[ChatMessage] = Field(min_length=1)


class _Stats:
    """Counters for /metrics."""

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.totals = Metrics("all")
        self.lock = threading.Lock()

    def prometheus(self, model: str) -> str:
        t = self.totals
        lines = [
            "# HELP kibidango_requests_total Generation requests served.",
            "# TYPE kibidango_requests_total counter",
            f'kibidango_requests_total{{model="{model}"}} {self.requests}',
            "# TYPE kibidango_request_errors_total counter",
            f'kibidango_request_errors_total{{model="{model}"}} {self.errors}',
            "# TYPE kibidango_prompt_tokens_total counter",
            f'kibidango_prompt_tokens_total{{model="{model}"}} {t.prompt_tokens}',
            "# TYPE kibidango_generation_tokens_total counter",
            f'kibidango_generation_tokens_total{{model="{model}"}} {t.generated_tokens}',
            "# TYPE kibidango_target_forward_passes_total counter",
            f'kibidango_target_forward_passes_total{{model="{model}"}} {t.forward_calls.get("target", 0)}',
            "# TYPE kibidango_generation_seconds_total counter",
            f'kibidango_generation_seconds_total{{model="{model}"}} {t.seconds:.6f}',
            "# TYPE kibidango_spec_decode_num_draft_tokens_total counter",
            *(f'kibidango_spec_decode_num_draft_tokens_total{{model="{model}",stage="{s}"}} {n}' for s, n in t.num_draft_tokens.items()),
            "# TYPE kibidango_spec_decode_num_accepted_tokens_total counter",
            *(f'kibidango_spec_decode_num_accepted_tokens_total{{model="{model}",stage="{s}"}} {n}' for s, n in t.num_accepted_tokens.items()),
        ]
        return "\n".join(lines) + "\n"


def _chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    turns = [m.model_dump() for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    # No chat template (the tiny story models): a plain transcript ending with the assistant's turn.
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


def create_app(pipe: Pipeline, model_name: str = "kibidango", max_prompt_tokens: int | None = None, max_tokens_limit: int = 1024):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="kibidango", version="0.1.0")
    stats = _Stats()
    generate_lock = threading.Lock()
    context = min(m.context_length for m in pipe.models.values())
    prompt_limit = min(max_prompt_tokens or context, context - 1)

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
        with stats.lock:
            stats.errors += 1
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)

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

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")

    def prepare(req: _Decoding, prompt: str) -> tuple[list[int], dict[str, Any]] | JSONResponse:
        ids = pipe.encode(prompt)
        if len(ids) > prompt_limit:
            return error(400, f"prompt: {len(ids)} tokens; this server accepts at most {prompt_limit}", "prompt")
        max_tokens = req.max_tokens or 16
        if max_tokens > max_tokens_limit:
            return error(400, f"max_tokens: {max_tokens} exceeds this server's limit of {max_tokens_limit}", "max_tokens")
        kw = {k: getattr(req, k) for k in ("temperature", "top_p", "seed", "mode", "variant", "k", "l_D", "l_Q", "tau_Q", "tau_T", "divergence")}
        kw["max_new_tokens"] = max_tokens
        if kw["mode"] and any(t not in pipe.models for t in TIERS[kw["mode"]]):
            return error(400, f"mode: {kw['mode']} needs tiers this server did not load", "mode")
        try:
            pipe.config(**kw)
        except ValueError as e:
            return error(400, str(e))
        return ids, kw

    def finish(metrics: Metrics) -> dict:
        with stats.lock:
            stats.requests += 1
            stats.totals.add(metrics)
        usage = {"prompt_tokens": metrics.prompt_tokens, "completion_tokens": metrics.generated_tokens,
                 "total_tokens": metrics.prompt_tokens + metrics.generated_tokens}  # fmt: skip
        return {"usage": usage, "kibidango": metrics.to_dict()}

    def run(ids, kw, stop) -> tuple[str, Metrics]:
        with generate_lock:
            result = pipe.generate(ids, stop=stop, **kw)
        return result.text, result.metrics

    def sse(ids, kw, stop, chunk) -> Iterator[str]:
        metrics = Metrics(kw.get("mode") or pipe.defaults.mode)
        with generate_lock:
            try:
                for piece in pipe.stream(ids, stop=stop, metrics=metrics, **kw):
                    yield f"data: {json.dumps(chunk(piece, None))}\n\n"
            except (ContextLengthError, ValueError) as e:
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'invalid_request_error'}})}\n\n"
                return
        yield f"data: {json.dumps({**chunk('', metrics.finish_reason), **finish(metrics)})}\n\n"
        yield "data: [DONE]\n\n"

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kibidango"}]}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(stats.prometheus(model_name), media_type="text/plain; version=0.0.4")

    def respond(req: _Decoding, prompt: str, object_name: str, choice):
        """The body of both endpoints: ``choice(text, finish_reason, streaming)`` builds one
        choice of the endpoint's response or stream chunk."""
        prepared = prepare(req, prompt)
        if isinstance(prepared, JSONResponse):
            return prepared
        ids, kw = prepared
        prefix = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}[object_name]
        head = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}
        if req.stream:
            def chunk(text, reason):
                return {**head, "object": object_name + (".chunk" if object_name.startswith("chat") else ""),
                        "choices": [choice(text, reason, True)]}  # fmt: skip
            return StreamingResponse(sse(ids, kw, req.stop, chunk), media_type="text/event-stream")
        try:
            text, m = run(ids, kw, req.stop)
        except (ContextLengthError, ValueError) as e:
            return error(400, str(e))
        return {**head, "object": object_name, "choices": [choice(text, m.finish_reason, False)], **finish(m)}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        def choice(text, reason, streaming):
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        return respond(req, req.prompt, "text_completion", choice)

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest):
        def choice(text, reason, streaming):
            if streaming:
                return {"index": 0, "delta": {"role": "assistant", "content": text} if text else {}, "finish_reason": reason}
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}

        return respond(req, _chat_prompt(pipe.tokenizer, req.messages), "chat.completion", choice)

    return app


def serve(bundle: str, host: str = "127.0.0.1", port: int = 8000, backend: str = "torch", mode: str | None = None,
          max_prompt_tokens: int | None = None, max_tokens_limit: int = 1024, **overrides: Any) -> None:  # fmt: skip
    import uvicorn

    # Loads the tiers of the default mode; a request may choose any mode those tiers serve
    # (a pyramid server also serves sd and ar).
    pipe = Pipeline.from_bundle(bundle, backend=backend, mode=mode, **overrides)
    name = pipe.bundle.meta.get("preset", "kibidango") if pipe.bundle else "kibidango"
    app = create_app(pipe, model_name=f"kibidango-{name}", max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit)
    uvicorn.run(app, host=host, port=port, log_level="info")
