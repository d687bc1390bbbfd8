"""Teacher tiers for the cascade (stage 1D): OpenAI-compatible endpoints called through the one
paid client (:class:`kibidango.paid.client.PaidClient`: retries by cause with Retry-After and
jitter, the worst case reserved in the budget ledger and settled with the reported usage, the key
from an environment variable), and a journal of every paid request.

- :class:`TierConfig`: one tier of the recipe's ordered list: an OpenAI-compatible endpoint
  (``base_url``, ``model``, ``api_key_env`` — the variable's *name* —, prices per 1K prompt and
  completion tokens, ``max_tokens``, ``concurrency``), or ``kind: reference``, which answers with
  the dataset's gold answer at a flat ``usd_per_answer`` (the stand-in for the costliest,
  human-written tier), or ``kind: self``: the student itself, sampled ``samples`` times at
  ``temperature`` and judged by the task's own judge, its first passing answer taken
  (rejection-sampling fine-tuning / STaR: Yuan et al. 2023, arXiv 2308.01825; Zelikman et al. 2022,
  arXiv 2203.14465), priced as local compute at the tier's per-1K-token prices. A ``self`` tier
  with ``hint: answer`` is STaR's *rationalization*: the student is shown the reference's final
  number (``hint_text``) and asked again; an answer passes only if the task's judge passes it and
  its working derives the number (:func:`methods.judges.math.underived`); the pair keeps the
  question without the hint. It takes only the rows a number answers (the math judge's). With
  ``hint: feedback`` (self-debugging: Chen et al. 2023, arXiv 2304.05128) a code failure is asked
  again with the student's own failing program and what it did on the test the task shows
  (``feedback_text``: "returned 35 where 1225 is expected", "raised NameError: ..."); the judge runs
  every test of the task, those the prompt does not show too, so a program fitted to the shown test
  does not pass; the pair keeps the question without the hint.
- :class:`TeacherClient`: one tier's calls under the run's :class:`~kibidango.paid.ledger.Ledger`
  (a request is sent only when its **worst-case** cost fits what is left, so the spend never
  passes the limit); 401/403/404 and a connection that never opens make the tier **dead**
  (:class:`TierDead`, reported by name; its rows escalate).
The stage journals every paid request (:class:`methods.journal.Journal`): ``sent`` is written
*before* it leaves, ``reply``/``error`` after, so a run killed in between knows the request may
have been paid: it charges the reservation and never sends that prompt to that tier again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from pydantic import Field, model_validator

from core.contract import KibidangoError
from core.redaction import redact_text, secret_from_env
from kibidango.paid.client import Endpoint, PaidClient, PaidReply
from kibidango.paid.ledger import Ledger
from kibidango.paid.settings import EndpointSettings

__all__ = [
    "FEEDBACK_PROGRAM_CHARS",
    "TeacherClient",
    "TierConfig",
    "TierDead",
    "worst_case_usd",
]

log = logging.getLogger("kibidango.teachers")

FEEDBACK_PROGRAM_CHARS = 1500
"""The most of a failing program a `feedback` hint shows (its start)."""


class TierConfig(EndpointSettings):
    """A teacher tier of 1D: an endpoint (:class:`kibidango.paid.settings.EndpointSettings`: URL,
    model, key variable, prices, timeout, attempts, backoff) served elsewhere or by the stage, the
    dataset's gold answer, or the student itself."""

    name: str = Field(description="The tier's name in tables, metrics and errors.")
    kind: Literal["openai", "reference", "self"] = Field(
        "openai",
        description="An endpoint; the dataset's gold answer; or `self`: the student sampled `samples` times and "
        "judged, its first passing answer taken (STaR / rejection sampling), priced as local compute.",
    )
    samples: int = Field(
        8, ge=1, le=256, description="`self`: answers sampled per failure before it escalates to the next tier."
    )
    hint: Literal["answer", "feedback"] | None = Field(
        None,
        description="`self`: `answer` shows the student the reference's final number (`hint_text`) and keeps an "
        "answer only if its working derives it (STaR's rationalization); `feedback` shows a code failure's own "
        "program and what it did on the task's shown test (`feedback_text`: self-debugging); the pair is the "
        "question without the hint.",
    )
    hint_text: str = Field(
        "Hint: the answer is {answer}. Show the working, then end with #### {answer}.",
        description="`hint: answer`: the line added after the task ({answer}: the reference's final number).",
    )
    feedback_text: str = Field(
        "Your earlier answer was:\n{program}\nChecked with `{test}`, it {outcome}. Write the corrected function.",
        description="`hint: feedback`: the text added after the task ({program}: the student's failing program; "
        "{test}: the test the task shows; {outcome}: what the program did on it).",
    )
    base_url: str | None = Field(None, description="OpenAI-compatible endpoint (…/v1); None when `serve` is set.")
    model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The model name sent to the endpoint (default: the tier's name).",
    )
    serve: str | None = Field(
        None,
        description="Serve this checkpoint (an HF directory, a GGUF file, or package:<dist>/<file> inside an "
        "installed package) locally: converted to GGUF, llama-cpp-python's server on 127.0.0.1, started and "
        "stopped by the stage.",
    )
    serve_input: str | None = Field(
        None,
        description="Serve a model of an upstream stage instead: `<input>/<directory>` of the stage's inputs "
        "(e.g. `teachers/mid`: stage 1T's tier mid).",
    )
    chat_format: str | None = Field(
        None,
        description="A served tier's llama-cpp-python chat format; None: the stage's `serve_chat_format`; `gguf`: "
        "the chat template inside the GGUF (an instruct model's own, e.g. SmolLM2's ChatML).",
    )
    usd_per_answer: float = Field(0.0, ge=0, description="Flat price per answer (the reference tier's).")
    max_tokens: int = Field(256, gt=0, description="Most tokens of a teacher's answer.")
    concurrency: int = Field(1, ge=1, le=64, description="Requests in flight at once for this tier.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (a `self` tier samples above 0).")
    system: str = Field(
        "You are a careful expert. Answer the task correctly and concisely.",
        description="The system prompt an endpoint tier is asked with.",
    )

    @model_validator(mode="after")
    def _where(self) -> TierConfig:
        if self.kind == "self":
            if any(x is not None for x in (self.base_url, self.serve, self.serve_input, self.model)):
                raise ValueError(f"tier {self.name!r}: a `self` tier samples the stage's `student` input, no endpoint")
            if self.samples > 1 and self.temperature <= 0:
                raise ValueError(f"tier {self.name!r}: {self.samples} samples at temperature 0 are one answer")
            if self.hint == "answer" and "{answer}" not in self.hint_text:
                raise ValueError(f"tier {self.name!r}: `hint_text` must show the answer: put {{answer}} in it")
            missing = [k for k in ("{program}", "{outcome}") if k not in self.feedback_text]
            if self.hint == "feedback" and missing:
                raise ValueError(f"tier {self.name!r}: `feedback_text` must show {' and '.join(missing)}")
        elif self.hint is not None:
            raise ValueError(f"tier {self.name!r}: only a `self` tier takes a hint")
        if self.kind == "openai":
            if sum(x is not None for x in (self.base_url, self.serve, self.serve_input)) != 1:
                raise ValueError(f"tier {self.name!r}: give exactly one of `base_url`, `serve` or `serve_input`")
            if self.serve_input is not None and "/" not in self.serve_input.strip("/"):
                raise ValueError(f"tier {self.name!r}: `serve_input` is `<input>/<directory>`")
            if self.model is None and self.base_url is not None:
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
    """The most a call of ``tier`` on ``prompt`` can cost (the paid client's bound: prompt tokens
    at most its UTF-8 bytes plus a template allowance, completion tokens at most ``max_tokens``)."""
    if tier.kind == "reference":
        return tier.usd_per_answer
    if tier.kind == "self":  # every sample reads the prompt (and the hint) and writes at most max_tokens
        if tier.hint == "answer":
            prompt = f"{prompt}\n\n{tier.hint_text.format(answer='9' * 24)}"
        elif tier.hint == "feedback":  # a program and an outcome at most as long as a hint shows them
            shown = tier.feedback_text.format(program="9" * FEEDBACK_PROGRAM_CHARS, test=prompt, outcome="9" * 300)
            prompt = f"{prompt}\n\n{shown}"
        one = _endpoint(tier, "local").worst_case_usd([{"role": "user", "content": prompt}], tier.max_tokens)
        return tier.samples * one
    messages = [{"role": "system", "content": tier.system}, {"role": "user", "content": prompt}]
    return _endpoint(tier, tier.base_url or "").worst_case_usd(messages, tier.max_tokens)


