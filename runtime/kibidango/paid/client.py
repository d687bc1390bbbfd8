"""The one paid client: any OpenAI-compatible endpoint, called with bounded retries, under a hard
dollar budget. The runtime's cloud tier (:mod:`kibidango.cascade.cloud`), the pipeline's teacher
tiers (stage 1D, ``methods.teachers``) and its ``llm`` judge all call endpoints through it.

One call (:meth:`PaidClient.chat`):

1. the key is read from the environment variable the :class:`Endpoint` names, at call time (none
   named: a local endpoint that needs no key); it never appears in a reply, an error or a log line;
2. with a :class:`~kibidango.paid.ledger.Ledger`, the call's **worst case** is reserved first
   (no room: nothing is sent, ``budget_exhausted``): prompt tokens bounded by every message's UTF-8
   bytes as JSON (role, content, name: a byte-level tokenizer makes no more tokens than bytes, bar
   special tokens, which are fewer), plus the chat template's tokens around each message
   (``message_tokens``) and around the conversation (``template_tokens``: a default system prompt),
   completion tokens by ``max_tokens``;
3. up to ``max_attempts`` HTTP requests. Retried, counted by cause, with exponential backoff and
   full jitter (or the 429's ``Retry-After``): ``rate_limited``, ``server_error`` (5xx),
   ``connection``, ``timeout`` and ``malformed`` (truncated JSON, no choices, no text). A timed-out
   or malformed attempt may have been served and billed without a usable reply (``unread``): before
   it is sent again another worst case is reserved, and when none fits the call ends. 401/403/404
   end the call as ``refused`` (the endpoint's configuration: key, model, address); another 4xx as
   ``rejected`` (this request will not get better);
4. each reservation is **settled**: every unread attempt's at its worst case, the answered one's at
   the cost its reported usage gives — or at its reservation when the usage is absent, not whole
   numbers or negative (the ledger's rule: a reply never credits the budget); a cost above the
   worst case is recorded as reported and puts the ledger on hold until reconciled — and the rest
   **released**. A reply body is read up to ``max_reply_bytes``; a larger one is refused unread
   (``malformed``).

Statuses: ``ok``, ``refused``, ``rejected``, ``failed`` (attempts exhausted), ``budget_exhausted``,
``no_key``. A caller decides what each means to it (the cloud tier answers locally, a teacher tier
is declared dead, a judge stops the stage).
"""

from __future__ import annotations

import email.utils
import functools
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kibidango.paid.ledger import BudgetExceeded, Ledger

__all__ = [
    "Endpoint",
    "PaidClient",
    "PaidReply",
    "backoff_seconds",
    "credible_usage",
    "retry_after_seconds",
    "usage_cost",
]

log = logging.getLogger("kibidango.paid.client")

