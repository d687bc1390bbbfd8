"""The cascade's cloud tier: any OpenAI-compatible endpoint, called under the budget ledger, with
bounded retries and a circuit breaker, so that a request never fails because the cloud did.

One call (:meth:`CloudClient.chat`):

1. the breaker is open (``breaker_failures`` calls in a row failed, less than ``cooldown_s`` ago)
   -> no call, ``degraded``;
2. the worst case — prompt tokens bounded by the prompt's UTF-8 bytes plus a template allowance,
   completion tokens by ``max_tokens`` — is **reserved** in the ledger; no room -> no call,
   ``budget_exhausted``;
3. up to ``1 + max_retries`` attempts: timeouts, 429 (``Retry-After`` honoured), 5xx and malformed
   replies (truncated JSON, no choices, empty text) are retried with exponential backoff and full
   jitter, counted by cause; 401/403/404 and other 4xx end the call at once;
4. the reservation is **settled** with the reported usage — plus the worst case of every attempt
   that may have been served and billed without a usable reply (a timeout, a malformed reply) —
   or **released** when nothing can have been billed. Usage that is absent, not whole numbers,
   negative, or dearer than the reservation is not believed: the call is charged its reservation
   (``usage_untrusted`` counted, a warning logged), so a reply can never credit the budget.

The API key is read from the environment variable the config names, at call time; it never
appears in a result, an error or a log line (``_clean``).
"""

from __future__ import annotations

import email.utils
import importlib.util
import logging
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kibidango.cascade.config import CloudConfig
from kibidango.cascade.ledger import BudgetExceeded, Ledger

__all__ = ["CloudClient", "CloudReply", "backoff_seconds", "credible_usage", "retry_after_seconds", "usage_cost"]

log = logging.getLogger("kibidango.cascade.cloud")

TEMPLATE_TOKENS = 64


@dataclass
class CloudReply:
    text: str | None
    usd: float = 0.0
    attempts: int = 0
    retries: Counter = field(default_factory=Counter)
    status: str = "ok"
    """``ok``, ``degraded`` (failed or breaker open), ``budget_exhausted``, ``no_key``."""
    error: str | None = None
    seconds: float = 0.0


