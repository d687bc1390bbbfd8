"""How much of a model a quantized GGUF keeps: the fidelity table stage 2D chooses the shipped
type from.

Every row is one GGUF of the tier (a llama.cpp type, with or without an importance matrix, the
token embedding at its own type) measured against the **reference**, the uncompressed model (its
F16 GGUF), on the same held-out tokens and tasks:

- ``ppl_ratio``: perplexity of the row over the reference's on the response tokens of held-out
  rows (1.0: nothing lost);
- ``kl``: mean over those tokens of KL(reference || row) of the next-token distributions, in nats
  (llama.cpp's ``llama-perplexity --kl-divergence`` measures the same quantity);
- ``ladder``: held-out ladder tasks passed (greedy, each by its domain's judge), beside the reference's,
  in all and per domain (:func:`ladder_by_domain`: a math loss is not hidden by a code gain);
- ``agreement``: greedy-token agreement with the reference's transformers model along its greedy
  paths (2D's gate);
- ``tokens_per_s``: llama.cpp greedy decoding, every row timed in the same rounds, in turn
  (:mod:`methods.measure.speed`).

:class:`Rule` is the rule a recipe states: of the rows whose perplexity ratio, ladder and agreement
are within the recipe's bounds (and size, where it caps one), the smallest file or the fastest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from methods.training.chat import encode, messages, prompt_ids, prompt_text

__all__ = [
    "Divergence",
    "FidelityRow",
    "Pass",
    "ReferenceRows",
    "Rule",
    "divergence",
    "fidelity_pass",
    "ladder_answers",
    "ladder_pass",
    "table",
]


def _centred(logits) -> tuple[np.ndarray, np.ndarray]:
    """Logits less their row maximum (in their own float type: llama.cpp's float32 stays float32,
    half the bytes of float64 over a 49K vocabulary), and the log of each row's normaliser in float64."""
    x = np.asarray(logits)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    z = x - x.max(-1, keepdims=True)
    return z, np.log(np.exp(z).sum(-1, dtype=np.float64))


@dataclass(frozen=True)
class ReferenceRows:
    """What every row's divergence needs of the reference's next-token distributions p at the
    scored positions, computed once a held-out row: p, log p of the true tokens, sum_v p log p and
    sum_v p (1 up to rounding)."""

    p: np.ndarray
    log_p_target: np.ndarray
    neg_entropy: np.ndarray
    mass: np.ndarray

    @classmethod
    def of(cls, logits, targets: Sequence[int]) -> ReferenceRows:
        z, log_norm = _centred(logits)
        log_p = z - log_norm[:, None].astype(z.dtype)
        p = np.exp(log_p)
        at = np.arange(len(targets)), np.asarray(targets, dtype=np.int64)
        return cls(
            p,
            log_p[at].astype(np.float64),
            (p * log_p).sum(-1, dtype=np.float64),
            p.sum(-1, dtype=np.float64),
        )


@dataclass
class Divergence:
    """Running sums over scored tokens: negative log-likelihood of the true next token under the
    reference and under the row, and KL(reference || row)."""

    nll_reference: float = 0.0
    nll: float = 0.0
    kl: float = 0.0
    tokens: int = 0

    def add(self, reference_logits: np.ndarray, logits: np.ndarray, targets: Sequence[int]) -> None:
        """Score positions whose logits predict ``targets`` (one row of logits per target)."""
        if len(targets):
            self.add_reference(ReferenceRows.of(reference_logits, targets), logits, targets)

    def add_reference(self, ref: ReferenceRows, logits: np.ndarray, targets: Sequence[int]) -> None:
        """:meth:`add` with the reference's side computed already (once for every row). With z the
        row's logits less their maximum and log q = z - log sum exp z:
        KL = sum p log p - sum p z + log(sum exp z) * sum p, one product over the vocabulary."""
        if len(targets) == 0:
            return
        z, log_norm = _centred(logits)
        at = np.arange(len(targets)), np.asarray(targets, dtype=np.int64)
        self.nll -= float((z[at].astype(np.float64) - log_norm).sum())
        cross = np.multiply(ref.p, z, out=z).sum(-1, dtype=np.float64)  # z is this call's own array
        self.nll_reference -= float(ref.log_p_target.sum())
        self.kl += float((ref.neg_entropy - cross + log_norm * ref.mass).sum())
        self.tokens += len(targets)

    @property
    def ppl_reference(self) -> float:
        return float(np.exp(self.nll_reference / max(self.tokens, 1)))

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll / max(self.tokens, 1)))

    @property
    def ppl_ratio(self) -> float:
        """Perplexity over the reference's: exp of the mean log-likelihood difference."""
        return float(np.exp((self.nll - self.nll_reference) / max(self.tokens, 1)))

    @property
    def mean_kl(self) -> float:
        return self.kl / max(self.tokens, 1)


