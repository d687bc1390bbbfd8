"""``kibidango tune`` (plan row 1F): search the speculative-decoding settings of a bundle for the
best tokens/s on held-out prompts, per backend.

Candidates: ``sd`` with each ``k``; ``sd`` at the longest ``k`` stopped by each ``p_min``; ``sd``
adaptive (from the shortest ``k`` up to ``k_max``) without and with each ``p_min``; ``lookup`` (no
draft model) with each ``lookup_k``, fixed and adaptive, and under sd's draft at the longest ``k``
and pyramid's at the longest pair; where the bundle ships an n-gram table (``ngrams/``), ``lookup``
at the longest ``lookup_k`` and sd's lookup at the longest ``k`` with the table under them;
``pyramid`` ``exact`` with each (``l_D``,
``l_Q``), and at the longest pair stopped by each ``p_min`` and adaptive; ``pyramid`` ``fuzzy`` and
``assisted`` with each (``l_D``, ``l_Q``) and (``tau_Q``, ``tau_T``). Each candidate
decodes every prompt greedily and is timed against target-only decoding (``ar``) on the same
prompts right after it, so that machine noise falls on both; its speed is the ratio. Lossless
candidates must reproduce ``ar``'s tokens exactly. One that does not is checked where it first
differs: if the target's logits for ``ar``'s token and the candidate's are within ``NEAR_TIE`` of
each other there, the difference is the backend's arithmetic (a verification step scores several
tokens in one batched matmul, ``ar`` one at a time, and the sums round differently: llama.cpp's and
transformers' assisted generation both show it), and the candidate is judged like a lossy one;
otherwise it is a bug, reported, and never admissible. Lossy ones
(fuzzy acceptance, tau > 0) must keep the target's perplexity of the generated text within
``max_ppl_increase`` of ``ar``'s text (the quality constraint), and their greedy agreement with
``ar`` (tokens before the first difference) is reported. The chosen settings are the fastest
admissible candidate, except that a mode running more tiers (``sd``: a draft; ``pyramid``: a draft
and a qualifier) must beat every admissible mode on fewer tiers (``ar``: 1.0) by more than
``tier_gain`` (a share): a tier a bundle ships only for its default mode has to pay for its bytes and
memory by more than a timing's noise (:func:`choose`); :func:`write_tuned` writes them into a copy
of the bundle as its runtime defaults for that backend (``tuned_defaults`` in bundle.json, which
:meth:`Pipeline.from_bundle` reads before the plain ``runtime_defaults``). On llama.cpp,
:func:`tune_kv_cache` then chooses the K/V cache type the tuned mode runs with (plan row 1H), which
ships as that backend's ``kv_cache``."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kibidango.addons.confidence import score_answer
from kibidango.decode.speculative import REQUEST_SETTINGS, TIERS, Metrics
from kibidango.pipeline import Pipeline

__all__ = [
    "KvCacheResult",
    "TuneResult",
    "candidates",
    "choose",
    "describe",
    "format_kv_cache",
    "format_tune",
    "tune",
    "tune_kv_cache",
    "write_tuned",
    "write_tuned_backends",
]

GRID = {
    "k": (2, 3, 4, 6, 8),
    "lengths": ((2, 4), (3, 6), (4, 8), (3, 9)),
    "taus": ((0.1, 0.05), (0.2, 0.1), (0.3, 0.2), (0.5, 0.3)),
    "p_min": (0.3, 0.6),
    "k_max": 12,
    "lookup_k": (3, 6),
}


def candidates(grid: dict[str, Any] | None = None, table: bool = False) -> list[dict[str, Any]]:
    """``table``: the bundle ships an n-gram table, so candidates that use it are added."""
    g = {**GRID, **(grid or {})}
    adaptive = {"adaptive": True, "k_max": g["k_max"]}
    out: list[dict[str, Any]] = [{"mode": "sd", "k": k} for k in g["k"]]
    out += [{"mode": "sd", "k": max(g["k"]), "p_min": p} for p in g["p_min"]]
    out += [{"mode": "sd", "k": min(g["k"]), **adaptive, **({"p_min": p} if p else {})} for p in (0, *g["p_min"])]
    for k, adapt in itertools.product(g["lookup_k"], (False, True)):
        out.append({"mode": "lookup", "k": k, **(adaptive if adapt else {})})
    if g["lookup_k"]:  # lookup under the draft: sd's longest k
        out.append({"mode": "sd", "k": max(g["k"]), "lookup": True})
    if g["lookup_k"] and table:
        out.append({"mode": "lookup", "k": max(g["lookup_k"]), "ngram_table": True})
        out.append({"mode": "sd", "k": max(g["k"]), "lookup": True, "ngram_table": True})
    out += [{"mode": "pyramid", "variant": "exact", "l_D": d, "l_Q": q} for d, q in g["lengths"]]
    d, q = max(g["lengths"], key=lambda pair: pair[1])
    out += [{"mode": "pyramid", "variant": "exact", "l_D": d, "l_Q": q, "p_min": p} for p in g["p_min"]]
    out.append({"mode": "pyramid", "variant": "exact", "l_D": d, "l_Q": q, **adaptive})
    if g["lookup_k"]:
        out.append({"mode": "pyramid", "variant": "exact", "l_D": d, "l_Q": q, "lookup": True})
    for variant, (d, q), (tq, tt) in itertools.product(("fuzzy", "assisted"), g["lengths"], g["taus"]):
        out.append({"mode": "pyramid", "variant": variant, "l_D": d, "l_Q": q, "tau_Q": tq, "tau_T": tt})
    return out


def lossless(c: dict[str, Any]) -> bool:
    """Whether decoding settings (a candidate, or a :class:`DecodeConfig` as a dict) give the
    target's own tokens: sd, lookup, exact pyramid, or any mode with both taus at 0."""
    if c["mode"] in ("sd", "lookup") or c.get("variant") == "exact":
        return True
    return c.get("tau_Q", 0) == 0 and c.get("tau_T", 0) == 0