class TierDead(KibidangoError):
    """The tier cannot answer at all (bad key, unknown model, nothing listening). ``usd``: what the
    call was charged before the tier refused (attempts that timed out first may have been billed)."""

    def __init__(self, message: str, usd: float = 0.0):
        super().__init__(message)
        self.usd = usd


class TeacherClient:
    """Calls one OpenAI-compatible tier (``base_url`` given, or the local server's for ``serve``)
    under ``ledger``."""

    def __init__(self, tier: TierConfig, ledger: Ledger, base_url: str | None = None, sleep=time.sleep):
        self.tier = tier
        self.base_url = base_url or tier.base_url
        if tier.api_key_env:
            secret_from_env(tier.api_key_env, f"teacher tier {tier.name}")  # set, or a clear error now
        self.paid = PaidClient(_endpoint(tier, self.base_url), ledger, sleep)

    def ask(self, prompt: str, on_send: Callable[[float], None] | None = None) -> PaidReply:
        """The tier's answer to ``prompt`` (``status`` ``budget_exhausted``: nothing was sent).
        ``on_send(reserved_usd)`` runs once the worst case is reserved, before the request leaves."""
        t = self.tier
        messages = [{"role": "system", "content": t.system}, {"role": "user", "content": prompt}]
        reply = self.paid.chat(messages, t.max_tokens, t.temperature, note=f"teacher {t.name}", on_send=on_send)
        reply.error = redact_text(reply.error)
        if reply.status == "refused":
            raise TierDead(
                f"teacher tier {t.name} ({self.base_url}, model {t.model or t.name}) refused the request "
                f"({reply.error}); check its base_url, model and {t.api_key_env or 'key'}",
                reply.usd,
            )
        if reply.attempts and reply.retries["connection"] == reply.attempts:
            raise TierDead(f"teacher tier {t.name} ({self.base_url}) is unreachable: {reply.error}", reply.usd)
        return reply


def _endpoint(tier: TierConfig, base_url: str) -> Endpoint:
    return tier.endpoint(f"teacher {tier.name}", base_url, tier.model or tier.name)
