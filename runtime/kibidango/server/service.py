"""The completions service: what ``/v1/completions`` and ``/v1/chat/completions`` do between the
request body and the response, without HTTP — prepare (bounds, model, decoding settings,
adapter), run (admission, then the scheduler: the local pipeline, or the cascade's local phase
and its cloud call), collect (a whole answer, or None when the client went away) or stream (SSE
events), and respond (the finished request's text, finish reason, usage and metrics). The app
(:mod:`kibidango.server.app`) only routes requests to it and turns an :class:`ApiError` into a
response; a test drives the service directly on a real pipeline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kibidango.cascade.memory import SessionMemory
from kibidango.cascade.pipeline import CascadePipeline, CascadeResult, Draft
from kibidango.decode.speculative import REQUEST_SETTINGS, TIERS, Metrics
from kibidango.pipeline import Pipeline
from kibidango.server import errors, sse
from kibidango.server.errors import ApiError
from kibidango.server.metrics import Stats
from kibidango.server.scheduler import Generation, Scheduler
from kibidango.server.schema import Decoding

__all__ = ["CLOUD_PROMPT_TOKENS", "CompletionService", "Finished", "Prepared", "max_token_bytes"]

CLOUD_PROMPT_TOKENS = 32_768  # the cascade model's prompt bound without --max-prompt-tokens


def max_token_bytes(tokenizer) -> int:
    """The longest vocabulary entry in UTF-8 bytes: no token stands for more bytes of text than its
    spelling (sentencepiece's "▁" and byte-fallback pieces only overstate), so a prompt of
    more than ``limit * this`` bytes has more than ``limit`` tokens and is refused untokenised."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 64
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=64)


@dataclass
class Prepared:
    """A request that passed every bound: its prompt ids and the decoding settings it runs with."""

    ids: list[int]
    settings: dict[str, Any]
    model: str


@dataclass
class Finished:
    """A finished request: its text, finish reason, the local decoding's metrics and the cascade's
    result (None outside the cascade)."""

    text: str
    reason: str | None
    metrics: Metrics
    cascade: CascadeResult | None = None


@dataclass
class Running:
    generation: Generation
    metrics: Metrics
    model: str
    parts: list[str] = field(default_factory=list)