def divergence(
    reference, models: dict[str, object], tokenizer, rows: list[dict], max_len: int
) -> dict[str, Divergence]:
    """:class:`Divergence` of each of ``models`` (runtime models: ``new_session().feed(ids)``
    returns a logits row per token) against ``reference`` on the response tokens of ``rows``,
    each row's reference logits computed once."""
    return fidelity_pass(reference, models, tokenizer, rows, max_len).divergence


@dataclass
class Pass:
    """What one pass over the held-out rows measured: each model's :class:`Divergence`, and each
    model's (and the reference's, under ``None``) greedy choice at each position of the paths it was
    given (the argmax of the row that predicts the path's token there)."""

    divergence: dict[str, Divergence]
    along: dict[str | None, dict[int, np.ndarray]]


def fidelity_pass(
    reference,
    models: dict[str, object],
    tokenizer,
    rows: list[dict],
    max_len: int,
    paths: dict[int, tuple[int, list[int]]] | None = None,
) -> Pass:
    """:func:`divergence`, and with ``paths`` ({row index: (cut, path)}: a continuation of the row's
    first ``cut`` tokens, a prompt of :func:`methods.measure.lm.held_out_prompts`) each model's
    greedy choice where it predicts each of the path's tokens, teacher-forced (token agreement,
    :func:`methods.compression.gguf.agreement_report`). A path continues the same session after a
    crop back to ``cut``: its prompt is not computed a second time (each model reads the prompts of
    both measurements once; they were ~60% of the agreement's llama.cpp tokens)."""
    paths = paths or {}
    out = Pass({name: Divergence() for name in models}, {name: {} for name in [None, *models]})
    for k, r in enumerate(rows):
        ids, start = encode(tokenizer, messages(r), max_len)
        if len(ids) <= max(start, 1):
            if k in paths:
                raise ValueError(f"row {k}: a path continues a row with no response tokens")
            continue
        start = max(start, 1)
        targets = ids[start:]
        ref = None
        for name, model in [(None, reference), *models.items()]:
            session = model.new_session()
            fed = session.feed(ids, first=start - 1)
            if name is None:
                ref = ReferenceRows.of(fed[:-1], targets)
            else:
                out.divergence[name].add_reference(ref, fed[:-1], targets)
            if k in paths:
                out.along[name][k] = _along(session, fed, start, ids, *paths[k]).argmax(-1)
    return out


def _along(session, fed: np.ndarray, start: int, ids: list[int], cut: int, path: list[int]) -> np.ndarray:
    """The rows predicting ``path`` after ``ids[:cut]``: the first is ``fed``'s (the rows of
    ``ids[start - 1:]``), the rest from ``session`` cropped back to ``cut``."""
    if not start <= cut <= len(ids):
        raise ValueError(f"a path's prompt ({cut} tokens) must end within the row's response ({start}..{len(ids)})")
    first = fed[cut - start : cut - start + 1]
    if len(path) <= 1:
        return first
    session.crop(cut)
    return np.vstack([first, session.feed(list(path[:-1]))])


