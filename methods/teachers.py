"""Teacher tiers for the cascade (stage 1D): OpenAI-compatible endpoints called robustly, a hard
dollar budget, and a journal of every paid request.

- :class:`TierConfig`: one tier of the recipe's ordered list: an OpenAI-compatible endpoint
  (``base_url``, ``model``, ``api_key_env`` — the variable's *name* —, prices per 1K prompt and
  completion tokens, ``max_tokens``, ``concurrency``), or ``kind: reference``, which answers with
  the dataset's gold answer at a flat ``usd_per_answer`` (the stand-in for the costliest,
  human-written tier).
- :class:`Budget`: a request is sent only when its **worst-case** cost fits what is left: the cost
  is reserved first and settled with the usage the endpoint reports, so the spend never passes
  the limit. The worst case bounds prompt tokens by the prompt's UTF-8 bytes plus a template
  allowance (no tokenizer makes more tokens than bytes, bar special tokens) and completion tokens
  by ``max_tokens``.
- :class:`TeacherClient`: one call = up to ``max_attempts`` HTTP requests: timeouts, 429 (honouring
  ``Retry-After``), 5xx and malformed replies (truncated JSON, no choices, empty text) are retried
  with exponential backoff and full jitter and counted by cause; 401/403/404 and a connection that
  never opens make the tier **dead** (reported by name; its rows escalate).
The stage journals every paid request (:class:`methods.journal.Journal`): ``sent`` is written
*before* it leaves, ``reply``/``error`` after, so a run killed in between knows the request may
have been paid: it charges the reservation and never sends that prompt to that tier again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.contract import KibidangoError
from core.redaction import redact_text, secret_from_env
from kibidango.cascade.cloud import backoff_seconds, credible_usage, retry_after_seconds
from methods.judges.llm import api_error_text

__all__ = [
    "Budget",
    "TeacherClient",
    "TeacherReply",
    "TierConfig",
    "TierDead",
    "worst_case_usd",
]

log = logging.getLogger("kibidango.teachers")

TEMPLATE_TOKENS = 64
"""Allowance for the chat template's tokens around the prompt in the worst-case cost."""


class TierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The tier's name in tables, metrics and errors.")
    kind: Literal["openai", "reference"] = Field("openai", description="An endpoint, or the dataset's gold answer.")
    base_url: str | None = Field(None, description="OpenAI-compatible endpoint (…/v1); None when `serve` is set.")
    model: str | None = Field(None, description="The model name sent to the endpoint.")
    api_key_env: str | None = Field(None, description="Name of the environment variable holding the key.")
    serve: str | None = Field(
        None,
        description="Serve this tier of the stage's `family` input locally (converted to GGUF, "
        "llama-cpp-python's server on 127.0.0.1, started and stopped by the stage).",
    )
    usd_per_1k_prompt: float = Field(0.0, ge=0)
    usd_per_1k_completion: float = Field(0.0, ge=0)
    usd_per_answer: float = Field(0.0, ge=0, description="Flat price per answer (the reference tier's).")
    max_tokens: int = Field(256, gt=0)
    concurrency: int = Field(1, ge=1, le=64, description="Requests in flight at once for this tier.")
    timeout_s: float = Field(60.0, gt=0)
    max_attempts: int = Field(4, ge=1, le=20, description="HTTP requests per call, retries included.")
    backoff_s: float = Field(0.5, ge=0, description="First backoff; doubles per retry, full jitter, capped at 30 s.")
    temperature: float = Field(0.0, ge=0)
    system: str = Field("You are a careful expert. Answer the task correctly and concisely.")

    @model_validator(mode="after")
    def _where(self) -> TierConfig:
        if self.kind == "openai":
            if (self.base_url is None) == (self.serve is None):
                raise ValueError(f"tier {self.name!r}: give exactly one of `base_url` or `serve`")
            if self.model is None and self.serve is None:
                raise ValueError(f"tier {self.name!r}: `model` is required with `base_url`")
        return self

    @property
    def paid(self) -> bool:
        return self.usd_per_1k_prompt > 0 or self.usd_per_1k_completion > 0 or self.usd_per_answer > 0

    def usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.usd_per_1k_prompt + completion_tokens * self.usd_per_1k_completion
        ) / 1000 + self.usd_per_answer


def worst_case_usd(tier: TierConfig, prompt: str) -> float:
    """The most a call of ``tier`` on ``prompt`` can cost (see the module docstring)."""
    if tier.kind == "reference":
        return tier.usd_per_answer
    prompt_bound = len((tier.system + prompt).encode("utf-8")) + TEMPLATE_TOKENS
    return tier.usd(prompt_bound, tier.max_tokens)