class CloudClient:
    def __init__(self, cfg: CloudConfig, ledger: Ledger, cooldown_s: float = 30.0, sleep=time.sleep):
        self.cfg = cfg
        self.ledger = ledger
        self.cooldown_s = cooldown_s
        self._sleep = sleep
        self._lock = threading.Lock()
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.counts: Counter = Counter()  # calls by status, retries by cause: for /metrics

    def _key(self) -> str | None:
        return os.environ.get(self.cfg.api_key_env) or None

    def _clean(self, text: str) -> str:
        key = self._key()
        return text.replace(key, "[REDACTED]") if key else text

    def worst_case_usd(self, prompt_chars: str, max_tokens: int) -> float:
        prompt_tokens = len(prompt_chars.encode("utf-8")) + TEMPLATE_TOKENS
        return (prompt_tokens * self.cfg.usd_per_1k_prompt + max_tokens * self.cfg.usd_per_1k_completion) / 1000

    def breaker_open(self) -> bool:
        with self._lock:
            if self.opened_at is None:
                return False
            if time.monotonic() - self.opened_at >= self.cooldown_s:
                self.opened_at = None  # half-open: the next call tries
                self.consecutive_failures = self.cfg.breaker_failures - 1
                return False
            return True

    def _outcome(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.consecutive_failures = 0
                self.opened_at = None
            else:
                self.consecutive_failures += 1
                if self.consecutive_failures >= self.cfg.breaker_failures and self.opened_at is None:
                    self.opened_at = time.monotonic()
                    log.warning(f"cloud {self.cfg.model}: {self.consecutive_failures} failed calls in a row; "
                                f"answering locally for {self.cooldown_s:g}s")  # fmt: skip

    def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> CloudReply:
        started = time.monotonic()
        max_tokens = max_tokens or self.cfg.max_tokens
        reply = CloudReply(None)
        if self.breaker_open():
            reply.status, reply.error = "degraded", "circuit breaker open"
            self.counts["breaker_open"] += 1
            return reply
        if importlib.util.find_spec("openai") is None:
            reply.status, reply.error = (
                "degraded",
                "the cloud tier needs the openai package (pip install 'kibidango[cloud]')",
            )
            self.counts["no_client"] += 1
            return reply
        key = self._key()
        if key is None:
            reply.status, reply.error = "no_key", f"${self.cfg.api_key_env} is not set"
            self.counts["no_key"] += 1
            return reply
        worst = self.worst_case_usd("".join(m["content"] for m in messages), max_tokens)
        rids: list[str] = []
        try:
            rids.append(self.ledger.reserve(worst, note=f"cloud {self.cfg.model}"))
        except BudgetExceeded as e:
            reply.status, reply.error = "budget_exhausted", str(e)
            self.counts["budget_exhausted"] += 1
            return reply

        def may_resend() -> bool:  # an attempt may have been billed: its reservation stays; reserve the next
            try:
                rids.append(self.ledger.reserve(worst, note=f"cloud {self.cfg.model} (resend)"))
                return True
            except BudgetExceeded:
                return False

        try:
            # usd: the reported cost; billed: attempts served (perhaps billed) without a usable reply
            usd, billed = self._attempts(messages, max_tokens, key, reply, may_resend)
        except Exception as e:  # an unexpected library error: logged, never the request's failure
            log.error(f"cloud {self.cfg.model}: unexpected {type(e).__name__}: {self._clean(str(e))[:200]}")
            reply.text, reply.status, reply.error = None, "degraded", f"unexpected {type(e).__name__}"
            usd, billed = 0.0, len(rids)  # any of them may have been served: each charged its worst case
        # the first `billed` reservations are charged their worst case; the next one, if a reply
        # came, what the reply cost (its reservation when the usage is not credible); the rest
        # were never used
        reply.usd = 0.0
        for i, rid in enumerate(rids):
            if i < billed:
                reply.usd += self.ledger.settle(rid, worst)
            elif i == billed and reply.text is not None:
                charged = self.ledger.settle(rid, usd)
                if charged != usd:
                    self.counts["usage_untrusted"] += 1
                reply.usd += charged
            else:
                self.ledger.release(rid)
        reply.seconds = time.monotonic() - started
        self._outcome(reply.text is not None)
        self.counts[reply.status] += 1
        for cause, n in reply.retries.items():
            self.counts[f"retry_{cause}"] += n
        return reply

    def _attempts(self, messages, max_tokens: int, key: str, reply: CloudReply, may_resend) -> tuple[float | None, int]:
        import openai

        cfg = self.cfg
        client = openai.OpenAI(base_url=cfg.base_url, api_key=key, timeout=cfg.timeout_s, max_retries=0)
        maybe_billed = 0
        for attempt in range(1, cfg.max_retries + 2):
            reply.attempts = attempt
            wait = None
            billed_before = maybe_billed
            try:
                done = client.chat.completions.create(
                    model=cfg.model, messages=messages, max_tokens=max_tokens, temperature=0.0
                )
                text = done.choices[0].message.content if done.choices else None
                if not text or not text.strip():
                    raise ValueError("the reply has no text")
                reply.text, reply.status, reply.error = text, "ok", None
                return usage_cost(done.usage, cfg.usd_per_1k_prompt, cfg.usd_per_1k_completion), maybe_billed
            except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as e:
                reply.status, reply.error = (
                    "degraded",
                    f"HTTP {e.status_code}: check base_url, model and ${cfg.api_key_env}",
                )
                return 0.0, maybe_billed
            except openai.RateLimitError as e:
                reply.retries["rate_limited"] += 1
                wait = retry_after_seconds(e.response.headers)
                reply.error = "HTTP 429"
            except openai.APITimeoutError:
                reply.retries["timeout"] += 1
                maybe_billed += 1
                reply.error = f"timed out after {cfg.timeout_s:g}s"
            except openai.APIConnectionError:
                reply.retries["connection"] += 1
                reply.error = "connection failed"
            except openai.InternalServerError as e:
                reply.retries["server_error"] += 1
                reply.error = f"HTTP {e.status_code}"
            except openai.APIStatusError as e:
                reply.status, reply.error = "degraded", f"HTTP {e.status_code}: {self._clean(str(e))[:200]}"
                return 0.0, maybe_billed
            except (
                ValueError,
                KeyError,
                AttributeError,
                IndexError,
                TypeError,
                openai.APIResponseValidationError,
            ) as e:
                reply.retries["malformed"] += 1
                maybe_billed += 1
                reply.error = f"malformed reply: {type(e).__name__}"
            if attempt <= cfg.max_retries and maybe_billed > billed_before and not may_resend():
                reply.error += "; no budget left to send it again"
                break
            if attempt <= cfg.max_retries:
                self._sleep(wait if wait is not None else backoff_seconds(0.5, attempt))
        reply.status = "degraded"
        reply.error = self._clean(f"{reply.error} (after {reply.attempts} attempts)")
        return 0.0, maybe_billed


def credible_usage(usage) -> tuple[int | None, int | None]:
    """An OpenAI-compatible reply's (prompt, completion) token counts, or (None, None) when they
    cannot be believed: absent, or not non-negative whole numbers (the caller then charges the
    call's worst case). Used by this cloud tier and by stage 1D's teachers."""
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
    """Seconds from a Retry-After header (delta seconds or an HTTP date), capped at 60."""
    value = headers.get("retry-after") if headers is not None else None
    if not value:
        return None
    try:
        return min(60.0, max(0.0, float(value)))
    except ValueError:
        when = email.utils.parsedate_to_datetime(value)
        return min(60.0, max(0.0, when.timestamp() - time.time())) if when else None