def ladder_pass(model, tokenizer, rows: list[dict], max_new_tokens: int, parallel: int = 1) -> list[bool]:
    """Greedy answers of ``model`` (a runtime model) to ladder ``rows`` (:func:`ladder_answers`),
    each judged by its domain's judge (a row's ``domain``: ``math``, the default, or ``code``, run
    in the code judge's sandbox)."""
    from methods.judges import make_judge

    judges: dict[str, object] = {}
    answers = ladder_answers(model, tokenizer, rows, max_new_tokens, parallel)
    verdicts = []
    for row, text in zip(rows, answers, strict=True):
        domain = row.get("domain", "math")
        if domain not in judges:  # one judge a domain (the code judge checks its sandbox once)
            judges[domain] = make_judge(domain)
        verdicts.append(judges[domain](row["task"], text).passed)
    return verdicts


def ladder_answers(model, tokenizer, rows: list[dict], max_new_tokens: int, parallel: int = 1) -> list[str]:
    """Greedy answers of ``model`` (a runtime model) to ``rows`` in the model's chat template (as
    :class:`methods.measure.generate.Answerer` prompts); "" where the prompt fills the context.
    ``parallel``: answers decoded together (the runtime's batching: greedy, the same tokens up to
    rounding at a near-tie; every row of a table is answered alike)."""
    from concurrent.futures import ThreadPoolExecutor

    from kibidango import DecodeConfig, Pipeline
    from kibidango.decode.batching import Batcher

    stop = tuple(i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id) if i is not None)
    config = DecodeConfig(mode="ar", temperature=0.0, max_new_tokens=max_new_tokens, stop_ids=stop)
    backend = "llamacpp" if hasattr(model, "llm") else "torch"
    pipeline = Pipeline(tokenizer, {"target": model}, config, backend=backend)
    batcher = Batcher(pipeline, min(parallel, len(rows))) if parallel > 1 and len(rows) > 1 else None

    def answer(row: dict) -> str:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt_text(row["instruction"], row["input"])}])
        room = min(max_new_tokens, model.context_length - len(ids))
        if room <= 0:
            return ""
        with batcher.turn() if batcher is not None else contextlib.nullcontext():
            return pipeline.generate(ids, max_new_tokens=room).text

    if batcher is None:
        return [answer(row) for row in rows]
    try:
        with ThreadPoolExecutor(batcher.slots, thread_name_prefix="ladder") as pool:
            return list(pool.map(answer, rows))
    finally:
        batcher.close()