TEMPLATE_TOKENS = 64
"""Allowance for the chat template's tokens around the conversation (a default system prompt) in
the worst-case cost."""
MESSAGE_TOKENS = 16
"""Allowance for the chat template's tokens around each message (ChatML's ``<|im_start|>role\n``
and ``<|im_end|>\n`` are 5), beyond the message's own bytes."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    api_key_env: str | None = None
    """Name of the environment variable holding the key (None: a local endpoint without one)."""
    usd_per_1k_prompt: float = 0.0
    usd_per_1k_completion: float = 0.0
    timeout_s: float = 60.0
    max_attempts: int = 4
    backoff_s: float = 0.5
    """First backoff; doubles per retry, full jitter, capped at 30 s."""
    name: str = ""
    """What errors and ledger notes call it (default: the model)."""
    template_tokens: int = TEMPLATE_TOKENS
    message_tokens: int = MESSAGE_TOKENS
    max_reply_bytes: int = 8 << 20
    """A reply body larger than this is refused unread (a malformed attempt, maybe billed)."""

    @property
    def label(self) -> str:
        return self.name or self.model

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.usd_per_1k_prompt + completion_tokens * self.usd_per_1k_completion) / 1000

    def worst_case_tokens(self, messages: list[dict]) -> int:
        """The most prompt tokens the provider can bill for ``messages`` (see the module)."""
        size = sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8")) for m in messages)
        return size + self.message_tokens * len(messages) + self.template_tokens

    def worst_case_usd(self, messages: list[dict], max_tokens: int) -> float:
        return self.cost(self.worst_case_tokens(messages), max_tokens)


@dataclass
class PaidReply:
    text: str | None
    """None when the call gave no usable text (``status`` and ``error`` say why)."""
    status: str = "ok"
    error: str = ""
    prompt_tokens: int | None = None
    """None (both counts) when the reply's usage is absent or not credible."""
    completion_tokens: int | None = None
    finish_reason: str | None = None
    refusal: str | None = None
    attempts: int = 0
    retries: Counter = field(default_factory=Counter)
    unread: int = 0
    """Attempts that may have been served and billed without a usable reply (timeouts, malformed)."""
    http_status: int | None = None
    usd: float = 0.0
    """What the ledger charged for the call (0 without a ledger)."""
    reserved: float = 0.0
    """The worst case reserved for one attempt."""
    usage_untrusted: bool = False
    over_reservation: bool = False
    """The answered attempt reported more than its reservation: recorded as reported, and the
    ledger is on hold until reconciled."""
    """The answered attempt was charged its reservation: its reported cost was not credible."""
    seconds: float = 0.0

    @property
    def maybe_paid(self) -> bool:
        return self.unread > 0 or self.text is not None