@dataclass
class TuneResult:
    backend: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    chosen: dict[str, Any] | None = None
    best: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The fastest admissible candidate per mode (``sd``, ``pyramid``)."""
    chosen_speed: float = 1.0
    """The chosen settings' tokens/s against ``ar`` (1.0 when ``ar`` itself is chosen)."""
    passed_over: dict[str, Any] | None = None
    """The fastest admissible candidate when it was not chosen: it runs more tiers than the chosen
    one and is not faster by more than ``tier_gain``."""


NEAR_TIE = 0.5
"""The largest margin, in the target's logits under ``ar``'s own one-token steps, between ``ar``'s
token and a lossless candidate's that counts as a tie broken by rounding. A verification step
scores several tokens in one batched matmul, whose logits differ from one-token steps': on
llama.cpp with the small bundle's Q8_0 target by up to ~0.2 (margins of 0.007 and 0.24 under
``ar`` read -0.14 and 0.03 batched, and `lookup` took the other token both times); a decoding bug
leaves ``ar``'s token where it wins by a logit or more."""


def divergence_gap(model, prompt: list[int], ar: list[int], out: list[int]) -> float | None:
    """Where ``out`` first differs from ``ar`` (both decoded greedily after ``prompt``): the
    target's logit for ``ar``'s token minus its logit for ``out``'s, computed as ``ar`` decoded
    them (the prompt in one forward, then one token at a step). None when neither differs before
    the shorter one ends."""
    i = next((j for j, (a, b) in enumerate(zip(ar, out)) if a != b), None)
    if i is None:
        return None
    session = model.new_session()
    logits = session.feed(list(prompt), first=len(prompt) - 1)[-1]
    for token in ar[:i]:
        logits = session.feed([token])[-1]
    return float(logits[ar[i]] - logits[out[i]])


def _target_nll(pipe: Pipeline, prompt: list[int], out: list[int]) -> float:
    """The target's mean negative log-likelihood of ``out`` after ``prompt``."""
    return -score_answer(pipe.models["target"], prompt, out)["mean_logprob"]