@dataclass
class FidelityRow:
    name: str
    source: str
    quant: str
    imatrix: bool
    embedding: str | None
    bytes: int
    bits_per_weight: float
    ppl: float
    ppl_ratio: float
    kl: float
    ladder_passed: int
    ladder_tasks: int
    agreement: float | None
    tokens_per_s: float
    tokens: int
    """Held-out tokens the perplexity and KL are measured on."""
    reference: bool = False
    chosen: bool = False
    why_not: list[str] = field(default_factory=list)
    passed_over: str = ""
    """Within every bound, not chosen: why (the rule preferred a smaller or a faster row)."""
    agreement_interval: tuple[float, float] | None = None
    """95% bootstrap interval of ``agreement`` over its prompts."""
    ladder: list[bool] = field(default_factory=list)
    """The ladder verdicts, task by task in the reference's order (the paired test reads them)."""
    ladder_domains: list[str] = field(default_factory=list)
    """Each ladder task's domain, in the same order (empty: one domain)."""

    @classmethod
    def measured(
        cls,
        name: str,
        source: str,
        quant: str,
        size: int,
        weights: int,
        div: Divergence,
        ladder: list[bool],
        tokens_per_s: float,
        agreement: float | None = None,
        imatrix: bool = False,
        embedding: str | None = None,
        agreement_interval: tuple[float, float] | None = None,
        ladder_domains: list[str] | None = None,
    ) -> FidelityRow:
        """A candidate's row: ``size`` bytes over ``weights`` parameters, ``div`` against the
        reference, its ladder verdicts (and each task's domain)."""
        if ladder_domains and len(ladder_domains) != len(ladder):
            raise ValueError(f"{name}: {len(ladder)} ladder verdicts but {len(ladder_domains)} domains")
        return cls(
            name,
            source,
            quant,
            imatrix,
            embedding,
            size,
            8 * size / weights,
            div.ppl,
            div.ppl_ratio,
            div.mean_kl,
            sum(ladder),
            len(ladder),
            agreement,
            tokens_per_s,
            div.tokens,
            agreement_interval=agreement_interval,
            ladder=list(ladder),
            ladder_domains=list(ladder_domains or []),
        )

    @classmethod
    def reference_of(
        cls,
        name: str,
        source: str,
        size: int,
        weights: int,
        div: Divergence,
        ladder: list[bool],
        tokens_per_s: float,
        agreement: float | None = None,
        agreement_interval: tuple[float, float] | None = None,
        ladder_domains: list[str] | None = None,
    ) -> FidelityRow:
        """The reference's own row (F16), its perplexity read off any candidate's ``div``; its agreement
        with its own transformers model, where measured, is what a faithful export reaches."""
        row = cls.measured(
            name, source, "F16", size, weights, div, ladder, tokens_per_s, agreement, ladder_domains=ladder_domains
        )
        return replace(
            row, ppl=div.ppl_reference, ppl_ratio=1.0, kl=0.0, reference=True, agreement_interval=agreement_interval
        )

    def as_dict(self) -> dict:
        return asdict(self)


def ladder_versus(ref: FidelityRow, row: FidelityRow) -> tuple[int, int, float]:
    """Tasks the reference passed and ``row`` failed (lost), the reverse (won), and the one-sided exact
    McNemar p-value that ``row`` passes fewer (binomial test of lost among the discordant; 1.0 when none)."""
    from methods.evaluation import mcnemar

    if len(ref.ladder) != len(row.ladder):
        raise ValueError(f"{row.name}: {len(row.ladder)} ladder verdicts, the reference has {len(ref.ladder)}")
    test = mcnemar(dict(enumerate(ref.ladder)), dict(enumerate(row.ladder)), alternative="greater")
    return test["a_only"], test["b_only"], test["p"]


def ladder_by_domain(ref: FidelityRow, row: FidelityRow) -> list[tuple[str, int, int, int, int, float]]:
    """Per domain of a ladder with more than one (none otherwise): ``(domain, passed, tasks, lost, won,
    p)`` of ``row`` against the reference, as :func:`ladder_versus` on that domain's tasks alone: a loss
    in one domain is not hidden by a gain in another."""
    from methods.evaluation import mcnemar

    domains = ref.ladder_domains
    if len(set(domains)) < 2:
        return []
    if len(ref.ladder) != len(row.ladder) or len(domains) != len(ref.ladder):
        raise ValueError(f"{row.name}: {len(row.ladder)} ladder verdicts, the reference has {len(ref.ladder)}")
    out = []
    for domain in dict.fromkeys(domains):
        at = [i for i, d in enumerate(domains) if d == domain]
        test = mcnemar({i: ref.ladder[i] for i in at}, {i: row.ladder[i] for i in at}, alternative="greater")
        out.append((domain, sum(row.ladder[i] for i in at), len(at), test["a_only"], test["b_only"], test["p"]))
    return out


def agreement_below(agreement: float, interval: tuple[float, float] | None, bound: float) -> bool:
    """Whether a token agreement is shown below ``bound``: the upper end of its 95% interval over
    prompts under it (the figure itself where no interval was measured). The table's :class:`Rule` and
    stage 2D's gate both read it, so a row the rule ships never fails the gate."""
    return (interval[1] if interval is not None else agreement) < bound


