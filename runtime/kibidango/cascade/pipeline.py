"""The local/cloud cascade per request: route (6A) -> answer locally (the configured decoding mode,
at most ``draft.max_tokens``, at the temperature the calibrator was fitted on — greedy — unless the
caller sets one: flag ``uncalibrated_decoding`` when it differs) -> calibrated confidence (2G)
and, when the config asks, the escalation detector's flag (6B) -> one of

- ``local``: confidence at or above ``qualifier.threshold`` (and not flagged): the local answer;
- ``validated`` / ``corrected``: between ``cloud.fallback_threshold`` and the qualifier threshold:
  the cloud sees the question and the local answer and approves it (a short verdict) or returns a
  correction;
- ``cloud``: below the fallback threshold: the cloud answers.

A prompt longer than the local tiers' context goes to the cloud (flag ``local_context``). When
the cloud cannot answer — no key, the budget spent, the circuit breaker open, every retry
failed — the local answer is returned with the reason in ``flags`` (``degraded``,
``budget_exhausted``, ``no_key``): a request never fails because the cloud did. Every result
says which tier answered, the confidence, what it cost and the budget left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kibidango.backends.base import ContextLengthError
from kibidango.cascade.cloud import CloudClient, CloudReply
from kibidango.cascade.config import CascadeConfig, load_cascade
from kibidango.paid.ledger import Ledger
from kibidango.paid.state import default_state_dir
from kibidango.pipeline import GenerationResult, Pipeline

__all__ = ["CascadePipeline", "CascadeResult", "Draft", "VALIDATION_PROMPT"]

VALIDATION_PROMPT = (
    "You check another assistant's answer. If the answer below is correct and complete, reply with "
    "the single word APPROVE. Otherwise reply with a corrected answer only.\n\n"
    "Question:\n{question}\n\nAnswer:\n{answer}"
)


@dataclass
class CascadeResult:
    text: str
    tier: str
    """``local``, ``validated``, ``corrected`` or ``cloud``."""
    confidence: float | None
    p_fail: float | None
    usd: float
    budget_left_usd: float | None
    flags: list[str] = field(default_factory=list)
    local: GenerationResult | None = None
    cloud: CloudReply | None = None

    def to_dict(self) -> dict:
        return {
            "tier": self.tier,
            "confidence": self.confidence,
            "p_fail": self.p_fail,
            "usd": self.usd,
            "budget_left_usd": self.budget_left_usd,
            "flags": list(self.flags),
            "cloud_attempts": self.cloud.attempts if self.cloud else 0,
            "cloud_retries": dict(self.cloud.retries) if self.cloud else {},
            "local": self.local.metrics.to_dict() if self.local else None,
        }


@dataclass
class Draft:
    """The local phase's outcome (:meth:`CascadePipeline.local`): the local answer, its scores and
    what the cloud should do with it (``action``: ``None``, ``validate`` or ``answer``)."""

    result: CascadeResult
    action: str | None
    query: str
    messages: list[dict[str, str]]


class CascadePipeline:
    """``CascadePipeline(pipe, config, state_dir)``: ``pipe`` answers locally (its bundle's router,
    adapters and calibrator apply); ``state_dir`` holds the budget ledger shared by every process
    that uses it.

    :meth:`answer` does both phases; a server runs :meth:`local` while it holds the models and
    :meth:`escalate` (the network call) after it let them go, so other requests decode meanwhile."""

    def __init__(self, pipe: Pipeline, config: CascadeConfig, state_dir: str | Path, client: CloudClient | None = None):
        self.pipe = pipe
        self.config = config
        self.detector = pipe.bundle.escalation() if (pipe.bundle is not None and config.use_detector) else None
        self.ledger = None
        self.client = client
        if config.cloud is not None:
            self.ledger = Ledger(state_dir, config.cloud.budget_limit, config.cloud.budget_period)
            self.ledger.reap()  # calls of processes killed mid-call: charged their reserved worst case
            self.client = client or CloudClient(config.cloud, self.ledger)
        pipe.router_threshold = config.router_threshold

    @classmethod
    def from_bundle(
        cls,
        bundle: str | Path,
        config: str | Path | None = None,
        state_dir: str | Path | None = None,
        **from_bundle,
    ) -> CascadePipeline:
        """The local/cloud cascade over a bundle: ``config`` is a named cascade config
        (``plan-example``, ``local-only``), a JSON/YAML file, or None for the bundle's own (6C);
        ``state_dir`` holds the budget ledger (default :func:`kibidango.paid.state.default_state_dir`);
        ``from_bundle``: the local tiers' settings, as :meth:`kibidango.Pipeline.from_bundle`."""
        pipe = Pipeline.from_bundle(bundle, **from_bundle)
        cascade = load_cascade(config, bundle=pipe.bundle)
        return cls(pipe, cascade, state_dir if state_dir is not None else default_state_dir())

    def answer(
        self,
        prompt: str,
        query: str | None = None,
        max_new_tokens: int | None = None,
        messages: list[dict[str, str]] | None = None,
        **kw,
    ) -> CascadeResult:
        """``prompt``: what the local model reads (a chat-formatted prompt, or plain text);
        ``query``: the user's question as the router and the validator see it (default: the
        prompt); ``messages``: the conversation the cloud answers (default: the query alone)."""
        return self.escalate(self.local(prompt, query, max_new_tokens, messages, **kw))

    def local(
        self,
        prompt: str | list[int],
        query: str | None = None,
        max_new_tokens: int | None = None,
        messages: list[dict[str, str]] | None = None,
        should_stop=None,
        **kw,
    ) -> Draft:
        """Route, decode locally (at most ``draft.max_tokens``), score, and decide the tier.
        ``kw``: decoding settings and ``stop`` strings for :meth:`Pipeline.generate`. The
        temperature defaults to the calibrator's (``decoding``: 2G's answers were greedy), not the
        bundle's sampling default: the confidence and 6C's thresholds hold for answers decoded the
        way they were measured, and a sampled answer scores lower and fails more often."""
        cfg = self.config
        calibrated = self.pipe.calibrator.decoding["temperature"] if self.pipe.calibrator is not None else None
        if calibrated is not None and kw.get("temperature") is None:
            kw["temperature"] = calibrated
        if query is None:
            query = prompt if isinstance(prompt, str) else self.pipe.tokenizer.decode(prompt)
        budget = min(max_new_tokens or self.pipe.defaults.max_new_tokens, cfg.draft_max_tokens)
        messages = messages or [{"role": "user", "content": query}]
        try:
            local = self.pipe.generate(prompt, query=query, max_new_tokens=budget, should_stop=should_stop, **kw)
        except ContextLengthError:
            if self.client is None:
                raise
            # The local tiers cannot read it: the cloud answers (flag ``local_context``).
            result = CascadeResult("", "local", None, None, 0.0, self._left(), ["local_context"])
            return Draft(result, "answer", query, messages)
        confidence = local.metrics.confidence
        conf = confidence if confidence is not None else 1.0  # no calibrator: nothing says it is unsure
        p_fail = self.detector.p_fail(query, conf) if self.detector is not None else None
        flagged = p_fail is not None and p_fail >= self.detector.threshold
        result = CascadeResult(local.text, "local", confidence, p_fail, 0.0, self._left(), local=local)
        if confidence is None:  # no calibrator, or one that gave no finite value on this answer
            result.flags.append("confidence_invalid" if local.metrics.confidence_error else "uncalibrated")
        elif kw.get("temperature") != calibrated:  # the caller's own sampling: the thresholds were not chosen on it
            result.flags.append("uncalibrated_decoding")
        action = None
        if local.metrics.finish_reason == "cancelled":
            result.flags.append("cancelled")
        elif self.client is not None and (conf < cfg.qualifier_threshold or flagged):
            action = "answer" if conf < cfg.cloud.fallback_threshold else "validate"
        return Draft(result, action, query, messages)

    def escalate(self, draft: Draft) -> CascadeResult:
        """The cloud's part, when the local phase asked for it: a correction check in the middle
        band, the cloud's own answer below the fallback threshold."""
        result, cfg = draft.result, self.config
        if draft.action is None:
            return result
        if draft.action == "answer":
            reply = self.client.chat(draft.messages)
            tier = "cloud"
        else:
            check = VALIDATION_PROMPT.format(question=draft.query, answer=result.text)
            reply = self.client.chat([{"role": "user", "content": check}], cfg.cloud.validation_max_tokens)
            tier = "validated" if reply.text is not None and _approves(reply.text) else "corrected"
        result.cloud, result.usd, result.budget_left_usd = reply, reply.usd, self._left()
        if reply.text is None:
            result.flags.append(reply.status)
            return result
        result.tier = tier
        if tier != "validated":
            result.text = reply.text
        return result

    def _left(self) -> float | None:
        return self.ledger.state().left_usd if self.ledger is not None else None


def _approves(text: str) -> bool:
    return text.strip().strip(".!\"' ").upper().startswith("APPROVE")