def _sequences_nll(pipe: Pipeline, sequences: list[list[int]]) -> float:
    """The target's mean negative log-likelihood per token of ``sequences`` (each token after the
    first, teacher-forced), over all their tokens."""
    total = count = 0.0
    for seq in sequences:
        n = len(seq) - 1
        total += _target_nll(pipe, seq[:1], seq[1:]) * n
        count += n
    return total / max(1.0, count)


def _decode(pipe: Pipeline, prompts: list[list[int]], cfg) -> tuple[float, list[list[int]], Metrics]:
    total = Metrics(cfg.mode)
    outs = []
    start = time.perf_counter()
    for ids in prompts:
        m = Metrics(cfg.mode)
        outs.append([t for chunk in pipe.decoder.generate(ids, cfg, m) for t in chunk])
        total.add(m)
    return time.perf_counter() - start, outs, total


def tune(
    pipe: Pipeline,
    prompts: list[str] | list[list[int]],
    max_new_tokens: int = 48,
    max_ppl_increase: float = 0.02,
    grid: dict[str, Any] | None = None,
    progress=None,
    tier_gain: float = 0.0,
) -> TuneResult:
    """``pipe``: a pipeline with all three tiers loaded (``mode="pyramid"``); ``prompts``: texts,
    or token ids as they are (a pipeline stage's held-out prompts, already rendered); ``tier_gain``:
    the share by which a mode on more tiers must beat those on fewer (:func:`choose`)."""
    missing = {"draft", "qualifier", "target"} - set(pipe.models)
    if missing:
        raise ValueError(f"tuning needs the draft, qualifier and target tiers loaded (missing {sorted(missing)})")
    ids = [list(p) if isinstance(p, list) else pipe.encode(p) for p in prompts]
    base = {"max_new_tokens": max_new_tokens, "stop_ids": (), "temperature": 0.0}
    ar_cfg = pipe.config(mode="ar", **base)
    _decode(pipe, ids[:1], ar_cfg)  # warm-up
    _, ar_out, _ = _decode(pipe, ids, ar_cfg)
    ar_nll = float(np.mean([_target_nll(pipe, p, o) for p, o in zip(ids, ar_out)]))
    result = TuneResult(pipe.backend)
    cands = candidates(grid, table=pipe.decoder.ngram_table is not None)
    for n, cand in enumerate(cands, 1):
        cfg = pipe.config(**base, **{"tau_Q": 0.0, "tau_T": 0.0, "divergence": "tv", **cand})
        seconds, outs, metrics = _decode(pipe, ids, cfg)
        ar_seconds, _, _ = _decode(pipe, ids, ar_cfg)  # right after: the same machine state
        tokens = sum(len(o) for o in outs)
        firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ar_out, outs)]
        agreement = sum(firsts) / max(1, sum(len(r) for r in ar_out))
        is_lossless = lossless(cand)
        gaps = []
        if is_lossless and outs != ar_out:
            gaps = [divergence_gap(pipe.models["target"], p, r, o) for p, r, o in zip(ids, ar_out, outs) if r != o]
        near_tie = bool(gaps) and all(g is not None and abs(g) <= NEAR_TIE for g in gaps)
        if is_lossless and not near_tie:
            ppl_increase = 0.0 if outs == ar_out else None
        else:
            nll = float(np.mean([_target_nll(pipe, p, o) for p, o in zip(ids, outs)]))
            ppl_increase = math.exp(nll - ar_nll) - 1
        row = {
            **cand,
            "speed_vs_ar": (ar_seconds / seconds) * (tokens / max(1, sum(len(r) for r in ar_out))),
            "acceptance": {s: metrics.acceptance_rate(s) for s in metrics.num_draft_tokens},
            "target_forwards_per_token": metrics.target_forwards_per_token,
            "agreement_with_ar": agreement,
            "ppl_increase": ppl_increase,
            "lossless": is_lossless,
            "admissible": ppl_increase is not None and ppl_increase <= max_ppl_increase,
        }
        if near_tie:
            row["near_tie_gap"] = max(abs(g) for g in gaps)
            row["note"] = (
                f"differed from ar only where the target's logits tie within {row['near_tie_gap']:.2g} "
                "(batched verification rounds differently): judged on perplexity like a lossy mode"
            )
        elif is_lossless and outs != ar_out:
            row["note"] = "a lossless mode differed from ar: a bug"
        result.rows.append(row)
        if progress is not None:
            progress(n, len(cands), row)
    ok = [r for r in result.rows if r["admissible"]]
    for mode in ("sd", "lookup", "pyramid"):
        mine = [r for r in ok if r["mode"] == mode]
        if mine:
            result.best[mode] = max(mine, key=lambda r: r["speed_vs_ar"])
    if ok:
        best = choose(ok, tier_gain)
        # the candidate's own settings: a row also carries its measurements, none a decoding setting
        result.chosen = {k: best[k] for k in ("mode", *REQUEST_SETTINGS) if k in best}
        result.chosen_speed = best["speed_vs_ar"]
        fastest = max(ok, key=lambda r: r["speed_vs_ar"])
        if fastest["speed_vs_ar"] > best["speed_vs_ar"]:  # a faster row on more tiers, not worth its tier
            result.passed_over = fastest
    return result