@dataclass(frozen=True)
class Rule:
    """The rule a recipe states for choosing from a fidelity table: of the rows with perplexity ratio <=
    ``max_ppl_ratio``, agreement not shown below ``min_agreement`` (the upper end of its 95% interval
    over prompts >= it, or the figure itself where no interval was measured: like the ladder's test, a
    bound on a noisy measure refuses a row on evidence, not on a point estimate a rerun moves), at most
    ``max_ladder_drop`` fewer ladder tasks passed than the reference (None: no such bound), not fewer by
    a one-sided exact McNemar test at p < ``ladder_alpha`` (None: no test) and at most ``max_bytes``
    (None: any size), the smallest file (``prefer="smallest"``) or the one that decodes the most tokens/s
    (``"fastest"``). When no row within ``max_bytes`` keeps the other bounds, ``over_size="smallest"``
    takes the smallest row that does (its verdict says by how much it is over); ``"fallback"`` takes
    none. ``str(rule)`` is the sentence the stage's card prints, from the same fields :meth:`choose`
    checks."""

    max_ppl_ratio: float
    min_agreement: float
    max_ladder_drop: int | None = None
    ladder_alpha: float | None = None
    max_bytes: int | None = None
    prefer: str = "smallest"
    over_size: str = "fallback"

    def __post_init__(self) -> None:
        if self.prefer not in ("smallest", "fastest"):
            raise ValueError(f"prefer must be 'smallest' or 'fastest', not {self.prefer!r}")
        if self.over_size not in ("smallest", "fallback"):
            raise ValueError(f"over_size must be 'smallest' or 'fallback', not {self.over_size!r}")

    def __str__(self) -> str:
        bounds = [f"perplexity ratio <= {self.max_ppl_ratio}"]
        if self.max_ladder_drop is not None:
            bounds.append(f"at most {self.max_ladder_drop} ladder task(s) fewer than the reference")
        if self.ladder_alpha is not None:
            bounds.append(
                "a ladder not worse than the reference's, in all and in each domain "
                f"(one-sided exact McNemar, p < {self.ladder_alpha})"
            )
        bounds.append(f"agreement not below {self.min_agreement:.0%} (its 95% interval's upper end)")
        if self.max_bytes is not None:
            bounds.append(f"at most {self.max_bytes / 1e6:.1f} MB")
        said = f"{'the smallest file' if self.prefer == 'smallest' else 'the most tokens/s'} with " + ", ".join(bounds)
        if self.max_bytes is not None and self.over_size == "smallest":
            said += "; if no row within that size keeps the other bounds, the smallest row that does"
        return said

    def why_not(self, ref: FidelityRow, r: FidelityRow, size: bool = True) -> list[str]:
        """The bounds row ``r`` misses (empty: it fits); ``size=False`` leaves out ``max_bytes``."""
        out = []
        if r.ppl_ratio > self.max_ppl_ratio:
            out.append(f"perplexity ratio {r.ppl_ratio:.3f} > {self.max_ppl_ratio}")
        if self.max_ladder_drop is not None and ref.ladder_passed - r.ladder_passed > self.max_ladder_drop:
            out.append(f"ladder {r.ladder_passed} < {ref.ladder_passed} - {self.max_ladder_drop}")
        if self.ladder_alpha is not None:
            lost, won, p = ladder_versus(ref, r)
            if p < self.ladder_alpha:
                out.append(f"ladder worse: -{lost} +{won}, one-sided McNemar p = {p:.3f} < {self.ladder_alpha}")
            for domain, _, _, lost, won, p in ladder_by_domain(ref, r):
                if p < self.ladder_alpha:
                    out.append(
                        f"{domain} ladder worse: -{lost} +{won}, one-sided McNemar p = {p:.3f} < {self.ladder_alpha}"
                    )
        if r.agreement is not None and agreement_below(r.agreement, r.agreement_interval, self.min_agreement):
            lo_hi = r.agreement_interval
            shown = f" [{lo_hi[0]:.1%}, {lo_hi[1]:.1%}]" if lo_hi else ""
            out.append(f"agreement {r.agreement:.1%}{shown} < {self.min_agreement:.0%}")
        return out + self._over_size(r) if size else out

    def _over_size(self, r: FidelityRow) -> list[str]:
        if self.max_bytes is not None and r.bytes > self.max_bytes:
            return [f"{r.bytes / 1e6:.1f} MB > {self.max_bytes / 1e6:.1f} MB"]
        return []

    def choose(self, rows: list[FidelityRow]) -> FidelityRow | None:
        """The row this rule ships (None when no row qualifies); every other row's ``why_not`` lists the
        bounds it misses, or ``passed_over`` says why a fitting row was not taken. A row chosen over the
        size cap (``over_size="smallest"``) keeps its size note in ``why_not``."""
        ref = next((r for r in rows if r.reference), None)
        if ref is None:
            raise ValueError("the fidelity table has no reference row")
        candidates = [r for r in rows if not r.reference]
        quality = {id(r): self.why_not(ref, r, size=False) for r in candidates}  # every bound but the size
        for r in candidates:
            r.why_not, r.chosen, r.passed_over = quality[id(r)] + self._over_size(r), False, ""
        fit = [r for r in candidates if not r.why_not]
        if self.prefer == "smallest":
            best = min(fit, key=lambda r: (r.bytes, r.ppl_ratio), default=None)
        else:
            best = min(fit, key=lambda r: (-r.tokens_per_s, r.bytes), default=None)
        larger = self.prefer == "smallest"
        if best is None and self.max_bytes is not None and self.over_size == "smallest":
            fit = [r for r in candidates if not quality[id(r)]]
            best, larger = min(fit, key=lambda r: (r.bytes, r.ppl_ratio), default=None), True
        for r in fit:
            r.chosen = r is best
            r.passed_over = "" if r.chosen else f"fits, {'larger' if larger else 'slower'}"
        return best


