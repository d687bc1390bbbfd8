"""OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Binds 127.0.0.1 by
default. Requests are validated (types, bounds, prompt length) and refused with a 400 and an
OpenAI-style error body; a bad request never takes the server down. Errors never carry exception
text or tracebacks to the client (the server log has them).

Under load: one generation decodes at a time (the models hold one KV cache each); at most
``max_queue`` requests wait for them, the next is refused at once with 429 and Retry-After; a
request not finished ``request_timeout_s`` after it came is cancelled (504). A client that
disconnects cancels its generation after the current decoding round, streaming or not;
``/health`` answers 503 when a generation has made no progress for ``stall_seconds``. On SIGTERM
the server stops accepting, refuses what is still queued (503), lets running requests finish for
the grace period, then cancels them.

With a cascade (``serve --cascade CONFIG``) the model ``<model>-cascade`` answers through
:mod:`kibidango.cascade_pipeline`: the local phase holds the models, the cloud call does not, so
other requests decode while one waits for the cloud. Chat requests with a session id (field
``session_id`` or header ``X-Session-Id``) get that session's last exchanges as context (6D).

Besides the OpenAI fields, a request may set the decoding of this runtime: ``mode``,
``variant``, ``k``, ``l_D``, ``l_Q``, ``tau_Q``, ``tau_T``, ``divergence``, ``adapter`` (with the
openai client: ``extra_body={...}``). Responses carry ``usage`` and a ``kibidango`` field with
the request's speculative-decoding metrics (and ``cascade``: tier, confidence, cost, budget left)."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

from fastapi import Request  # the server extra; this module is imported only to serve
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kibidango.backends.base import ContextLengthError
from kibidango.cascade_pipeline import CascadePipeline, CascadeResult, Draft
from kibidango.chat_template import TemplateBoundError, render_chat
from kibidango.memory import SessionMemory
from kibidango.pipeline import Pipeline
from kibidango.speculative import TIERS, Metrics

__all__ = ["create_app", "key_scope", "load_api_keys", "serve", "uvicorn_server"]

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
    session_id: str | None = Field(None, max_length=128, description="chat: the session whose memory to use")

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
    content: str | list[dict[str, Any]]
    """A string, or OpenAI's list of content parts: text parts are joined (by newlines, as vLLM
    does); any other part (an image, audio) is refused — this server reads text."""

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("content: an empty list of parts")
            texts = []
            for i, part in enumerate(v):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content[{i}]: a {kind!r} part; this server reads only text parts")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content[{i}].text: a string")
                texts.append(part["text"])
            v = "\n".join(texts)
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
        self.tiers: dict[str, int] = {}
        self.flags: dict[str, int] = {}
        self.cloud_usd = 0.0
        self.cloud_seconds = [0] * len(_CLOUD_BUCKETS)
        self.cloud_seconds_sum = 0.0
        self.cloud_calls = 0
        self.lock = threading.Lock()

    def count(self, metrics: Metrics, result: CascadeResult | None = None) -> None:
        with self.lock:
            if result is not None:
                self.tiers[result.tier] = self.tiers.get(result.tier, 0) + 1
                for flag in result.flags:
                    self.flags[flag] = self.flags.get(flag, 0) + 1
                self.cloud_usd += result.usd
                if result.cloud is not None and result.cloud.attempts:
                    self.cloud_calls += 1
                    self.cloud_seconds_sum += result.cloud.seconds
                    for i, edge in enumerate(_CLOUD_BUCKETS):  # cumulative, as Prometheus reads `le`
                        if result.cloud.seconds <= edge:
                            self.cloud_seconds[i] += 1
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

    def cascade_metrics(self, model: str, cascade: CascadePipeline) -> str:
        """The cascade's lines: answers by tier and flag, this process's cloud spend and call
        latency, calls and retries by outcome; the budget (the ledger's: every process's spend)."""
        m = f'model="{model}-cascade"'
        with self.lock:
            lines = [
                "# HELP kibidango_cascade_requests_total Cascade answers by the tier that gave them.",
                "# TYPE kibidango_cascade_requests_total counter",
                *(f'kibidango_cascade_requests_total{{{m},tier="{t}"}} {n}' for t, n in self.tiers.items()),
                "# HELP kibidango_cascade_flags_total Cascade answers by flag (degraded, budget_exhausted, no_key, ...).",
                "# TYPE kibidango_cascade_flags_total counter",
                *(f'kibidango_cascade_flags_total{{{m},flag="{f}"}} {n}' for f, n in self.flags.items()),
                "# HELP kibidango_cloud_spend_usd_total Dollars this process charged to the budget.",
                "# TYPE kibidango_cloud_spend_usd_total counter",
                f"kibidango_cloud_spend_usd_total{{{m}}} {self.cloud_usd:.6f}",
                "# HELP kibidango_cloud_request_seconds Cloud calls, retries and backoff included.",
                "# TYPE kibidango_cloud_request_seconds histogram",
                *(
                    f'kibidango_cloud_request_seconds_bucket{{{m},le="{"+Inf" if edge == float("inf") else f"{edge:g}"}"}} {self.cloud_seconds[i]}'
                    for i, edge in enumerate(_CLOUD_BUCKETS)
                ),
                f"kibidango_cloud_request_seconds_sum{{{m}}} {self.cloud_seconds_sum:.6f}",
                f"kibidango_cloud_request_seconds_count{{{m}}} {self.cloud_calls}",
            ]
        client = cascade.client
        if client is not None:
            counts = dict(client.counts)
            lines += [
                "# HELP kibidango_cloud_calls_total Cloud calls by outcome (ok, degraded, budget_exhausted, no_key, breaker_open).",
                "# TYPE kibidango_cloud_calls_total counter",
                *(
                    f'kibidango_cloud_calls_total{{{m},outcome="{k}"}} {n}'
                    for k, n in counts.items()
                    if not k.startswith("retry_")
                ),
                "# HELP kibidango_cloud_retries_total Cloud attempts retried, by cause.",
                "# TYPE kibidango_cloud_retries_total counter",
                *(
                    f'kibidango_cloud_retries_total{{{m},cause="{k.removeprefix("retry_")}"}} {n}'
                    for k, n in counts.items()
                    if k.startswith("retry_")
                ),
                "# TYPE kibidango_cloud_breaker_open gauge",
                f"kibidango_cloud_breaker_open{{{m}}} {int(client.opened_at is not None)}",
            ]
        if cascade.ledger is not None:
            state = cascade.ledger.state()
            lines += [
                "# HELP kibidango_cloud_budget_limit_usd The cloud budget of the period.",
                "# TYPE kibidango_cloud_budget_limit_usd gauge",
                f'kibidango_cloud_budget_limit_usd{{{m},period="{state.period}"}} {state.limit_usd:.6f}',
                "# HELP kibidango_cloud_budget_spent_usd Settled spend of the period, every process sharing the ledger.",
                "# TYPE kibidango_cloud_budget_spent_usd gauge",
                f'kibidango_cloud_budget_spent_usd{{{m},period="{state.period}"}} {state.settled_usd:.6f}',
                "# TYPE kibidango_cloud_budget_reserved_usd gauge",
                f'kibidango_cloud_budget_reserved_usd{{{m},period="{state.period}"}} {state.reserved_usd:.6f}',
                "# TYPE kibidango_cloud_budget_left_usd gauge",
                f'kibidango_cloud_budget_left_usd{{{m},period="{state.period}"}} {state.left_usd:.6f}',
            ]
        return "\n".join(lines) + "\n"


_CLOUD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


def _chat_prompt(tokenizer, turns: list[dict[str, str]]) -> str:
    """The chat's prompt: the bundle's chat template rendered within bounds
    (:func:`kibidango.chat_template.render_chat`; call it off the event loop)."""
    if getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, turns)
    # No chat template (a bare story model): a plain transcript ending with the assistant's turn.
    return "".join(f"{m['role']}: {m['content']}\n" for m in turns) + "assistant:"


def _chat_ids(tokenizer, prompt: str) -> list[int] | None:
    """The chat's token ids, as transformers' apply_chat_template makes them: the rendered text
    holds the BOS token already, so it is encoded without adding special tokens; None without a
    template (the prompt is encoded as any completion prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return list(tokenizer.encode(prompt, add_special_tokens=False))


_HEALTH_STALL_S = 120.0
_CLOUD_PROMPT_TOKENS = 32_768  # the cascade model's prompt bound without --max-prompt-tokens


class _Generation:
    """One request's work, run on a worker thread and handed to the event loop piece by piece.
    Setting ``cancel`` stops it after the current decoding round (or before it starts, while it
    waits its turn); past ``deadline`` (monotonic seconds) it stops the same way and ends with
    ``timeout``."""

    def __init__(self, deadline: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancel = threading.Event()
        self.deadline = deadline
        self.timed_out = False

    def put(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


class _FifoLock:
    """A lock granted in arrival order, so that under load every request waits about as long as
    the queue ahead of it (a plain lock polled by many threads lets some wait far longer).
    :meth:`enter` takes a ticket (an event set when the lock is granted); :meth:`withdraw` gives
    up a ticket (passing the lock on if it was granted meanwhile); :meth:`release` passes it on."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._queue: collections.deque[threading.Event] = collections.deque()

    def enter(self) -> threading.Event:
        ticket = threading.Event()
        with self._mutex:
            if not self._held:
                self._held = True
                ticket.set()
            else:
                self._queue.append(ticket)
        return ticket

    def withdraw(self, ticket: threading.Event) -> None:
        with self._mutex:
            if ticket.is_set():
                self._pass_on()
            else:
                self._queue.remove(ticket)

    def release(self) -> None:
        with self._mutex:
            self._pass_on()

    def acquire(self, timeout: float = -1) -> bool:
        ticket = self.enter()
        if ticket.wait(None if timeout < 0 else timeout):
            return True
        with self._mutex:
            if ticket.is_set():  # granted at the last moment
                return True
            self._queue.remove(ticket)
        return False

    def _pass_on(self) -> None:  # the mutex is held
        if self._queue:
            self._queue.popleft().set()
        else:
            self._held = False


class _Scheduler:
    """One generation at a time (the models hold one KV cache each), each request on its own
    daemon thread, in arrival order. The lock is held by that thread only while it decodes —
    never across a network write or a cloud call — so a client that disconnects, or a slow
    cloud, cannot keep it.

    At most ``max_queue`` admitted requests wait for the models; :meth:`admit` refuses the next
    (``queue_full``: the server answers 429 with Retry-After). A request that has not finished
    ``request_timeout_s`` after admission is cancelled (``timeout``: 504). ``draining`` (shutdown
    began) refuses new and queued requests (503) while running ones finish; ``closing`` (the
    grace period is over) cancels what still runs."""

    def __init__(self, pipe: Pipeline, stall_seconds: float, max_queue: int = 64, request_timeout_s: float = 600.0):
        self.pipe = pipe
        self.stall_seconds = stall_seconds
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.lock = _FifoLock()
        self.closing = threading.Event()
        self.draining = threading.Event()
        self.counts = threading.Lock()
        self.waiting = 0  # admitted, waiting for the models
        self.in_flight = 0  # admitted, not finished (waiting, decoding, or asking the cloud)
        self.active_since: float | None = None
        self.last_progress: float | None = None
        self.cancelled = 0
        self.timed_out = 0
        self.refused: dict[str, int] = {"queue_full": 0, "shutting_down": 0}
        self.busy_seconds = 0.0  # the models' time, over `served` requests: Retry-After's estimate
        self.served = 0
        self.live: set[_Generation] = set()  # started, not finished: answered 503 if a shutdown cannot wait

    def admit(self) -> str | None:
        """Take a request in (None) or say why not: ``queue_full`` or ``shutting_down``."""
        with self.counts:
            if self.draining.is_set() or self.closing.is_set():
                why = "shutting_down"
            elif self.waiting >= self.max_queue:
                why = "queue_full"
            else:
                self.waiting += 1
                self.in_flight += 1
                return None
            self.refused[why] += 1
            return why

    def retry_after(self) -> int:
        """Seconds until the queue has room, by the mean time a request held the models."""
        with self.counts:
            mean = self.busy_seconds / self.served if self.served else 1.0
            return max(1, min(60, math.ceil(mean * max(1, self.waiting - self.max_queue + 1))))

    def start(self, locked: Callable[..., Any], unlocked: Callable[[Any], Any] | None = None) -> _Generation:
        """Run ``locked(should_stop, emit)`` while holding the models (``emit(text)`` streams a
        piece), then ``unlocked(value)`` without them; the generation ends with ``("end", value)``.
        The caller has been admitted."""
        gen = _Generation(time.monotonic() + self.request_timeout_s)
        with self.counts:
            self.live.add(gen)
        threading.Thread(
            target=self._work, args=(gen, locked, unlocked), name="kibidango-generate", daemon=True
        ).start()
        return gen

    def _stopped(self, gen: _Generation) -> bool:
        self.last_progress = now = time.monotonic()  # asked once per decoding round
        if now > gen.deadline:
            gen.timed_out = True
        return gen.timed_out or gen.cancel.is_set() or self.closing.is_set()

    def _work(self, gen: _Generation, locked, unlocked) -> None:
        try:
            self._run(gen, locked, unlocked)
        finally:
            with self.counts:
                self.in_flight -= 1
                self.live.discard(gen)

    def abandon(self) -> int:
        """Answer every request still running with 503 now (the end of a shutdown that cannot
        wait for it); its work ends on its own. Returns how many."""
        with self.counts:
            live = list(self.live)
        for gen in live:
            gen.put("shutting_down")
        return len(live)

    def _run(self, gen: _Generation, locked, unlocked) -> None:
        ticket = self.lock.enter()
        try:
            while not ticket.wait(0.05):
                why = None
                if gen.cancel.is_set():
                    why = "cancelled"
                elif self.draining.is_set() or self.closing.is_set():
                    why = "shutting_down"
                elif time.monotonic() > gen.deadline:
                    why = "timeout"
                if why is not None:
                    self.lock.withdraw(ticket)
                    with self.counts:
                        if why == "cancelled":
                            self.cancelled += 1
                        elif why == "timeout":
                            self.timed_out += 1
                        else:
                            self.refused[why] += 1
                    gen.put(why)
                    return
        finally:
            with self.counts:
                self.waiting -= 1
        started = time.monotonic()
        try:
            self.active_since = self.last_progress = started
            value = locked(lambda: self._stopped(gen), lambda piece: gen.put("text", piece))
        except (ContextLengthError, ValueError) as e:
            gen.put("error", e)
            return
        except Exception as e:  # a bug: logged here with its traceback, never sent to the client
            log.exception("generation failed")
            gen.put("crash", e)
            return
        finally:
            self.active_since = None
            self.lock.release()
            with self.counts:
                self.busy_seconds += time.monotonic() - started
                self.served += 1
        if gen.timed_out:
            with self.counts:
                self.timed_out += 1
            gen.put("timeout")
            return
        if self.closing.is_set() and not gen.cancel.is_set():  # cut by a shutdown: 503 + Retry-After
            with self.counts:
                self.refused["shutting_down"] += 1
            gen.put("shutting_down")
            return
        if gen.cancel.is_set():
            with self.counts:
                self.cancelled += 1
            gen.put("end", value)
            return
        if unlocked is not None:
            try:
                value = unlocked(value)
            except Exception as e:
                log.exception("the request's cloud phase failed")
                gen.put("crash", e)
                return
        gen.put("end", value)

    def health(self) -> tuple[int, dict[str, Any]]:
        now = time.monotonic()
        active, last = self.active_since, self.last_progress
        body: dict[str, Any] = {
            "status": "ok",
            "generating": active is not None,
            "waiting": self.waiting,
            "in_flight": self.in_flight,
        }
        if active is not None and last is not None:
            body["generating_for_s"] = round(now - active, 3)
            body["no_progress_for_s"] = round(now - last, 3)
            if now - last > self.stall_seconds:
                body["status"] = "wedged"
                return 503, body
        if self.closing.is_set() or self.draining.is_set():
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


async def _send_error(send, status: int, message: str, code: str | None = None, headers: tuple = ()) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()
    head = [(b"content-type", b"application/json"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def key_scope(key: str) -> str:
    """What session memory is keyed by for a request made with ``key``: a digest, never the key."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


class _Auth:
    """ASGI middleware: every ``/v1/`` request needs ``Authorization: Bearer <key>`` with one of
    ``keys`` (compared in constant time, every key each time), else 401 in OpenAI's error shape.
    ``/health`` and ``/metrics`` stay open (probes and scrapers). The request's scope carries
    :func:`key_scope` of its key; no key is ever logged or echoed."""

    def __init__(self, app, keys: list[str], on_refuse=lambda: None):
        self.app, self.on_refuse = app, on_refuse
        self.keys = [k.encode("utf-8") for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        kind, _, token = header.partition(b" ")
        token = token.strip()
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token, key)
        if not (ok and kind.lower() == b"bearer"):
            self.on_refuse()
            message = (
                "Incorrect API key provided."
                if token
                else "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
            return await _send_error(send, 401, message, "invalid_api_key", ((b"www-authenticate", b"Bearer"),))
        scope.setdefault("state", {})["key_scope"] = key_scope(token.decode("utf-8", "replace"))
        return await self.app(scope, receive, send)


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
    cascade: CascadePipeline | None = None,
    memory: SessionMemory | None = None,
    max_queue: int = 64,
    request_timeout_s: float = 600.0,
    api_keys: list[str] | None = None,
):
    """The FastAPI app. ``api_keys``: every ``/v1/`` request must bear one (:class:`_Auth`);
    session memory is then kept per key. ``stall_seconds``: a generation that makes no progress for this long turns
    ``/health`` to 503 ("wedged"), so a supervisor can restart the server. ``cascade``: requests
    for the model ``<model_name>-cascade`` go through it (tier, confidence, cost and budget left in
    the response's ``kibidango.cascade``). ``memory``: chat requests with a session id (the
    ``session_id`` field or the ``X-Session-Id`` header) get the session's last exchanges as
    context. ``max_queue``: requests waiting for the models beyond it are refused (429 +
    Retry-After); ``request_timeout_s``: a request not done this long after it came is cancelled
    (504)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    stats = _Stats()
    scheduler = _Scheduler(pipe, stall_seconds, max_queue, request_timeout_s)
    cascade_name = f"{model_name}-cascade" if cascade is not None else None
    served = [model_name] + ([cascade_name] if cascade_name else [])

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.closing.set()  # shutdown: every generation stops after its current round

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
        return error(503, "the server is shutting down; retry on another replica", kind="server_unavailable",
                     code="shutting_down", headers={"Retry-After": str(wait)}, count=False)  # fmt: skip

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
        req: _Decoding, prompt: str, query: str, ids: list[int] | None = None
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
                f"prompt: {size} bytes, more than {token_limit} tokens can spell; this server accepts at most {token_limit} tokens",
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
            return error(504, f"the request did not finish within this server's {scheduler.request_timeout_s:g} s",
                         kind="timeout", code="request_timeout")  # fmt: skip
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

    async def sse(gen: _Generation, metrics: Metrics, chunk, done) -> AsyncIterator[str]:
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

    async def collect(gen: _Generation, request: Request) -> tuple[str, Any, list[str]] | None:
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
        text += _scheduler_metrics(model_name, scheduler)
        if cascade is not None:
            text += stats.cascade_metrics(model_name, cascade)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def respond(
        request: Request,
        req: _Decoding,
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
        ids = _chat_ids(pipe.tokenizer, prompt) if len(prompt.encode("utf-8")) <= limits(req.model)[1] else None
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

    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes, on_refuse=stats.count_error)
    if api_keys:  # outermost: a request without a key is refused before its body is read
        app.add_middleware(_Auth, keys=list(api_keys), on_refuse=stats.count_error)
    return app


def _scheduler_metrics(model: str, scheduler: _Scheduler) -> str:
    lines = [
        "# HELP kibidango_queue_depth Requests waiting for the models.",
        "# TYPE kibidango_queue_depth gauge",
        f'kibidango_queue_depth{{model="{model}"}} {scheduler.waiting}',
        "# TYPE kibidango_queue_limit gauge",
        f'kibidango_queue_limit{{model="{model}"}} {scheduler.max_queue}',
        "# HELP kibidango_requests_in_flight Requests taken in and not finished (queued, decoding or at the cloud).",
        "# TYPE kibidango_requests_in_flight gauge",
        f'kibidango_requests_in_flight{{model="{model}"}} {scheduler.in_flight}',
        "# HELP kibidango_requests_refused_total Requests refused with 429 (queue full) or 503 (shutting down).",
        "# TYPE kibidango_requests_refused_total counter",
        *(
            f'kibidango_requests_refused_total{{model="{model}",reason="{r}"}} {n}'
            for r, n in scheduler.refused.items()
        ),
        "# HELP kibidango_requests_timed_out_total Requests cancelled at the server's request timeout (504).",
        "# TYPE kibidango_requests_timed_out_total counter",
        f'kibidango_requests_timed_out_total{{model="{model}"}} {scheduler.timed_out}',
    ]
    return "\n".join(lines) + "\n"


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
    cascade: str | None = None,
    state_dir: str | None = None,
    max_queue: int = 64,
    request_timeout_s: float = 600.0,
    shutdown_grace_s: float = 10.0,
    api_key_env: str | None = None,
    api_keys_file: str | None = None,
    insecure_no_auth: bool = False,
    **overrides: Any,
) -> None:
    """Serve a bundle. ``cascade``: a cascade config (a name, a file, or ``bundle`` for the
    bundle's own 6C choice) served as ``<model>-cascade``, its budget ledger and the session
    memory in ``state_dir``. On SIGTERM/SIGINT the server stops taking requests, refuses the
    queued ones (503), gives running ones ``shutdown_grace_s`` to finish, then answers them 503.

    API keys (``Authorization: Bearer``) come from the environment variable ``api_key_env`` (one key,
    or several separated by commas) and/or ``api_keys_file`` (one per line, ``#`` comments). Without
    any, the server binds only a loopback address (every local client is trusted, and it says so);
    another address without keys needs ``insecure_no_auth``."""
    import uvicorn

    from kibidango.state import default_state_dir

    keys = load_api_keys(api_key_env, api_keys_file)
    if not keys and not _loopback(host) and not insecure_no_auth:
        raise ValueError(
            f"refusing to serve {host} without API keys: set --api-key-env NAME (or --api-keys-file), or pass "
            "--insecure-no-auth to accept any client that can reach it"
        )
    if keys:
        log.warning(f"API keys required on /v1/: {len(keys)} key(s) from {_key_sources(api_key_env, api_keys_file)}")
    elif _loopback(host):
        log.warning(f"no API keys: serving {host} (loopback) only; every local client is trusted")
    else:
        log.warning(f"no API keys and --insecure-no-auth: ANY client that reaches {host}:{port} is served")

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
    state = Path(state_dir).expanduser() if state_dir else default_state_dir()
    casc = None
    if cascade is not None:
        from kibidango.cascade import load_cascade

        config = load_cascade(None if cascade == "bundle" else cascade, bundle=pipe.bundle)
        casc = CascadePipeline(pipe, config, state)
        left = casc.ledger.state().left_usd if casc.ledger is not None else None
        log.warning(
            f"cascade {config.source}: cloud {config.cloud.model if config.cloud else 'none'}"
            + (f", ${left:.4f} of the budget left" if left is not None else "")
        )
    memory = SessionMemory(state)
    name = pipe.bundle.meta.get("preset", "kibidango") if pipe.bundle else "kibidango"
    app = create_app(
        pipe,
        model_name=f"kibidango-{name}",
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        max_request_bytes=max_request_bytes,
        stall_seconds=stall_seconds,
        cascade=casc,
        memory=memory,
        max_queue=max_queue,
        request_timeout_s=request_timeout_s,
        api_keys=keys,
    )
    # Open requests get shutdown_grace_s to finish after SIGTERM; then they are cancelled, which
    # cancels their generations (uvicorn's default waits for them however long they take).
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_grace_s)
    uvicorn_server(config).run()


def load_api_keys(env: str | None = None, path: str | None = None) -> list[str]:
    """The server's API keys: from the environment variable ``env`` (comma-separated) and the
    file ``path`` (one per line, ``#`` comments). Errors name the variable or file and line, never
    a key."""
    import os

    keys: list[str] = []
    if env is not None:
        value = os.environ.get(env, "")
        if not value.strip():
            raise ValueError(f"--api-key-env {env}: the environment variable is not set or empty")
        keys += [k.strip() for k in value.split(",") if k.strip()]
    if path is not None:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"--api-keys-file {path}: cannot read it ({e.strerror})") from None
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                if any(c.isspace() for c in line):
                    raise ValueError(f"--api-keys-file {path}: line {n} holds whitespace inside a key")
                keys.append(line)
        if not keys:
            raise ValueError(f"--api-keys-file {path}: no key in it")
    if any(len(key) < 16 for key in keys):
        raise ValueError(
            f"API keys from {_key_sources(env, path)}: a key shorter than 16 characters (too easy to guess)"
        )
    return keys


def _key_sources(env: str | None, path: str | None) -> str:
    return " and ".join(x for x in (f"${env}" if env else None, path) if x)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uvicorn_server(config):
    """A uvicorn server for an app of :func:`create_app` that drains on SIGTERM/SIGINT, so that
    every request it took gets an HTTP answer. The first signal starts the drain while the server
    keeps accepting: new and queued requests are answered 503 + Retry-After, running ones get
    ``config.timeout_graceful_shutdown`` seconds to finish; then the rest stop after their decoding
    round and are answered 503 (a request still at the cloud too, after a few seconds more). Only
    then does the listening socket close: first no new connection may complete on it
    (:func:`_stop_new_connections`) and what is in its backlog is accepted and answered, so a client
    that connected is answered or, arriving after, refused — never reset after its request was
    sent. A second signal stops at once (uvicorn's way)."""
    import uvicorn

    scheduler = config.app.state.scheduler
    grace_s = config.timeout_graceful_shutdown if config.timeout_graceful_shutdown is not None else 10.0
    config.timeout_graceful_shutdown = 5.0  # uvicorn's own wait, after the drain: only answers being written

    class _Server(uvicorn.Server):
        drain: asyncio.Task | None = None

        def handle_exit(self, sig, frame):
            if not scheduler.draining.is_set():
                self._captured_signals.append(sig)  # re-raised once the server has stopped, as uvicorn does
                scheduler.draining.set()
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if scheduler.draining.is_set():
                if self.drain is None:
                    self.drain = asyncio.create_task(self._drain())
                return self.drain.done()
            return False

        async def _drain(self) -> None:
            await _idle(scheduler, grace_s)
            scheduler.closing.set()  # what still runs stops after its decoding round and is answered 503
            await _idle(scheduler, 5.0)
            if scheduler.abandon():  # still at the cloud: answered now, its work ends on its own
                log.warning("shutdown: requests still waiting for the cloud were answered 503")
            for server in self.servers:  # no new connection completes; those in the backlog are taken
                for sock in server.sockets:
                    _stop_new_connections(sock)
            await asyncio.sleep(0.5)  # accepted and answered (503) before the socket closes

    return _Server(config)


async def _idle(scheduler: _Scheduler, seconds: float) -> None:
    """Wait until no request is in flight, or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while scheduler.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _stop_new_connections(sock) -> None:
    """Let no new connection complete on a listening socket, while those already in its backlog
    stay to be accepted: on Linux a socket filter that drops every incoming packet (a new client's
    handshake never completes; it retries, then finds the socket closed: refused, nothing sent —
    while established connections have sockets of their own, which the filter does not touch);
    elsewhere ``listen(0)``, which only shrinks the backlog."""
    import ctypes
    import os
    import socket
    import struct

    try:
        dup = socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:
        return
    try:
        drop = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))  # BPF_RET|BPF_K 0: drop
        program = struct.pack("HL", 1, ctypes.addressof(drop))  # struct sock_fprog {len; *filter}
        dup.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_ATTACH_FILTER", 26), program)
    except OSError:
        try:
            dup.listen(0)
        except OSError:
            pass
    finally:
        dup.close()