@dataclass
class KvCacheResult:
    reference: str
    """The K/V cache type the others are measured against (the bundle's own, f16 by default)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """One per type, the reference's first: ``kv_cache``, ``bytes_per_token``, ``context_mb`` (the
    target's whole context), ``speed_vs_reference``, ``agreement``, ``ppl_increase``, ``admissible``."""
    chosen: str = "f16"
    refused: dict[str, str] = field(default_factory=dict)
    """Types llama.cpp would not make for the bundle's tiers, with its reason (not measured)."""


def tune_kv_cache(
    reference: Pipeline,
    bundle: str | Path,
    types: list[str],
    prompts: list[list[int]],
    settings: dict[str, Any],
    max_new_tokens: int = 48,
    max_ppl_increase: float = 0.02,
    max_slowdown: float = 0.05,
    rounds: int = 2,
    threads: int | None = None,
    texts: list[list[int]] = (),
) -> KvCacheResult:
    """Plan row 1H on llama.cpp: the K/V cache type a bundle ships. ``reference``: the bundle at
    ``bundle`` as loaded (its target's cache type is the reference); each other type of ``types`` is
    loaded beside it for ``settings``' mode (a type llama.cpp refuses for the bundle's tiers, whose
    attention heads are narrower than a quantized block, is kept in ``refused`` with the reason);
    ``settings``: the decoding settings every pipeline runs, greedily (the tuned mode). Per type: its
    target's perplexity of the reference's own sequences (each prompt and the reference's greedy
    text, teacher-forced through that type's cache) against the reference target's; greedy
    agreement (tokens before the first difference: reported, not judged; free-running texts part at
    near-ties and a parted text's perplexity is a lottery, which once admitted q4_0 at -3% and
    refused q8_0 at +14% on the small bundle's 2 prompts); ``texts``, further token sequences
    scored the same way beside them (held-out text: a few hundred tokens of it steady a perplexity
    that 32 generated tokens leave to chance); tokens/s over the reference's (each timed
    right after the reference, ``rounds`` times); and the cache's bytes per token of context. The
    chosen type is the one with the fewest bytes per token whose perplexity is within
    ``max_ppl_increase`` and whose speed is at least ``1 - max_slowdown`` of the reference's (the
    saving is memory: a timing's noise is not a reason to refuse it); the reference's own where no
    other qualifies."""
    base = {"max_new_tokens": max_new_tokens, "stop_ids": (), "temperature": 0.0}
    ref_model = reference.models["target"]
    ref_type = getattr(ref_model, "kv_cache", "f16")
    ref_cfg = reference.config(**base, **settings)
    _decode(reference, prompts[:1], ref_cfg)  # warm-up
    _, ref_out, _ = _decode(reference, prompts, ref_cfg)
    sequences = [list(p) + list(o) for p, o in zip(prompts, ref_out)]  # every token after the first scored
    sequences += [list(t) for t in texts if len(t) > 1]
    ref_nll = _sequences_nll(reference, sequences)
    ref_tokens = max(1, sum(len(o) for o in ref_out))

    def row(kv: str, model) -> dict[str, Any]:
        per_token = model.kv_bytes_per_token()
        return {"kv_cache": kv, "bytes_per_token": per_token, "context_mb": per_token * model.context_length / 1e6}

    others, refused = {}, {}
    for kv in dict.fromkeys(types):
        if kv == ref_type:
            continue
        try:
            others[kv] = Pipeline.from_bundle(
                bundle,
                backend="llamacpp",
                mode=settings["mode"],
                adapter="none",
                threads=threads,
                kv_cache=kv,
                verify=False,
            )
        except ValueError as e:
            refused[kv] = str(e)
    result = KvCacheResult(ref_type, chosen=ref_type, refused=refused)
    result.rows.append(
        {
            **row(ref_type, ref_model),
            "speed_vs_reference": 1.0,
            "agreement": 1.0,
            "ppl_increase": 0.0,
            "admissible": True,
        }
    )
    for kv, pipe in others.items():
        cfg = pipe.config(**base, **settings)
        _decode(pipe, prompts[:1], cfg)  # warm-up
        seconds = ref_seconds = 0.0
        for _ in range(max(1, rounds)):
            took, outs, _ = _decode(pipe, prompts, cfg)
            ref_took, _, _ = _decode(reference, prompts, ref_cfg)  # right after: the same machine state
            seconds, ref_seconds = seconds + took, ref_seconds + ref_took
        firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ref_out, outs)]
        ppl_increase = math.exp(_sequences_nll(pipe, sequences) - ref_nll) - 1
        speed = (ref_seconds / seconds) * (sum(len(o) for o in outs) / ref_tokens)
        result.rows.append(
            {
                **row(kv, pipe.models["target"]),
                "speed_vs_reference": speed,
                "agreement": sum(firsts) / ref_tokens,
                "ppl_increase": ppl_increase,
                "admissible": ppl_increase <= max_ppl_increase and speed >= 1 - max_slowdown,
            }
        )
    result.chosen = min((r for r in result.rows if r["admissible"]), key=lambda r: r["bytes_per_token"])["kv_cache"]
    return result