class PaidClient:
    """``PaidClient(endpoint, ledger=None)``: thread-safe; one ``openai.OpenAI`` per key."""

    def __init__(self, endpoint: Endpoint, ledger: Ledger | None = None, sleep: Callable[[float], None] = time.sleep):
        self.endpoint = endpoint
        self.ledger = ledger
        self._sleep = sleep
        self._lock = threading.Lock()
        self._clients: dict[tuple, object] = {}

    def key(self) -> str | None:
        env = self.endpoint.api_key_env
        return (os.environ.get(env) or None) if env else "none"

    def clean(self, text: str) -> str:
        """``text`` with the key masked."""
        key = self.key()
        return text.replace(key, "[REDACTED]") if key and key != "none" else text

    def _client(self, key: str):
        e = self.endpoint
        with self._lock:
            if (key, e) not in self._clients:
                import openai

                # a rotated key (or another endpoint) replaces the client
                client = openai.OpenAI(
                    base_url=e.base_url,
                    api_key=key,
                    timeout=e.timeout_s,
                    max_retries=0,
                    http_client=_capped_http_client(e.max_reply_bytes, e.timeout_s),
                )
                self._clients = {(key, e): client}
            return self._clients[(key, e)]

    def chat(
        self,
        messages: list[dict],
        max_tokens: int,
        temperature: float = 0.0,
        note: str = "",
        on_send: Callable[[float], None] | None = None,
        **extra,
    ) -> PaidReply:
        """One call (see the module). ``on_send(reserved_usd)`` runs after the first reservation
        and before anything leaves (stage 1D journals the request there); ``extra``: more request
        fields (``response_format``)."""
        started = time.monotonic()
        e = self.endpoint
        reply = PaidReply(None)
        key = self.key()
        if key is None:
            reply.status, reply.error = "no_key", f"${e.api_key_env} is not set"
            return reply
        worst = e.worst_case_usd(messages, max_tokens)
        reply.reserved = worst
        held: list[str] = []
        note = note or f"{e.label}"
        if self.ledger is not None:
            try:
                held.append(self.ledger.reserve(worst, note=note))
            except BudgetExceeded as err:
                reply.status, reply.error = "budget_exhausted", str(err)
                return reply

        def may_resend() -> bool:  # an attempt may have been billed: its reservation stays; hold the next
            if self.ledger is None:
                return True
            try:
                held.append(self.ledger.reserve(worst, note=f"{note} (resend)"))
                return True
            except BudgetExceeded:
                return False

        if on_send is not None:
            on_send(worst)
        usd = None
        try:
            usd = self._attempts(key, messages, max_tokens, temperature, extra, reply, may_resend)
        except Exception as err:  # an unexpected library error: every attempt may have been served
            log.error(f"{e.label}: unexpected {type(err).__name__}: {self.clean(str(err))[:200]}")
            reply.text, reply.status, reply.error = None, "failed", f"unexpected {type(err).__name__}"
            reply.unread = max(reply.unread, reply.attempts)
        if self.ledger is not None:
            reply.usd = self._settle(held, worst, reply, usd)
        elif usd is not None:
            reply.usd = usd
        reply.seconds = time.monotonic() - started
        return reply

    def _settle(self, held: list[str], worst: float, reply: PaidReply, usd: float | None) -> float:
        """The first ``unread`` reservations at their worst case; the next, when a reply came, at
        what it cost (its reservation when the usage is not credible); the rest released."""
        charged = 0.0
        for i, rid in enumerate(held):
            if i < reply.unread:
                charged += self.ledger.settle(rid, worst)
            elif i == reply.unread and reply.text is not None:
                amount = self.ledger.settle(rid, usd)
                reply.usage_untrusted = amount != usd
                reply.over_reservation = usd is not None and amount > worst + 1e-12
                charged += amount
            else:
                self.ledger.release(rid)
        return charged

    def _attempts(self, key, messages, max_tokens, temperature, extra, reply: PaidReply, may_resend) -> float | None:
        """The attempts of one call; the reported cost of the answered one (None: not credible)."""
        import openai

        e = self.endpoint
        client = self._client(key)
        for attempt in range(1, e.max_attempts + 1):
            reply.attempts = attempt
            wait = None
            unread = False
            try:
                done = client.chat.completions.create(
                    model=e.model, messages=messages, max_tokens=max_tokens, temperature=temperature, **extra
                )
                choice = done.choices[0] if done.choices else None
                if choice is None:
                    raise ValueError("the reply has no choices")
                text = choice.message.content
                refusal = getattr(choice.message, "refusal", None)
                if not refusal and (not text or not text.strip()):
                    raise ValueError("the reply has no text")
                reply.text, reply.status, reply.error = text or "", "ok", ""
                reply.finish_reason, reply.refusal = choice.finish_reason, refusal
                reply.prompt_tokens, reply.completion_tokens = credible_usage(done.usage)
                return usage_cost(done.usage, e.usd_per_1k_prompt, e.usd_per_1k_completion)
            except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as err:
                reply.status, reply.http_status = "refused", err.status_code
                reply.error = f"HTTP {err.status_code}: {self._why(err)}"
                return None
            except openai.RateLimitError as err:
                reply.retries["rate_limited"] += 1
                wait = retry_after_seconds(err.response.headers)
                reply.error, reply.http_status = f"HTTP 429: {self._why(err)}", 429
            except openai.APITimeoutError:
                reply.retries["timeout"] += 1
                unread = True
                reply.error = f"timed out after {e.timeout_s:g}s"
            except openai.APIConnectionError as err:
                reply.retries["connection"] += 1
                reply.error = f"connection failed: {self._why(err)}"
            except openai.InternalServerError as err:
                reply.retries["server_error"] += 1
                reply.error, reply.http_status = f"HTTP {err.status_code}: {self._why(err)}", err.status_code
            except openai.APIStatusError as err:  # another 4xx: this request will not get better
                reply.status, reply.http_status = "rejected", err.status_code
                reply.error = f"HTTP {err.status_code}: {self._why(err)}"
                return None
            except (
                ValueError,
                KeyError,
                AttributeError,
                IndexError,
                TypeError,
                ReplyTooLarge,
                openai.APIResponseValidationError,
            ) as err:
                reply.retries["malformed"] += 1  # truncated JSON, no choices, no text
                unread = True
                reply.error = f"malformed reply: {type(err).__name__}: {self.clean(str(err))[:160]}"
            if unread:
                reply.unread += 1
                if attempt < e.max_attempts and not may_resend():
                    reply.error += "; the budget leaves no room to send it again"
                    break
            if attempt < e.max_attempts:
                self._sleep(wait if wait is not None else backoff_seconds(e.backoff_s, attempt))
        reply.status = "failed"
        reply.error = f"{reply.error} (after {reply.attempts} attempts)"
        return None

    def _why(self, err: Exception, limit: int = 200) -> str:
        """An API error's message (the body's ``message`` where there is one), cut, key masked."""
        body = getattr(err, "body", None)
        message = body.get("message") if isinstance(body, dict) and isinstance(body.get("message"), str) else str(err)
        return self.clean(message[:limit])


