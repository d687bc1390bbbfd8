"""Target-only, 2-model speculative and Pyramid speculative decoding over backend sessions.

Each session caches the tokens it has been fed. Before a model is used, it is synced to the
committed sequence: its cache is cropped to the longest prefix it shares with the committed
tokens, and the tokens it lacks are fed together with whatever it must score next, in one
forward pass. So a rejection costs only the rejected positions; no prefix is ever fed twice.

Modes (speculative sampling: Leviathan et al. 2023, arXiv 2211.17192; Pyramid SD: arXiv 2510.12966):
  ``ar``       the target alone.
  ``sd``       the draft proposes k tokens, the target scores them in one pass (lossless).
  ``lookup``   no draft model: prompt-lookup / n-gram drafting (Saxena 2023, HF's
               ``prompt_lookup_num_tokens``, llama.cpp's n-gram drafts). The longest suffix of the
               committed tokens (at most ``ngram`` tokens) that occurred earlier in the prompt or
               the output proposes the k tokens that followed its latest earlier occurrence; the
               target scores them in one pass, verified as a draft whose distribution is that one
               token (lossless: greedy gives the target's tokens). No match: one target step.
  ``pyramid``  the draft proposes l_D tokens, the qualifier verifies them in one pass, repeated
               until l_Q tokens are buffered; the target verifies the buffer in one pass.
               ``fuzzy``: a qualifier rejection ends the draft run and the buffer goes to the
               target; acceptance at each level also passes when Div <= tau_Q / tau_T.
               ``assisted``: at a qualifier rejection the qualifier's token joins the buffer and
               drafting goes on; fuzzy thresholds as above.
               ``exact``: as assisted with tau_Q = tau_T = 0: lossless at both levels, the
               output has the target's distribution (greedy: the target's tokens).

Adaptive speculation (sd, lookup, pyramid; lossless modes stay lossless, tested in distribution):
  ``p_min``     the draft ends its run before a token it gives less than ``p_min`` (llama.cpp's
                ``--draft-p-min``): an unsure draft stops wasting the target's positions. A token
                it does propose is verified against its distribution restricted to the tokens at
                or above ``p_min`` (what it was in effect drawn from), which keeps sampling exact.
                In pyramid an unsure draft also ends the buffering (the target judges what is there).
  ``lookup``    (sd, pyramid) n-gram lookup as a tier under the draft: where the committed text's
                suffix occurred before, the tokens that followed it are proposed (free, certain
                proposals, verified as in mode ``lookup``); the draft model runs only where no
                suffix matches. ``ngram_min``: the shortest suffix that counts (a one-token match
                proposes whatever followed the last token's latest occurrence, and is accepted far
                less often); ``lookup_k`` (sd): tokens the tier proposes per match, apart from the
                draft's ``k`` — its proposals cost nothing, while a verification costs nearly as
                much for 12 tokens as for 5 on a CPU, so it may propose more than the draft.
  ``ngram_table``  (sd, lookup, pyramid) the bundle's static n-gram table
                (:class:`kibidango.decode.ngrams.NgramTable`: the target's own outputs on other prompts,
                counted; llama.cpp's static lookup cache) proposes up to ``table_k`` tokens where
                the text's own n-grams (``lookup``) find nothing, before the draft model (sd,
                pyramid) or a plain target step (lookup); verified as certain proposals.
  ``adaptive``  the draft length (k; l_D in pyramid) follows the recent acceptance: +2 after a
                round whose drafts were all accepted, -1 after a rejection, within [1, k_max]
                (HF assisted generation's "heuristic" schedule), starting at k / l_D.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kibidango.backends.base import KV_CACHE_TYPES, ContextLengthError, Model, Session, sync_and_feed
from kibidango.decode.distributions import Sampler, verify
from kibidango.decode.ngrams import NgramTable

__all__ = [
    "DecodeConfig",
    "Decoder",
    "Metrics",
    "MODES",
    "REQUEST_SETTINGS",
    "RUNTIME_SETTINGS",
    "SETTINGS",
    "TIERS",
    "VARIANTS",
    "lookup_drafts",
]

MODES = ("ar", "sd", "pyramid", "lookup")
TIERS = {
    "ar": ("target",),
    "sd": ("draft", "target"),
    "pyramid": ("draft", "qualifier", "target"),
    "lookup": ("target",),
}
"""The tiers each mode runs on."""
VARIANTS = ("fuzzy", "assisted", "exact")


DIVERGENCES = ("tv", "js", "kl")


def setting(
    default: Any,
    doc: str,
    *,
    choices: tuple[str, ...] | None = None,
    request: bool = True,
    bench: str | None = None,
    **bounds: float,
):
    """A :class:`DecodeConfig` field declared once: its default, its doc (the CLI's help, the server's
    field description), its ``choices`` and the ``bounds`` a request may ask for (``ge``, ``le``,
    ``gt``, ``lt``: the server's request model and the CLI's flags are generated from them);
    ``request``: whether one request may set it (the mode, the token budget and the stop ids are
    set apart); ``bench``: its short name in ``kibidango bench --modes`` (``sd+k6+lookup``)."""
    meta = {"doc": doc, "choices": choices, "bounds": bounds, "request": request, "bench": bench}
    return field(default=default, metadata=meta)


@dataclass
class DecodeConfig:
    """The decoding settings: the one declaration the bundle's defaults, the CLI's flags
    (``kibidango.cli``), the server's request fields (``kibidango.server.schema``) and the tuner
    read (:func:`setting`)."""

    mode: str = setting("pyramid", "the decoding mode", choices=MODES, request=False)
    variant: str = setting(
        "fuzzy", "pyramid: fuzzy (thresholds), assisted or exact (lossless at both levels)", choices=VARIANTS
    )
    k: int = setting(4, "sd, lookup: tokens drafted per target pass", ge=1, le=32, bench="k")
    ngram: int = setting(3, "lookup: the longest suffix matched against earlier tokens", ge=1, le=16)
    ngram_min: int = setting(1, "lookup: the shortest suffix that counts as a match", ge=1, le=16, bench="nm")
    lookup_k: int = setting(
        0, "sd with lookup: tokens the n-gram tier proposes per match (0: the draft's k)", ge=0, le=32, bench="lk"
    )
    ngram_table: bool = setting(
        False,
        "sd, lookup, pyramid: the bundle's n-gram table (the target's own outputs, counted) proposes where the "
        "text's own n-grams do not",
        bench="table",
    )
    table_k: int = setting(6, "ngram_table: the most tokens the table proposes at once", ge=1, le=32, bench="tk")
    l_D: int = setting(4, "pyramid: tokens the draft proposes per qualifier pass", ge=1, le=32, bench="lD")
    l_Q: int = setting(8, "pyramid: tokens buffered per target pass", ge=1, le=64, bench="lQ")
    p_min: float = setting(
        0.0,
        "sd, pyramid: the draft stops before a token it gives less probability than this (0: never)",
        ge=0,
        le=1,
        bench="p",
    )
    adaptive: bool = setting(
        False,
        "sd, lookup, pyramid: the draft length adapts to the acceptance (+2 / -1, within [1, k_max])",
        bench="adaptive",
    )
    k_max: int = setting(16, "adaptive: the longest draft run", ge=1, le=32, bench="kmax")
    lookup: bool = setting(
        False,
        "sd, pyramid: n-gram lookup proposes first (free); the draft model only where it finds no match",
        bench="lookup",
    )
    tau_Q: float = setting(0.0, "pyramid fuzzy: the qualifier also accepts where Div <= tau_Q", ge=0, le=1)
    tau_T: float = setting(0.0, "pyramid fuzzy: the target also accepts where Div <= tau_T", ge=0, le=1)
    divergence: str = setting("tv", "pyramid fuzzy: the divergence tau_Q and tau_T bound", choices=DIVERGENCES)
    temperature: float = setting(0.0, "sampling temperature (0: greedy)", ge=0, le=2)
    top_p: float = setting(1.0, "nucleus sampling's probability mass", gt=0, le=1)
    seed: int | None = setting(0, "the sampler's seed", ge=0, lt=2**63)
    max_new_tokens: int = setting(64, "tokens generated at most", request=False)
    stop_ids: tuple[int, ...] = setting((), "token ids that end the output", request=False)

    def __post_init__(self) -> None:
        if not isinstance(self.stop_ids, tuple):  # JSON and YAML give a list, callers any iterable
            self.stop_ids = tuple(self.stop_ids)
        for name in ("k", "ngram", "ngram_min", "lookup_k", "table_k", "l_D", "l_Q", "k_max", "max_new_tokens", "seed"):
            value = getattr(self, name)
            if (value is not None or name != "seed") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name}: {value!r} is not a whole number")
        for name in ("adaptive", "lookup", "ngram_table"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: {getattr(self, name)!r} is not true or false")
        for name in ("tau_Q", "tau_T", "p_min", "temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name}: {value!r} is not a finite number")
        for name in ("mode", "variant", "divergence"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: {getattr(self, name)!r} is not a string")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_ids):
            raise ValueError(f"stop_ids: {list(self.stop_ids)!r} are not all token ids")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant {self.variant!r}: use one of {', '.join(VARIANTS)}")
        for name in ("k", "ngram", "ngram_min", "table_k", "l_D", "l_Q", "k_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.ngram_min > self.ngram:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram ({self.ngram})")
        if self.lookup_k < 0:
            raise ValueError("lookup_k must be >= 0 (0: the draft's k)")
        if not 0 <= self.p_min <= 1:
            raise ValueError(f"p_min ({self.p_min}) must be in [0, 1]")
        if self.l_D > self.l_Q:
            raise ValueError(f"l_D ({self.l_D}) must not exceed l_Q ({self.l_Q})")
        if self.tau_Q < 0 or self.tau_T < 0:
            raise ValueError("tau_Q and tau_T must be >= 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any], where: str, base: DecodeConfig | None = None) -> DecodeConfig:
        """``base`` (default: the defaults) with ``settings`` over it: the one reader of decoding
        settings written down (bundle.json's ``runtime_defaults`` and ``tuned_defaults``, stage X's
        recipe). A key that is not a setting is refused, not dropped: the error names ``where``,
        the key and the setting it is nearest to. Runtime settings that are not decoding ones
        (:data:`RUNTIME_SETTINGS`) are allowed and left to their readers."""
        fields = list(SETTINGS)
        unknown = [k for k in settings if k not in fields and k not in RUNTIME_SETTINGS]
        if unknown:
            key = unknown[0]
            near = difflib.get_close_matches(str(key), [*fields, *RUNTIME_SETTINGS], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; settings: {', '.join(fields)}"
            raise ValueError(f"{where}: {key!r} is not a decoding setting{hint}")
        values = {k: v for k, v in settings.items() if k in fields}
        kv = settings.get("kv_cache")
        if kv is not None and kv not in KV_CACHE_TYPES:
            raise ValueError(f"{where}: kv_cache {kv!r}: use one of {', '.join(KV_CACHE_TYPES)}")
        try:
            return dataclasses.replace(base or cls(), **values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None


SETTINGS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(DecodeConfig)}
"""Each decoding setting's field (its ``metadata``: doc, choices, request bounds, bench name), by name:
what the CLI's flags, the server's request model and the bench's mode language are generated from."""
REQUEST_SETTINGS = tuple(name for name, f in SETTINGS.items() if f.metadata["request"])
"""The :class:`DecodeConfig` fields one request may set (the CLI's decoding options, the server's
request fields); the mode, the token budget and stop ids are set apart."""
RUNTIME_SETTINGS = frozenset({"kv_cache"})
"""Runtime defaults a bundle may carry besides :class:`DecodeConfig`'s fields."""


