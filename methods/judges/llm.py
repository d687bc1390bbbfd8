"""The LLM judge: a rubric prompt to any OpenAI-compatible endpoint (OpenAI, OpenRouter, vLLM,
llama.cpp's server, ...) through the one paid client (:class:`kibidango.paid.client.PaidClient`:
retries by cause, Retry-After, the key from the environment), and the answer parsed as JSON
against a schema.

The recipe gives the endpoint (``base_url``), the ``model`` and the *name* of the environment
variable holding the key (``api_key_env``), never the key: it is read when the judge is built,
and no reason, error or detail this module writes can hold it.

Structured output, by ``response_format``:

- ``json_schema``: OpenAI's structured outputs (``{"type": "json_schema", ...}``), also served by
  vLLM and OpenRouter;
- ``json_object``: ``{"type": "json_object", "schema": ...}``, the form llama.cpp's and
  llama-cpp-python's servers constrain with a grammar. Their grammar ignores a number's
  ``minimum``/``maximum`` (SmolLM2-135M-Instruct scored an answer 5 under it), so this schema gives
  the score as one of 0, 0.1, ..., 1, which a grammar does enforce (:data:`GRAMMAR_VERDICT_SCHEMA`);
- ``none``: the schema is only described in the prompt.

Whatever the endpoint promised, the reply is parsed and validated here: text that is not a JSON
object of the schema, a refusal, or a reply cut at ``max_tokens`` is a ``judge_error`` verdict,
never a pass. So is an endpoint that stays unreachable (timeouts, 5xx, rate limits) after
``max_attempts`` requests: ``details["retryable"]`` says a later run may judge that answer again; so is a
request the endpoint rejects (HTTP 400: too long for its context, filtered), not retryable. A
wrong key or an unknown model (401, 403, 404) are configuration errors and raise
:class:`JudgeConfigError`: every verdict after them would fail the same way.

``cost`` is the wall seconds of the call; ``details`` carries the token usage and, where the recipe
gives prices, the dollars.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field

from core.contract import KibidangoError
from core.redaction import redact_text, secret_from_env
from kibidango.paid.client import PaidClient
from kibidango.paid.settings import EndpointSettings
from methods.judges.base import Task, Verdict

__all__ = [
    "DEFAULT_RUBRIC",
    "GRAMMAR_VERDICT_SCHEMA",
    "VERDICT_SCHEMA",
    "JudgeConfigError",
    "LLMJudge",
    "LLMJudgeSettings",
    "parse_verdict",
]

VERDICT_SCHEMA = {
    "type": "object",
    "properties": {
        "passed": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "reason": {"type": "string"},
    },
    "required": ["passed", "score", "reason"],
    "additionalProperties": False,
}

GRAMMAR_VERDICT_SCHEMA = {
    **VERDICT_SCHEMA,
    "properties": {**VERDICT_SCHEMA["properties"], "score": {"enum": [i / 10 for i in range(11)]}},
}

DEFAULT_RUBRIC = (
    "You grade an assistant's answer to a task. Judge correctness first, then completeness and "
    "clarity. Reply with a JSON object only: "
    '{"passed": true or false, "score": a number from 0 to 1, "reason": "one sentence"}.'
)

_USER = "Task:\n{prompt}\n\nReference answer (may be empty):\n{reference}\n\nAnswer to grade:\n{answer}"


class JudgeConfigError(KibidangoError):
    """The endpoint refuses the judge's configuration (key, model, request): stop, do not count."""


def parse_verdict(content: str | None, refusal: str | None = None, finish_reason: str | None = None) -> dict:
    """The verdict fields of a reply, or ``{"error": why}``: a refusal, a reply cut at the token
    limit or by a content filter, text that is not JSON, or JSON outside the schema."""
    if refusal:
        return {"error": f"the judge refused: {refusal[:200]}"}
    if finish_reason in ("length", "content_filter"):
        return {"error": f"the judge's reply was cut ({finish_reason})"}
    if not content or not content.strip():
        return {"error": "the judge's reply is empty"}
    text = content.strip()
    if text.startswith("```"):  # a fenced reply: take the block
        text = text.strip("`").removeprefix("json").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return {"error": f"the judge's reply is not JSON ({e.msg} at char {e.pos}): {text[:80]!r}"}
    if not isinstance(data, dict):
        return {"error": f"the judge's reply is JSON but not an object: {text[:80]!r}"}
    passed, score, reason = data.get("passed"), data.get("score"), data.get("reason")
    if not isinstance(passed, bool):
        return {"error": "the judge's reply has no boolean 'passed'"}
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 1:
        return {"error": f"the judge's 'score' is not a number in [0, 1]: {score!r}"}
    if not isinstance(reason, str):
        return {"error": "the judge's reply has no string 'reason'"}
    return {"passed": passed, "score": float(score), "reason": reason}