def choose(rows: list[dict[str, Any]], tier_gain: float = 0.0) -> dict[str, Any]:
    """Of admissible rows (each with ``mode`` and ``speed_vs_ar``), the one whose settings become
    the defaults: target-only decoding (``{"mode": "ar", "speed_vs_ar": 1.0}``) unless a row beats it;
    then, by the number of tiers a mode runs (:data:`kibidango.decode.speculative.TIERS`), the fastest
    row on more tiers replaces the choice only when it is faster than it by more than ``tier_gain``
    (``speed > chosen * (1 + tier_gain)``). With ``tier_gain`` 0 this is the fastest row (or ``ar``)."""
    chosen: dict[str, Any] = {"mode": "ar", "speed_vs_ar": 1.0}
    for n in sorted({len(TIERS[r["mode"]]) for r in rows}):
        fastest = max((r for r in rows if len(TIERS[r["mode"]]) == n), key=lambda r: r["speed_vs_ar"])
        gain = tier_gain if n > len(TIERS[chosen["mode"]]) else 0.0
        if fastest["speed_vs_ar"] > chosen["speed_vs_ar"] * (1 + gain):
            chosen = fastest
    return chosen


def describe(c: dict[str, Any]) -> str:
    """A candidate (or chosen settings) in words: ``sd k=4``, ``pyramid-fuzzy l_D=3 l_Q=6 tau=0.3/0.2``."""
    kv = f" kv={c['kv_cache']}" if c.get("kv_cache", "f16") != "f16" else ""
    if c.get("mode", "ar") == "ar":
        return "ar (target only)" + kv
    extra = f" adaptive<={c['k_max']}" if c.get("adaptive") else ""
    extra += f" p_min={c['p_min']}" if c.get("p_min") else ""
    extra += " +lookup" if c.get("lookup") else ""
    extra += " +table" if c.get("ngram_table") else ""
    if c["mode"] in ("sd", "lookup"):
        return f"{c['mode']} k={c['k']}{extra}{kv}"
    tau = f" tau={c['tau_Q']}/{c['tau_T']}" if "tau_Q" in c else ""
    return f"pyramid-{c['variant']} l_D={c['l_D']} l_Q={c['l_Q']}{tau}{extra}{kv}"