class Budget:
    """A hard limit in dollars, shared by every thread of a run."""

    def __init__(self, limit_usd: float, spent_usd: float = 0.0):
        self.limit = limit_usd
        self.spent = spent_usd
        self.reserved = 0.0
        self._lock = threading.Lock()

    def reserve(self, usd: float) -> bool:
        """Hold ``usd`` if it fits what is left (spent + held + usd <= limit)."""
        with self._lock:
            if self.spent + self.reserved + usd > self.limit + 1e-12:
                return False
            self.reserved += usd
            return True

    def settle(self, reserved: float, actual: float) -> None:
        """Release a reservation and charge what the request really cost."""
        with self._lock:
            self.reserved -= reserved
            self.spent += actual


class TierDead(KibidangoError):
    """The tier cannot answer at all (bad key, unknown model, nothing listening)."""


@dataclass
class TeacherReply:
    text: str | None
    """None when every attempt failed (``error`` says why)."""
    prompt_tokens: int | None = 0
    """None (both counts) when the reply's usage is absent or not credible: charged its worst case."""
    completion_tokens: int | None = 0
    attempts: int = 0
    retries: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    error: str = ""
    maybe_paid: bool = False
    """True when an attempt may have been served and billed without a usable reply."""

    @property
    def unread(self) -> int:
        """Attempts that may have been served and billed but gave no usable reply (timeouts,
        malformed replies): charged their worst case."""
        return self.retries["timeout"] + self.retries["malformed"]


class TeacherClient:
    """Calls one OpenAI-compatible tier (``base_url`` given, or the local server's for ``serve``)."""

    def __init__(self, tier: TierConfig, base_url: str | None = None, sleep=time.sleep):
        from openai import OpenAI

        self.tier = tier
        self.base_url = base_url or tier.base_url
        key = secret_from_env(tier.api_key_env, f"teacher tier {tier.name}") if tier.api_key_env else "none"
        self._client = OpenAI(base_url=self.base_url, api_key=key, timeout=tier.timeout_s, max_retries=0)
        self._sleep = sleep

    def ask(self, prompt: str, may_resend: Callable[[], bool] | None = None) -> TeacherReply:
        """The tier's answer to ``prompt``. After an attempt that may have been served and billed
        without a usable reply (a timeout, a malformed reply), ``may_resend`` is asked before the
        prompt is sent again (the stage reserves another worst case there); False ends the call."""
        import openai

        t = self.tier
        started = time.monotonic()
        reply = TeacherReply(None)
        for attempt in range(1, t.max_attempts + 1):
            reply.attempts = attempt
            wait = None
            unread = False  # served, perhaps billed, but no usable reply
            try:
                done = self._client.chat.completions.create(
                    model=t.model or t.serve,
                    messages=[{"role": "system", "content": t.system}, {"role": "user", "content": prompt}],
                    max_tokens=t.max_tokens,
                    temperature=t.temperature,
                )
                text = done.choices[0].message.content if done.choices else None
                if not text or not text.strip():
                    raise ValueError("the reply has no text")
                reply.text = text
                reply.prompt_tokens, reply.completion_tokens = credible_usage(done.usage)
                reply.seconds = time.monotonic() - started
                return reply
            except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as e:
                raise TierDead(
                    f"teacher tier {t.name} ({self.base_url}, model {t.model or t.serve}) refused the request "
                    f"(HTTP {e.status_code}): {_why(e)}; check its base_url, model and {t.api_key_env or 'key'}"
                ) from None
            except openai.RateLimitError as e:
                reply.retries["rate_limited"] += 1
                wait = retry_after_seconds(e.response.headers)
                reply.error = f"HTTP 429: {_why(e)}"
            except openai.APITimeoutError:
                reply.retries["timeout"] += 1
                unread = True
                reply.error = f"timed out after {t.timeout_s:g}s"
            except openai.APIConnectionError as e:
                reply.retries["connection"] += 1
                reply.error = f"connection failed: {_why(e)}"
            except openai.InternalServerError as e:
                reply.retries["server_error"] += 1
                reply.error = f"HTTP {e.status_code}: {_why(e)}"
            except openai.APIStatusError as e:  # other 4xx: this request will not get better
                reply.error = f"HTTP {e.status_code}: {_why(e)}"
                break
            except (
                ValueError,
                KeyError,
                AttributeError,
                IndexError,
                TypeError,
                openai.APIResponseValidationError,
            ) as e:
                reply.retries["malformed"] += 1  # truncated JSON, no choices, no text
                unread = True
                reply.error = f"malformed reply: {type(e).__name__}: {redact_text(str(e))[:160]}"
            if unread:
                reply.maybe_paid = True
                if attempt < t.max_attempts and may_resend is not None and not may_resend():
                    reply.error += "; the budget leaves no room to send it again"
                    break
            if attempt < t.max_attempts:
                self._sleep(wait if wait is not None else backoff_seconds(t.backoff_s, attempt))
        reply.seconds = time.monotonic() - started
        if reply.retries["connection"] == reply.attempts:
            raise TierDead(f"teacher tier {t.name} ({self.base_url}) is unreachable: {reply.error}")
        return reply


def _why(e: Exception) -> str:
    return api_error_text(e, limit=200)