class LLMJudgeSettings(EndpointSettings):
    """The ``llm`` judge's settings: an endpoint (:class:`kibidango.paid.settings.EndpointSettings`)
    and how it is asked."""

    kind: Literal["llm"] = Field("llm", description="Judge kind: a model asked through an OpenAI-compatible endpoint.")
    max_attempts: int = Field(3, ge=1, le=100, description="HTTP requests per verdict, retries included.")
    rubric: str = Field(DEFAULT_RUBRIC, description="The system prompt the verdict follows.")
    response_format: Literal["json_schema", "json_object", "none"] = Field(
        "json_schema",
        description="Structured output asked of the endpoint: a JSON schema (OpenAI), a JSON object with a grammar "
        "(llama.cpp), or none (the reply parsed as it comes).",
    )
    max_tokens: int = Field(256, gt=0, description="Most tokens of the verdict.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of the verdict.")
    max_chars: int = Field(6000, gt=0, description="Task, reference and answer are each cut to this many characters.")


class LLMJudge:
    """A rubric prompt to an OpenAI-compatible endpoint, the reply parsed against a schema."""

    kind = "llm"

    def __init__(self, settings: LLMJudgeSettings | None = None, **fields) -> None:
        self.settings = s = settings if settings is not None else LLMJudgeSettings(**fields)
        if s.api_key_env:
            secret_from_env(s.api_key_env, f"llm judge {s.model}")  # set, or a clear error now
        self._client = PaidClient(s.endpoint(f"llm judge {s.model}"))

    def _request(self, task: Task, answer: str) -> dict:
        s = self.settings
        cut = s.max_chars
        user = _USER.format(prompt=task.prompt[:cut], reference=task.reference[:cut], answer=answer[:cut])
        kw: dict = {
            "model": s.model,
            "messages": [{"role": "system", "content": s.rubric}, {"role": "user", "content": user}],
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
        }
        if s.response_format == "json_schema":
            kw["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": VERDICT_SCHEMA, "strict": True},
            }
        elif s.response_format == "json_object":
            kw["response_format"] = {"type": "json_object", "schema": GRAMMAR_VERDICT_SCHEMA}
        return kw

    def __call__(self, task: Task, answer: str) -> Verdict:
        s, request = self.settings, self._request(task, answer)
        extra = {"response_format": request["response_format"]} if "response_format" in request else {}
        r = self._client.chat(request["messages"], s.max_tokens, s.temperature, **extra)
        details = {"prompt_tokens": r.prompt_tokens or 0, "completion_tokens": r.completion_tokens or 0, "usd": r.usd}
        error = redact_text(r.error)
        if r.status in ("refused", "no_key"):
            raise JudgeConfigError(
                f"llm judge {s.model} at {s.base_url}: the endpoint refused the request ({error}); "
                f"check base_url, model and {s.api_key_env or 'the key'}"
            )
        if r.status == "rejected":  # this request (too long for the context, filtered, ...)
            return Verdict(False, 0.0, f"the judge rejected the request ({error})", "judge_error", r.seconds, details)
        if r.status != "ok":  # unreachable, rate limited, 5xx, malformed: a later run may judge it again
            reason = f"judge unreachable: {error}"
            return Verdict(False, 0.0, reason, "judge_error", r.seconds, {**details, "retryable": True})
        parsed = parse_verdict(r.text, r.refusal, r.finish_reason)
        if "error" in parsed:
            return Verdict(False, 0.0, redact_text(parsed["error"]), "judge_error", r.seconds, details)
        passed, score = parsed["passed"], parsed["score"]
        reason = redact_text(parsed["reason"][:500])
        return Verdict(passed, score, reason, "passed" if passed else "failed", r.seconds, details)