class RowSink(Protocol):
    """What takes each committed token and the target's logits row that chose it, in every mode
    (the row is a view of the forward's logits: read it now, keep none of it)."""

    def add(self, row: np.ndarray, token: int) -> None: ...


@dataclass
class Metrics:
    """Per request, named like vLLM's speculative-decoding metrics. Stage ``draft`` is the
    draft's proposals to its verifier (the target in sd, the qualifier in pyramid); stage
    ``qualifier`` is the qualifier's buffer offered to the target (pyramid); stages ``lookup`` and
    ``table`` are the n-gram tiers' proposals to the target (the text's own n-grams, the bundle's
    table; in pyramid they count as ``draft``)."""

    mode: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    num_rejections: dict[str, int] = field(default_factory=dict)
    verify_steps: int = 0
    forward_calls: dict[str, int] = field(default_factory=dict)
    tokens_fed: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    finish_reason: str = "length"
    # Set by the pipeline around the decoding (None where the bundle ships no router/calibrator):
    domain: str | None = None
    """What the router (6A) chose for the request (``base``: no domain adapter)."""
    router_confidence: float | None = None
    adapter: str | None = None
    """The domain adapter the target ran with (None: the base weights)."""
    confidence: float | None = None
    """Calibrated P(the answer passes its judge) (2G)."""
    confidence_error: str | None = None
    """Why ``confidence`` is None although the bundle has a calibrator (it gave no finite value)."""
    answer_stats: RowSink | None = field(default=None, repr=False)
    """Where the pipeline or its caller asks (:class:`kibidango.addons.confidence.AnswerStats`),
    what receives each committed token with the target's logits that chose it (every mode: the
    target verifies every token it commits): an answer's features without a second forward pass
    over prompt and answer, no row kept (not reported). A round may commit past a stop token: the
    sink then holds rows beyond the answer, which its reader cuts to the answer's length."""

    def count(self, stage: str, drafted: int, accepted: int) -> None:
        self.num_draft_tokens[stage] = self.num_draft_tokens.get(stage, 0) + drafted
        self.num_accepted_tokens[stage] = self.num_accepted_tokens.get(stage, 0) + accepted
        self.num_rejections[stage] = self.num_rejections.get(stage, 0) + (accepted < drafted)

    def add(self, other: Metrics) -> None:
        """Accumulate another request's counts (for aggregates across requests)."""
        self.prompt_tokens += other.prompt_tokens
        self.generated_tokens += other.generated_tokens
        self.verify_steps += other.verify_steps
        self.seconds += other.seconds
        for mine, theirs in (
            (self.num_draft_tokens, other.num_draft_tokens),
            (self.num_accepted_tokens, other.num_accepted_tokens),
            (self.num_rejections, other.num_rejections),
            (self.forward_calls, other.forward_calls),
            (self.tokens_fed, other.tokens_fed),
        ):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0) + value

    def acceptance_rate(self, stage: str) -> float | None:
        drafted = self.num_draft_tokens.get(stage, 0)
        return self.num_accepted_tokens.get(stage, 0) / drafted if drafted else None

    def token_acceptance_probability(self, stage: str) -> float | None:
        """Maximum-likelihood estimate of alpha, the chance that one proposed token is accepted,
        assuming i.i.d. acceptances (the model behind Leviathan et al.'s speedup formula):
        accepted / (accepted + rejections). Differs from the acceptance rate, which counts the
        tokens drafted after the first rejection of a round as not accepted."""
        accepted = self.num_accepted_tokens.get(stage, 0)
        trials = accepted + self.num_rejections.get(stage, 0)
        return accepted / trials if trials else None

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per target verification step, the bonus or correction token included."""
        return self.generated_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def target_forwards_per_token(self) -> float:
        return self.forward_calls.get("target", 0) / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "num_draft_tokens": dict(self.num_draft_tokens),
            "num_accepted_tokens": dict(self.num_accepted_tokens),
            "draft_acceptance_rate": {s: self.acceptance_rate(s) for s in self.num_draft_tokens},
            "token_acceptance_probability": {s: self.token_acceptance_probability(s) for s in self.num_draft_tokens},
            "mean_acceptance_length": self.mean_acceptance_length,
            "target_forward_passes": self.forward_calls.get("target", 0),
            "target_forwards_per_token": self.target_forwards_per_token,
            "forward_calls": dict(self.forward_calls),
            "tokens_fed": dict(self.tokens_fed),
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "finish_reason": self.finish_reason,
            "domain": self.domain,
            "router_confidence": self.router_confidence,
            "adapter": self.adapter,
            "confidence": self.confidence,
            **({"confidence_error": self.confidence_error} if self.confidence_error else {}),
        }


def lookup_drafts(tokens: list[int], k: int, ngram: int, ngram_min: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (``ngram`` tokens at most, ``ngram_min`` at least); [] when no such suffix occurred
    before."""
    size = len(tokens)
    for n in range(min(ngram, size - 1), ngram_min - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest first; the suffix itself excluded
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class _DraftLength:
    """How many tokens the draft proposes this round: ``start`` fixed, or (``adaptive``) moved by
    each round's outcome within [1, k_max]."""

    def __init__(self, start: int, cfg: DecodeConfig):
        self.adaptive, self.k_max = cfg.adaptive, max(cfg.k_max, 1)
        self.now = min(start, self.k_max) if cfg.adaptive else start

    def update(self, drafted: int, accepted: int) -> None:
        if self.adaptive and drafted:
            self.now = min(self.now + 2, self.k_max) if accepted == drafted else max(self.now - 1, 1)


class Decoder:
    """Runs one request at a time over the given models (``target``, and ``draft`` /
    ``qualifier`` as the mode needs), keeping a KV-cache session per model between rounds."""

    def __init__(self, models: dict[str, Model], ngram_table: NgramTable | None = None):
        """``ngram_table``: the bundle's static n-gram table (what ``ngram_table=True`` reads)."""
        self.models = models
        self.ngram_table = ngram_table

    def table_missing(self, cfg: DecodeConfig) -> str | None:
        """Why ``cfg`` cannot run here (it reads the n-gram table and there is none), else None.
        ``ar`` never reads the table, so it runs with the setting on."""
        if cfg.ngram_table and cfg.mode != "ar" and self.ngram_table is None:
            return "ngram_table is set, but the bundle ships no n-gram table (ngrams/)"
        return None

    def generate(self, prompt_ids: list[int], cfg: DecodeConfig, metrics: Metrics | None = None) -> Iterator[list[int]]:
        """Yield the newly committed tokens of each round; fill ``metrics`` as it goes."""
        tiers = TIERS[cfg.mode]
        missing = [t for t in tiers if t not in self.models]
        if missing:
            raise ValueError(f"mode {cfg.mode} needs the {', '.join(missing)} tier(s), which are not loaded")
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens)")
        if why := self.table_missing(cfg):
            raise ValueError(why)
        context = min(self.models[t].context_length for t in tiers)
        if len(prompt_ids) >= context:
            raise ContextLengthError(f"the prompt has {len(prompt_ids)} tokens; the context holds {context}")
        budget = min(cfg.max_new_tokens, context - len(prompt_ids))
        metrics = metrics if metrics is not None else Metrics(cfg.mode)
        metrics.prompt_tokens = len(prompt_ids)
        sessions = {t: self.models[t].new_session() for t in tiers}
        sampler = Sampler(cfg.temperature, cfg.top_p)
        rng = np.random.default_rng(cfg.seed)
        step = {
            "ar": self._ar_round,
            "sd": self._sd_round,
            "pyramid": self._pyramid_round,
            "lookup": self._lookup_round,
        }[cfg.mode]
        committed = list(prompt_ids)
        generated = 0
        length = _DraftLength(cfg.l_D if cfg.mode == "pyramid" else cfg.k, cfg)
        start = time.perf_counter()
        try:
            while generated < budget:
                new = step(sessions, committed, budget - generated, cfg, sampler, rng, metrics, length)
                metrics.verify_steps += 1
                stop_at = next((i for i, t in enumerate(new) if t in cfg.stop_ids), None)
                if stop_at is not None:
                    new = new[:stop_at]
                    metrics.finish_reason = "stop"
                committed += new
                generated += len(new)
                metrics.generated_tokens = generated
                if new:
                    yield new
                if stop_at is not None:
                    return
        finally:
            metrics.seconds = time.perf_counter() - start
            for t, s in sessions.items():
                metrics.forward_calls[t] = s.forward_calls
                metrics.tokens_fed[t] = s.tokens_fed

    # ---- one round per mode: returns the tokens it commits --------------------------------

    def _ar_round(self, sessions, committed, remaining, cfg, sampler, rng, metrics, length=None) -> list[int]:
        row = sync_and_feed(sessions["target"], committed, [])[0]
        token = sampler.draw(sampler.probs(row), rng)
        if metrics.answer_stats is not None:
            metrics.answer_stats.add(row, token)
        return [token]

    def _propose(
        self, session: Session, committed: list[int], n: int, sampler, rng, p_min: float = 0.0
    ) -> tuple[list[int], list[np.ndarray]]:
        """The draft's tokens, each from its distribution after the previous one: ``n``, fewer
        where it gives the token it drew less than ``p_min``. A proposal made under that rule was
        drawn from the draft's distribution *restricted to the tokens at or above p_min*, and that
        is the distribution returned for verification: with it the rule is exact (the stop is a
        target step, the rest the Leviathan rule for that proposal), with the draft's own it was
        not (it over-proposed the draft's sure tokens)."""
        tokens: list[int] = []
        dists: list[np.ndarray] = []
        row = sync_and_feed(session, committed, [])[0]
        for i in range(n):
            q = sampler.probs(row)
            token = sampler.draw(q, rng)
            if q[token] < p_min:
                break
            if p_min > 0:
                q = np.where(q >= p_min, q, 0.0)
                q /= q.sum()
            tokens.append(token)
            dists.append(q)
            if i + 1 < n:
                row = session.feed([token])[0]
        return tokens, dists

    def _free_proposals(self, tokens: list[int], cfg: DecodeConfig, lookup: bool, n: int, room: int):
        """Proposals that cost no model: the text's own n-grams (``lookup``: up to ``n`` tokens),
        else the bundle's n-gram table (``cfg.ngram_table``: up to ``table_k``), never more than
        ``room``. Returns (tokens, the tier that proposed them), ([], "") when neither has any."""
        if lookup:
            found = lookup_drafts(tokens, min(n, room), cfg.ngram, cfg.ngram_min)
            if found:
                return found, "lookup"
        if cfg.ngram_table:
            found = self.ngram_table.propose(tokens, min(cfg.table_k, room))
            if found:
                return found, "table"
        return [], ""

    def _sd_round(self, sessions, committed, remaining, cfg, sampler, rng, metrics, length) -> list[int]:
        k = min(length.now, remaining - 1)  # room for the bonus token
        if k >= 1:
            found, tier = self._free_proposals(committed, cfg, cfg.lookup, cfg.lookup_k or k, remaining - 1)
            if found:  # free proposals: the draft model is not run this round
                out = self._target_verifies(sessions, committed, found, None, sampler, rng, metrics, tier)
                if tier == "lookup" and not cfg.lookup_k:  # proposed the draft's length: moves it too
                    length.update(len(found), len(out) - 1)
                return out
        drafts, q = self._propose(sessions["draft"], committed, k, sampler, rng, cfg.p_min) if k >= 1 else ([], [])
        if not drafts:
            return self._ar_round(sessions, committed, remaining, cfg, sampler, rng, metrics)
        out = self._target_verifies(sessions, committed, drafts, q, sampler, rng, metrics, "draft")
        length.update(len(drafts), len(out) - 1)
        return out

    def _target_verifies(self, sessions, committed, drafts, q, sampler, rng, metrics, stage: str) -> list[int]:
        """The target scores ``drafts`` (drawn from ``q``; None: certain proposals, each its one
        token) in one pass: the accepted ones, then its correction or bonus token."""
        rows = sync_and_feed(sessions["target"], committed, drafts)
        if q is None:  # certain proposals: verify's one-hot (a whole matrix was 393 KB a token for 49K)
            q = [None] * len(drafts)
        n, token = self._target_commits(rows, drafts, q, sampler, rng, metrics)
        metrics.count(stage, len(drafts), n)
        return drafts[:n] + [token]

    @staticmethod
    def _target_commits(rows, proposed, q, sampler, rng, metrics, **rule) -> tuple[int, int]:
        """:func:`verify` of ``proposed`` against the target's ``rows`` (one per proposal, then the
        bonus row), each row's distribution made as the rule reaches it (float64 of the vocabulary's
        size, one at a time), the bonus's only when every proposal passed; the committed tokens and
        the rows that chose them go to ``metrics.answer_stats`` (as in ``ar``: the calibrated
        confidence needs no second pass over prompt and answer)."""
        n, token = verify(proposed, q, (sampler.probs(r) for r in rows[: len(proposed)]), sampler, rng, **rule)
        if n == len(proposed):
            token = sampler.draw(sampler.probs(rows[n]), rng)
        if metrics.answer_stats is not None:
            for row, committed in zip(rows, [*proposed[:n], token]):
                metrics.answer_stats.add(row, committed)
        return n, token

    def _lookup_round(self, sessions, committed, remaining, cfg, sampler, rng, metrics, length) -> list[int]:
        k = min(length.now, remaining - 1)  # room for the bonus token
        drafts, tier = self._free_proposals(committed, cfg, True, k, remaining - 1) if k >= 1 else ([], "")
        if not drafts:
            return self._ar_round(sessions, committed, remaining, cfg, sampler, rng, metrics)
        out = self._target_verifies(sessions, committed, drafts, None, sampler, rng, metrics, tier)
        if tier == "lookup":
            length.update(len(drafts), len(out) - 1)
        return out

    def _pyramid_round(self, sessions, committed, remaining, cfg, sampler, rng, metrics, length) -> list[int]:
        l_q = min(cfg.l_Q, remaining - 1)
        if l_q < 1:
            return self._ar_round(sessions, committed, remaining, cfg, sampler, rng, metrics)
        tau_q, tau_t = (0.0, 0.0) if cfg.variant == "exact" else (cfg.tau_Q, cfg.tau_T)
        buffer: list[int] = []
        buffer_q: list[np.ndarray] = []  # the qualifier's distribution at each buffered position
        while len(buffer) < l_q:
            n_draft = min(length.now, l_q - len(buffer))
            found, _ = self._free_proposals(committed + buffer, cfg, cfg.lookup, n_draft, l_q - len(buffer))
            if found:  # free, certain proposals for the qualifier to verify (verify's one-hot)
                drafts, d = found, [None] * len(found)
            else:
                drafts, d = self._propose(sessions["draft"], committed + buffer, n_draft, sampler, rng, cfg.p_min)
            if not drafts:
                break  # the draft is unsure of its next token: the target judges what is buffered
            rows = sync_and_feed(sessions["qualifier"], committed + buffer, drafts)
            q = [sampler.probs(r) for r in rows[: len(drafts)]]
            n, token = verify(drafts, d, q, sampler, rng, tau=tau_q, div=cfg.divergence)
            metrics.count("draft", len(drafts), n)
            length.update(len(drafts), n)
            buffer += drafts[:n]
            buffer_q += q[:n]
            if n < len(drafts):
                if cfg.variant == "fuzzy":
                    break  # the draft run ends here; the target judges what is buffered
                buffer.append(token)  # assisted / exact: the qualifier's token, then draft on
                buffer_q.append(q[n])
            elif len(drafts) < n_draft:
                break  # stopped short by p_min: as unsure as above
        if not buffer:
            return self._ar_round(sessions, committed, remaining, cfg, sampler, rng, metrics)
        rows = sync_and_feed(sessions["target"], committed, buffer)
        n, token = self._target_commits(rows, buffer, buffer_q, sampler, rng, metrics, tau=tau_t, div=cfg.divergence)
        metrics.count("qualifier", len(buffer), n)
        return buffer[:n] + [token]