class CompletionService:
    """The completions of one served pipeline (and its cascade): see the module's text."""

    def __init__(
        self,
        pipe: Pipeline,
        scheduler: Scheduler,
        stats: Stats,
        model_name: str = "kibidango",
        max_prompt_tokens: int | None = None,
        max_tokens_limit: int = 1024,
        cascade: CascadePipeline | None = None,
        memory: SessionMemory | None = None,
    ):
        self.pipe = pipe
        self.scheduler = scheduler
        self.stats = stats
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit
        self.cascade = cascade
        self.memory = memory
        self.cascade_name = f"{model_name}-cascade" if cascade is not None else None
        self.served = [model_name] + ([self.cascade_name] if self.cascade_name else [])
        context = min(m.context_length for m in pipe.models.values())
        self.prompt_limit = min(max_prompt_tokens or context, context - 1)
        self.token_bytes = max_token_bytes(pipe.tokenizer)
        # The cascade's model takes prompts past the local context: its cloud tier answers them.
        self.cloud_limit = max_prompt_tokens or CLOUD_PROMPT_TOKENS
        if cascade is None or cascade.client is None:
            self.cloud_limit = self.prompt_limit

    def limits(self, model: str | None) -> tuple[int, int]:
        """(tokens, bytes) a prompt to ``model`` may have."""
        tokens = self.cloud_limit if model is not None and model == self.cascade_name else self.prompt_limit
        return tokens, tokens * self.token_bytes

    def prepare(self, req: Decoding, prompt: str, query: str, ids: list[int] | None = None) -> Prepared | ApiError:
        """The request checked against the server's bounds and turned into decoding settings
        (``query``: what the router reads), or the error that refuses it."""
        if req.model is not None and req.model not in self.served:
            return ApiError(
                404,
                f"The model '{req.model}' does not exist; this server serves {', '.join(repr(m) for m in self.served)}",
                "model",
                code="model_not_found",
            )
        token_limit, bytes_limit = self.limits(req.model)
        size = len(prompt.encode("utf-8"))
        if size > bytes_limit:
            return ApiError(
                400,
                f"prompt: {size} bytes, more than {token_limit} tokens can spell; this server accepts at most "
                f"{token_limit} tokens",
                "prompt",
            )
        ids = ids if ids is not None else self.pipe.encode(prompt)
        if len(ids) > token_limit:
            return ApiError(400, f"prompt: {len(ids)} tokens; this server accepts at most {token_limit}", "prompt")
        max_tokens = req.max_tokens or 16
        if max_tokens > self.max_tokens_limit:
            return ApiError(
                400, f"max_tokens: {max_tokens} exceeds this server's limit of {self.max_tokens_limit}", "max_tokens"
            )
        kw = {k: getattr(req, k) for k in ("mode", *REQUEST_SETTINGS)}
        kw["max_new_tokens"] = max_tokens
        if kw["mode"] and any(t not in self.pipe.models for t in TIERS[kw["mode"]]):
            return ApiError(400, f"mode: {kw['mode']} needs tiers this server did not load", "mode")
        try:
            cfg = self.pipe.config(**kw)
        except ValueError as e:
            return ApiError(400, str(e))
        if why := self.pipe.decoder.table_missing(cfg):
            return ApiError(400, why, "ngram_table")
        if req.adapter is not None:
            known = self.pipe.adapters.adapters.domains if self.pipe.adapters is not None else []
            if req.adapter not in ("auto", "none", *known):
                return ApiError(
                    400, f"adapter: {req.adapter!r} is not auto, none or one of: {', '.join(known) or '-'}", "adapter"
                )
            kw["adapter"] = req.adapter
        kw["query"] = query
        return Prepared(ids, kw, req.model or self.model_name)

    def run(
        self, prepared: Prepared, stop: list[str] | None = None, messages: list[dict[str, str]] | None = None
    ) -> Running | ApiError:
        """Admit the request and start it: the cascade's model through the cascade (``messages``:
        the conversation its cloud tier answers), any other through the pipeline; a refusal when
        the queue is full or the server is shutting down."""
        why = self.scheduler.admit()
        if why is not None:
            return self.refusal(why)
        kw = prepared.settings
        metrics = Metrics(kw.get("mode") or self.pipe.defaults.mode)
        if prepared.model == self.cascade_name:
            cascade = self.cascade

            def locked(should_stop, emit):
                return cascade.local(prepared.ids, messages=messages, should_stop=should_stop, stop=stop, **kw)

            gen = self.scheduler.start(locked, cascade.escalate)
        else:

            def locked(should_stop, emit):
                for piece in self.pipe.stream(prepared.ids, stop=stop, metrics=metrics, should_stop=should_stop, **kw):
                    emit(piece)

            gen = self.scheduler.start(locked)
        return Running(gen, metrics, prepared.model)

    async def collect(
        self, running: Running, disconnected: Callable[[], Awaitable[bool]]
    ) -> Finished | ApiError | None:
        """A non-streamed request's end: what it answered, the error it ended with, or None if the
        client went away (``disconnected``, asked between pieces; the generation is then cancelled)."""
        gen = running.generation
        checked = time.monotonic()
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(gen.queue.get(), timeout=0.25)
                except TimeoutError:
                    kind, value = "", None
                if time.monotonic() - checked >= 0.25:  # between pieces too: they may come faster
                    checked = time.monotonic()
                    if await disconnected():
                        return None
                if kind == "text":
                    running.parts.append(value)
                elif kind == "end":
                    return self.finished(value, running)
                elif kind:
                    return self.failure(kind, value)
        finally:
            gen.cancel.set()

    async def stream(
        self,
        running: Running,
        chunk: Callable[[str, str | None], dict],
        done: Callable[[str], Awaitable[None]],
    ) -> AsyncIterator[str]:
        """The request's SSE events: ``chunk(text, finish_reason)`` makes each event's body, the
        last one carries usage and metrics; ``done(text)`` runs once it finished."""
        gen = running.generation
        try:
            while True:
                kind, value = await gen.queue.get()
                if kind == "text":
                    running.parts.append(value)
                    yield sse.event(chunk(value, None))
                    continue
                if kind == "end":
                    end = self.finished(value, running)
                    if end.cascade is not None and end.text:  # the cascade's answer comes whole, once its tier is known
                        yield sse.event(chunk(end.text, None))
                    yield sse.event({**chunk("", end.reason), **self.usage(end)})
                    await done(end.text)
                else:
                    yield sse.event(self.failure(kind, value).body())
                yield sse.DONE
                return
        finally:  # the client went away (Starlette cancels this generator) or the stream ended
            gen.cancel.set()

    @staticmethod
    def finished(value: Any, running: Running) -> Finished:
        """The text, finish reason and metrics of a request that ended normally."""
        if isinstance(value, Draft):  # cancelled after the local phase: the cloud was not asked
            value = value.result
        if isinstance(value, CascadeResult):
            local = value.local.metrics if value.local is not None else running.metrics
            reason = local.finish_reason if value.tier in ("local", "validated") else "stop"
            return Finished(value.text, reason, local, value)
        return Finished("".join(running.parts), running.metrics.finish_reason, running.metrics)

    def usage(self, end: Finished) -> dict:
        """The response's ``usage`` and ``kibidango`` fields (counted in the server's statistics)."""
        metrics = end.metrics
        self.stats.count(metrics, end.cascade)
        usage = {
            "prompt_tokens": metrics.prompt_tokens,
            "completion_tokens": metrics.generated_tokens,
            "total_tokens": metrics.prompt_tokens + metrics.generated_tokens,
        }
        extra = metrics.to_dict()
        if end.cascade is not None:
            extra["cascade"] = {k: v for k, v in end.cascade.to_dict().items() if k != "local"}
        return {"usage": usage, "kibidango": extra}

    def refusal(self, why: str) -> ApiError:
        return errors.refusal(why, self.scheduler.retry_after(), self.scheduler.max_queue)

    def failure(self, kind: str, value: Any) -> ApiError:
        s = self.scheduler
        return errors.failure(kind, value, s.request_timeout_s, s.retry_after(), s.max_queue)

    async def session_context(self, session: str, scope: str) -> list[dict[str, str]] | ApiError:
        """A chat session's last exchanges (``scope``: the API key's digest), or why it has none."""
        refused = self._no_session(
            session, ApiError(400, "session_id: this server keeps no session memory", "session_id")
        )
        if refused is not None:
            return refused
        return await asyncio.to_thread(self.memory.context, session, scope)

    def _no_session(self, session: str, without_memory: ApiError) -> ApiError | None:
        """Why ``session`` cannot be used here: a malformed id (400), or ``without_memory`` when the
        server keeps none; None when it can."""
        try:
            SessionMemory.check_id(session)
        except ValueError as e:
            return ApiError(400, str(e), "session_id")
        return without_memory if self.memory is None else None

    async def remember(self, session: str | None, query: str, text: str, scope: str) -> None:
        if self.memory is not None and session is not None and text:
            await asyncio.to_thread(self.memory.add, session, query, text, scope)

    async def forget(self, session: str, scope: str) -> dict | ApiError:
        refused = self._no_session(
            session, ApiError(404, "this server keeps no session memory", "session_id", code="not_found")
        )
        if refused is not None:
            return refused
        removed = await asyncio.to_thread(self.memory.forget, session, scope)
        return {"id": session, "object": "session", "deleted": True, "exchanges": removed}