def format_tune(result: TuneResult, top: int = 12) -> str:
    lines = [
        f"backend {result.backend}: {len(result.rows)} candidates, each timed against ar right after it",
        "",
        "| candidate | tokens/s vs ar | acceptance (by proposer) | target fwd/token | agreement with ar | "
        "target perplexity vs ar | admissible |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for r in sorted(result.rows, key=lambda r: -r["speed_vs_ar"])[:top]:
        name = describe(r)
        acc = ", ".join(f"{s} {a:.2f}" for s, a in r["acceptance"].items() if a is not None)
        ppl = (
            "identical"
            if r["lossless"] and r["ppl_increase"] == 0
            else ("DIFFERS" if r["ppl_increase"] is None else f"{r['ppl_increase']:+.1%}")
        ) + (" (near-tie)" if "near_tie_gap" in r else "")
        lines.append(
            f"| {name} | {r['speed_vs_ar']:.2f}x | {acc or '-'} | {r['target_forwards_per_token']:.3f} | "
            f"{r['agreement_with_ar']:.1%} | {ppl} | {'yes' if r['admissible'] else 'no'} |"
        )
    lines.append("")
    for mode, r in result.best.items():
        lines.append(f"best {mode}: {r['speed_vs_ar']:.2f}x")
    if "sd" in result.best and "pyramid" in result.best:
        lines.append(
            f"best pyramid / best sd: {result.best['pyramid']['speed_vs_ar'] / result.best['sd']['speed_vs_ar']:.2f}x"
        )
    lines.append(f"chosen: {result.chosen}")
    if result.passed_over is not None:
        lines.append(
            f"passed over: {describe(result.passed_over)} at {result.passed_over['speed_vs_ar']:.2f}x ar (runs more "
            f"tiers than the choice, {result.chosen_speed:.2f}x, and is not faster by more than the tier gain)"
        )
    return "\n".join(lines)


def format_kv_cache(result: KvCacheResult) -> str:
    """The K/V cache types measured (:func:`tune_kv_cache`), as a markdown table."""
    lines = [
        f"K/V cache types against {result.reference}, in the chosen mode, greedy:",
        "",
        "| K/V cache | bytes per token | whole context | tokens/s vs reference | agreement | perplexity of the "
        "reference's sequences | admissible |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result.rows:
        lines.append(
            f"| {r['kv_cache']}{' (chosen)' if r['kv_cache'] == result.chosen else ''} | {r['bytes_per_token']:,.0f} | "
            f"{r['context_mb']:.1f} MB | {r['speed_vs_reference']:.2f}x | {r['agreement']:.1%} | "
            f"{r['ppl_increase']:+.2%} | {'yes' if r['admissible'] else 'no'} |"
        )
    lines += [f"| {kv} | refused by llama.cpp: {why} | | | | | no |" for kv, why in result.refused.items()]
    return "\n".join(lines)


def write_tuned(
    src: str | Path, dest: str | Path, backend: str, chosen: dict[str, Any], report: dict[str, Any]
) -> Path:
    """A copy of the bundle at ``src`` whose bundle.json carries ``chosen`` as the runtime
    defaults for ``backend`` (``tuned_defaults``) and the tuning's figures (``tuning``)."""
    return write_tuned_backends(src, dest, {backend: chosen}, {backend: report})


def write_tuned_backends(
    src: str | Path, dest: str | Path, tuned: dict[str, dict[str, Any]], tuning: dict[str, dict[str, Any]]
) -> Path:
    """:func:`write_tuned` for several backends at once (backend -> settings, backend -> figures);
    other backends' earlier tuning in ``src`` stays."""
    from kibidango.bundle import load_bundle, with_meta

    meta = load_bundle(src, verify=False).manifest  # with_meta hashes every file before it copies
    return with_meta(src, dest, tuned_defaults={**meta.tuned_defaults, **tuned}, tuning={**meta.tuning, **tuning})