def table(rows: list[FidelityRow]) -> str:
    """The fidelity table as markdown, smallest file last; a row's ladder cell shows the tasks it lost
    and won against the reference's."""
    out = [
        "| row | bits/weight | MB | perplexity (ratio) | mean KL (nats) | ladder | agreement | tokens/s | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ref = next((r for r in rows if r.reference), None)
    for r in sorted(rows, key=lambda r: (not r.reference, -r.bytes)):
        ladder = f"{r.ladder_passed}/{r.ladder_tasks}"
        if ref is not None and r.ladder and len(r.ladder) == len(ref.ladder):
            if not r.reference:
                lost, won, _ = ladder_versus(ref, r)
                ladder += f" (-{lost} +{won})"
            parts = [
                f"{d} {n}/{k}" + ("" if r.reference else f" (-{lost} +{won})")
                for d, n, k, lost, won, _ in ladder_by_domain(ref, r)
            ]
            ladder += f": {', '.join(parts)}" if parts else ""
        verdict = "reference" if r.reference else "; ".join(r.why_not) or r.passed_over
        if r.chosen:  # a row chosen over the size cap keeps its size note
            verdict = "**chosen**" + (f" ({verdict})" if r.why_not else "")
        agreement = "" if r.agreement is None else f"{r.agreement:.1%}"
        if r.agreement_interval is not None:
            agreement += f" [{r.agreement_interval[0]:.1%}, {r.agreement_interval[1]:.1%}]"
        out.append(
            f"| {r.name} | {r.bits_per_weight:.2f} | {r.bytes / 1e6:.1f} | {r.ppl:.3f} ({r.ppl_ratio:.3f}) | "
            f"{r.kl:.4f} | {ladder} | {agreement} | {r.tokens_per_s:.1f} | {verdict} |"
        )
    return "\n".join(out)