class ReplyTooLarge(Exception):
    """A reply body past the endpoint's ``max_reply_bytes`` (refused as it streamed in)."""


def _capped_http_client(limit: int, timeout: float):
    """The openai client's own HTTP client (its defaults), whose replies stop at ``limit`` bytes:
    a 64 MB body is refused as it streams in, not read whole. The HTTP library is the one this
    openai version builds on (httpx, or httpx2 from openai 3)."""
    import importlib

    import openai

    http = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])

    class Capped(http.SyncByteStream):
        def __init__(self, stream):
            self._stream = stream

        def __iter__(self):
            seen = 0
            for chunk in self._stream:
                seen += len(chunk)
                if seen > limit:
                    raise _too_large(limit)
                yield chunk

        def close(self):
            self._stream.close()

    class Transport(http.HTTPTransport):
        def handle_request(self, request):
            response = super().handle_request(request)
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                response.close()
                raise _too_large(limit)
            response.stream = Capped(response.stream)
            return response

    return openai.DefaultHttpxClient(transport=Transport(), timeout=timeout)


def _too_large(limit: int) -> Exception:
    """A :class:`ReplyTooLarge` the openai client passes on unwrapped (it re-raises its own errors)."""
    return _openai_reply_too_large()(f"the reply is larger than {limit:,} bytes")


@functools.cache
def _openai_reply_too_large() -> type:
    import openai

    return type("ReplyTooLarge", (ReplyTooLarge, openai.OpenAIError), {})


def credible_usage(usage) -> tuple[int | None, int | None]:
    """An OpenAI-compatible reply's (prompt, completion) token counts, or (None, None) when they
    cannot be believed: absent, or not non-negative whole numbers (the call is then charged its
    worst case)."""
    counts = [getattr(usage, name, None) for name in ("prompt_tokens", "completion_tokens")]
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
        return None, None
    return counts[0], counts[1]


def usage_cost(usage, usd_per_1k_prompt: float, usd_per_1k_completion: float) -> float | None:
    """Dollars for a reply's ``usage``, or None when it cannot be believed (:func:`credible_usage`;
    the ledger then charges the reservation)."""
    prompt, completion = credible_usage(usage)
    return None if prompt is None else (prompt * usd_per_1k_prompt + completion * usd_per_1k_completion) / 1000


def backoff_seconds(base: float, attempt: int) -> float:
    """Exponential backoff with full jitter (capped at 30 s) before retry ``attempt`` + 1."""
    return random.uniform(0, min(30.0, base * 2 ** (attempt - 1)))


def retry_after_seconds(headers) -> float | None:
    """Seconds from a Retry-After header (delta seconds or an HTTP date), capped at 60; None when it
    is absent or neither."""
    value = headers.get("retry-after") if headers is not None else None
    if not value:
        return None
    try:
        return min(60.0, max(0.0, float(value)))
    except ValueError:
        pass
    try:  # an HTTP date; anything else ("soon") says nothing: the caller's own backoff applies
        when = email.utils.parsedate_to_datetime(value)
        return min(60.0, max(0.0, when.timestamp() - time.time()))
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
