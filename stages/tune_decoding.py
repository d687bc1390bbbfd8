"""Stage 1F — speculative-decoding tuning: the bundle's decoding settings searched for speed.

On stage 0's validation rows (held out from every training stage; the prompts rendered as the
family's chat format, story rows cut after a few tokens), the runtime's own tuner
(:func:`kibidango.tools.tune.tune`, also ``kibidango tune`` on any bundle) times every candidate of the
recipe's grid against target-only decoding right after it, per backend:

- ``sd`` with each draft length ``k``, at the longest stopped by each ``p_min``, and adaptive
  (from the shortest ``k`` up to ``k_max``) without and with each ``p_min``;
- ``lookup`` (n-gram drafting, no draft model) with each ``lookup_k``, fixed and adaptive, and
  under the draft (sd's longest ``k``, pyramid's longest pair);
- ``pyramid`` ``exact`` with each (``l_D``, ``l_Q``), and at the longest pair stopped by each
  ``p_min`` and adaptive; ``fuzzy`` and ``assisted`` with each (``l_D``, ``l_Q``) and each
  (``tau_Q``, ``tau_T``) of the grid (divergence: total variation).

Lossless candidates must reproduce target-only decoding token for token; one that differs only
where the target's logits tie within rounding (``kibidango.tools.tune.NEAR_TIE``: a batched verification
step rounds differently from one-token steps, as on llama.cpp with the small bundle's Q8_0 target)
is judged like a lossy one, any other mismatch is reported as a bug and the candidate is not
admissible; lossy ones must keep the target's perplexity of the text they
generate within ``max_ppl_increase`` of target-only decoding's text, and their greedy agreement
with it is reported. The fastest admissible candidate per backend becomes that backend's runtime
defaults (target-only decoding where no candidate beats it): the bundle is copied (files
hard-linked) with ``tuned_defaults`` and the figures (``tuning``) in its bundle.json, which
:meth:`kibidango.Pipeline.from_bundle` reads over the plain ``runtime_defaults``. Timings are
ratios measured side by side in one process; the settings are chosen for greedy decoding
(sampling changes acceptance, not correctness: speculative sampling stays lossless).

On llama.cpp the chosen mode then runs with each K/V cache type of ``kv_caches`` beside the bundle's
own (plan row 1H; :func:`kibidango.tools.tune.tune_kv_cache`): the type with the fewest bytes per token
whose perplexity of the reference's own sequences (prompt and greedy text, teacher-forced) and of
``kv_texts`` held-out rows keeps ``max_ppl_increase`` and whose speed keeps ``1 - kv_max_slowdown`` of
the reference's ships as that backend's ``kv_cache`` (on SmolLM2's 8,192-token context an f16 cache
is 189 MB, more than the Q4 weights; q8_0 is 100 MB).

Outputs: ``bundle/`` (the tuned bundle, read by stages 9 and 9A), ``tuning.json``,
``candidates.jsonl`` (every candidate, every backend; an MLflow table), ``speedup_vs_tau.png``,
``TUNING_CARD.md``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from core.progress import Progress
from methods.training.chat import encode, load_split, messages

LIBRARIES = ("matplotlib",)

log = logging.getLogger("kibidango.stage.1F")


class Grid(StageConfig):
    k: list[int] = Field([2, 3, 4, 6, 8], min_length=1, description="Draft lengths of sd.")
    lengths: list[tuple[int, int]] = Field(
        [(2, 4), (3, 6), (4, 8), (3, 9)], min_length=1, description="Pyramid's (l_D, l_Q) pairs."
    )
    taus: list[tuple[float, float]] = Field(
        [(0.1, 0.05), (0.2, 0.1), (0.3, 0.2), (0.5, 0.3)],
        description="Pyramid's (tau_Q, tau_T) pairs for the fuzzy and assisted variants (empty: exact only).",
    )
    p_min: list[float] = Field(
        [0.3, 0.6], description="Draft confidence floors tried with sd's longest k and pyramid's longest pair."
    )
    k_max: int = Field(12, ge=1, description="The longest draft run of the adaptive candidates.")
    lookup_k: list[int] = Field([3, 6], description="Draft lengths of lookup (n-gram drafting; empty: none).")


class Config(StageConfig):
    bundle_input: str = Field("bundle", description="The input holding bundle/ (stage X).")
    data_input: str = Field("data", description="The input holding stage 0's dataset/ (its validation split).")
    backends: list[Literal["torch", "llamacpp"]] = Field(
        ["torch", "llamacpp"], min_length=1, description="Backends tuned, each its own defaults."
    )
    prompts: int = Field(16, gt=0, description="Held-out prompts (stage 0's validation split, in stored order).")
    max_new_tokens: int = Field(48, gt=0, description="Tokens per prompt in each timed run.")
    max_ppl_increase: float = Field(
        0.02, ge=0, description="Quality bound of the lossy variants: the target's perplexity of their text vs ar's."
    )
    tier_gain: float = Field(
        0.05,
        ge=0,
        description="Share by which a mode on more tiers (sd: the draft; pyramid: and the qualifier) must beat the "
        "fastest on fewer to become the defaults: the default profile ships a tier only for the mode that runs it, "
        "so it has to pay for its bytes and memory by more than one timing's noise (tiny's 1F chose sd k=2 at 1.05x "
        "one run, lookup k=3 adaptive at 1.06x the run before, on the same bundle).",
    )
    kv_caches: list[Literal["f16", "q8_0", "q4_0"]] = Field(
        ["q8_0", "q4_0"],
        description="llama.cpp K/V cache types timed against the bundle's own (f16) in the chosen mode (plan row "
        "1H); the one with the fewest bytes per token whose perplexity of the reference's sequences keeps "
        "max_ppl_increase and whose speed keeps "
        "1 - kv_max_slowdown of the reference's ships as the backend's kv_cache (empty: the bundle's own).",
    )
    kv_max_slowdown: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Share of tokens/s a smaller K/V cache may lose to the reference's and still ship: what it "
        "buys is memory, and a timing on a few prompts moves by about this much.",
    )
    kv_texts: int = Field(
        16,
        ge=0,
        description="Held-out rows (stage 0's validation split, each rendered whole up to kv_text_tokens) whose "
        "perplexity through each K/V cache is judged beside the reference's own sequences: the small recipe's "
        "prompts give 32 generated tokens, on which q8_0 measured -3.9% and q4_0 +7.9% to +14.0%.",
    )
    kv_text_tokens: int = Field(256, gt=1, description="Tokens of each kv_texts row scored (its opening).")
    threads: int | None = Field(None, gt=0, description="CPU threads per model (default: the runtime's).")
    grid: Grid = Field(default_factory=Grid, description="The settings tried.")


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    from kibidango.bundle import load_bundle
    from kibidango.pipeline import Pipeline
    from kibidango.tools.tune import describe, tune, write_tuned_backends

    for name in (cfg.bundle_input, cfg.data_input):
        if name not in inputs:
            raise KibidangoError(f"input {name!r} is not wired (add it to the preset's needs of stage 1F)")
    src = inputs[cfg.bundle_input] / "bundle"
    bundle = load_bundle(src)  # every file hashed, once for the whole stage (the loads below skip it)
    missing = {"draft", "qualifier", "target"} - set(bundle.tiers)
    if missing:
        raise KibidangoError(f"{src}: tuning needs the draft, qualifier and target tiers (missing {sorted(missing)})")
    for backend in cfg.backends:
        form = "gguf" if backend == "llamacpp" else "hf"
        if any(not getattr(bundle.manifest.tiers[t], form) for t in ("draft", "qualifier", "target")):
            raise KibidangoError(f"{src}: backend {backend!r} needs every tier's {form} weights; drop it from backends")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bundle.tokenizer_dir))
    rows = load_split(inputs[cfg.data_input] / "dataset", "validation", limit=max(4 * cfg.prompts, cfg.kv_texts))
    grid = cfg.grid.model_dump()

    results, candidates, prompts = {}, [], []
    kv = None  # the K/V cache types measured on llama.cpp (plan row 1H)
    for backend in cfg.backends:
        pipe = Pipeline.from_bundle(
            src, backend=backend, mode="pyramid", adapter="none", threads=cfg.threads, verify=False
        )
        if not prompts:
            prompts, texts = _held_out(cfg, tokenizer, rows, pipe, inputs[cfg.data_input])
        progress = Progress(f"1F {backend} candidates", None, log)
        result = tune(
            pipe,
            prompts,
            cfg.max_new_tokens,
            cfg.max_ppl_increase,
            grid,
            progress=lambda n, total, row, p=progress: p.update(n),
            tier_gain=cfg.tier_gain,
        )
        progress.finish(len(result.rows))
        bad = [r for r in result.rows if r.get("note") and "near_tie_gap" not in r]
        if bad:
            log.warning(f"{backend}: {len(bad)} lossless candidates differed from target-only decoding (a bug)")
        ties = [r for r in result.rows if "near_tie_gap" in r]
        if ties:
            log.info(
                f"{backend}: {len(ties)} lossless candidates differed from target-only decoding only where the "
                f"target's logits tie within {max(r['near_tie_gap'] for r in ties):.2g} (batched verification "
                "rounds differently); judged on perplexity like lossy candidates"
            )
        results[backend] = result
        candidates += [{"backend": backend, **r} for r in result.rows]
        if backend == "llamacpp":
            kv = _kv_cache(cfg, src, pipe, prompts, texts, result.chosen or {"mode": "ar"})
        del pipe

    tuned = {b: r.chosen or {"mode": "ar"} for b, r in results.items()}
    if kv is not None and kv.chosen != kv.reference:
        tuned["llamacpp"] = {**tuned["llamacpp"], "kv_cache": kv.chosen}
    tuning = {
        b: {
            "best": r.best,
            "chosen_speed_vs_ar": r.chosen_speed,
            "prompts": len(prompts),
            "max_new_tokens": cfg.max_new_tokens,
            "max_ppl_increase": cfg.max_ppl_increase,
            "tier_gain": cfg.tier_gain,
            "passed_over": r.passed_over,
            "source": "stage 1F",
        }
        for b, r in results.items()
    }
    if kv is not None:
        tuning["llamacpp"]["kv_cache"] = {
            "reference": kv.reference,
            "chosen": kv.chosen,
            "rows": kv.rows,
            "refused": kv.refused,
            "max_slowdown": cfg.kv_max_slowdown,
            "texts": len(texts),  # the rows scored (the split may hold fewer than kv_texts)
            "text_tokens": cfg.kv_text_tokens,
        }
    write_tuned_backends(src, out_dir / "bundle", tuned, tuning)

    (out_dir / "tuning.json").write_text(json.dumps({"tuned_defaults": tuned, "tuning": tuning}, indent=2))
    with open(out_dir / "candidates.jsonl", "w") as f:
        for row in candidates:
            f.write(json.dumps(row) + "\n")
    _plot(results, out_dir / "speedup_vs_tau.png")
    (out_dir / "TUNING_CARD.md").write_text(_card(results, tuned, len(prompts), cfg, kv))

    metrics: dict[str, float] = {"prompts": float(len(prompts))}
    for b, r in results.items():
        metrics[f"{b}/candidates"] = float(len(r.rows))
        metrics[f"{b}/lossless_mismatches"] = float(sum(1 for x in r.rows if x.get("note") and "near_tie_gap" not in x))
        metrics[f"{b}/lossless_near_ties"] = float(sum(1 for x in r.rows if "near_tie_gap" in x))
        metrics[f"{b}/chosen_speed_vs_ar"] = r.chosen_speed
        for mode, row in r.best.items():
            metrics[f"{b}/best_{mode}_speed_vs_ar"] = row["speed_vs_ar"]
        if "sd" in r.best and "pyramid" in r.best:
            metrics[f"{b}/pyramid_over_sd"] = r.best["pyramid"]["speed_vs_ar"] / r.best["sd"]["speed_vs_ar"]
    for row in kv.rows if kv is not None else []:
        for key in ("speed_vs_reference", "ppl_increase", "context_mb"):
            metrics[f"llamacpp/kv_{row['kv_cache']}/{key}"] = row[key]
    summary = "; ".join(f"{b}: {describe(tuned[b])} at {r.chosen_speed:.2f}x ar" for b, r in results.items())
    return StageResult(
        metrics,
        ["TUNING_CARD.md", "tuning.json", "speedup_vs_tau.png"],
        f"tuned defaults {summary} (bundle/ with tuned_defaults)",
        tables={"candidates.json": "candidates.jsonl"},
    )


def _held_out(cfg: Config, tokenizer, rows: list[dict], pipe, data: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The timed prompts (``cfg.prompts`` distinct openings of the validation rows) and the K/V cache's
    held-out texts (``cfg.kv_texts`` rows rendered whole), each with room for the generated tokens in
    every tier's context."""
    from methods.measure.lm import held_out_prompts

    lookahead = max([*cfg.grid.k, cfg.grid.k_max, *cfg.grid.lookup_k, *(q for _, q in cfg.grid.lengths)]) + 1
    room = min(m.context_length for m in pipe.models.values()) - cfg.max_new_tokens - lookahead
    held_out = [p.ids for p in held_out_prompts(tokenizer, rows, max_len=room)]
    prompts = list({tuple(ids): ids for ids in held_out}.values())[: cfg.prompts]  # stories may open alike
    if not prompts:
        raise KibidangoError(f"{data}: no validation row gives a prompt under {room} tokens")
    width = min(cfg.kv_text_tokens, room)
    return prompts, [encode(tokenizer, messages(r), width)[0] for r in rows[: cfg.kv_texts]]


def _kv_cache(cfg: Config, src: Path, pipe, prompts: list[list[int]], texts: list[list[int]], chosen: dict):
    """The bundle's llama.cpp K/V cache (plan row 1H): each type of ``kv_caches`` loaded beside the
    reference ``pipe`` and timed in the chosen mode, its perplexity judged on the reference's own
    sequences and on ``texts`` (:func:`kibidango.tools.tune.tune_kv_cache`); None when the recipe
    tries none."""
    from kibidango.tools.tune import tune_kv_cache

    if not [t for t in cfg.kv_caches if t != pipe.models["target"].kv_cache]:
        return None
    result = tune_kv_cache(
        pipe,
        src,
        cfg.kv_caches,
        prompts,
        chosen,
        cfg.max_new_tokens,
        cfg.max_ppl_increase,
        cfg.kv_max_slowdown,
        threads=cfg.threads,
        texts=texts,
    )
    for kv, why in result.refused.items():
        log.warning(f"llamacpp K/V cache {kv} not tried: {why}")
    for row in result.rows:
        log.info(
            f"llamacpp K/V cache {row['kv_cache']}: {row['context_mb']:.1f} MB for the whole context, "
            f"{row['speed_vs_reference']:.2f}x the reference's tokens/s, perplexity {row['ppl_increase']:+.2%}"
        )
    return result


def _card(results: dict, tuned: dict, prompts: int, cfg: Config, kv=None) -> str:
    from kibidango.tools.tune import describe, format_tune

    lines = [
        "# Stage 1F — speculative-decoding tuning",
        "",
        f"{prompts} held-out prompts (stage 0's validation split) x {cfg.max_new_tokens} tokens, greedy; each "
        "candidate timed against target-only decoding (ar) right after it, in one process, so the speeds are "
        f"ratios. Lossy candidates are admissible when the target's perplexity of their text is at most "
        f"{cfg.max_ppl_increase:.0%} above ar's text; lossless ones when they reproduce ar exactly. The same "
        "search runs on any bundle with `kibidango tune --bundle B --backend torch|llamacpp`.",
        "",
        "| backend | tuned defaults | tokens/s vs ar | best sd | best lookup | best pyramid |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for b, r in results.items():
        best = {m: f"{r.best[m]['speed_vs_ar']:.2f}x" if m in r.best else "-" for m in ("sd", "lookup", "pyramid")}
        lines.append(
            f"| {b} | {describe(tuned[b])} | {r.chosen_speed:.2f}x | {best['sd']} | {best['lookup']} | "
            f"{best['pyramid']} |"
        )
    lines += [
        "",
        f"A mode on more tiers (sd: the draft; pyramid: the draft and the qualifier) becomes the defaults only "
        f"when it beats the fastest on fewer (ar: 1.0x) by more than {cfg.tier_gain:.0%}: the default profile ships "
        "a tier only for the mode that runs it.",
    ]
    for b, r in results.items():
        if r.passed_over is not None:
            lines.append(
                f"- {b}: passed over {describe(r.passed_over)} at {r.passed_over['speed_vs_ar']:.2f}x for "
                f"{describe(tuned[b])} at {r.chosen_speed:.2f}x."
            )
    lines += [
        "",
        "The bundle ships these as `tuned_defaults` per backend; `kibidango generate --bundle B --backend ...` "
        "starts from them (any `--mode`/`--k`/... flag still wins). Speed against tau: `speedup_vs_tau.png`.",
    ]
    if kv is not None:
        from kibidango.tools.tune import format_kv_cache

        lines += [
            "",
            "## llamacpp: the K/V cache (plan row 1H)",
            "",
            f"The chosen mode decoded with each K/V cache type beside the bundle's own ({kv.reference}), each timed "
            "right after it; a type ships when its perplexity of the reference's own sequences (prompts and "
            f"greedy text, teacher-forced) and of {cfg.kv_texts} held-out rows (up to {cfg.kv_text_tokens} tokens "
            "each) keeps the bound and its speed keeps "
            f"{1 - cfg.kv_max_slowdown:.0%} of the reference's, the fewest bytes per token first. Chosen: "
            f"**{kv.chosen}**.",
            "",
            format_kv_cache(kv),
        ]
    for b, r in results.items():
        lines += ["", f"## {b}: the fastest candidates", "", format_tune(r, top=10)]
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    """Per backend: the fuzzy and assisted variants' best speed (over l_D, l_Q) at each tau pair,
    filled where admissible; the best sd and exact pyramid as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.0), squeeze=False)
    for ax, (backend, r) in zip(axes[0], results.items(), strict=True):
        taus = sorted({(x["tau_Q"], x["tau_T"]) for x in r.rows if "tau_Q" in x})
        for variant, color in (("fuzzy", "tab:blue"), ("assisted", "tab:orange")):
            best = []
            for t in taus:
                rows = [x for x in r.rows if x.get("variant") == variant and (x.get("tau_Q"), x.get("tau_T")) == t]
                if rows:
                    best.append((t, max(rows, key=lambda x: x["speed_vs_ar"])))
            if not best:
                continue
            xs = [t[0] for t, _ in best]
            ax.plot(xs, [x["speed_vs_ar"] for _, x in best], color=color, label=f"pyramid {variant}")
            for t, x in best:
                ax.scatter(
                    t[0], x["speed_vs_ar"], color=color, facecolors=color if x["admissible"] else "none", zorder=3
                )
        for label, rows, style in (
            ("best sd", [x for x in r.rows if x["mode"] == "sd"], "--"),
            ("best pyramid exact", [x for x in r.rows if x.get("variant") == "exact"], ":"),
        ):
            if rows:
                ax.axhline(max(x["speed_vs_ar"] for x in rows), color="gray", linestyle=style, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8, label="ar (target only)")
        ax.set_xlabel("tau_Q (tau_T as paired in the grid)")
        ax.set_ylabel("tokens/s vs ar")
        ax.set_title(f"{backend} (hollow: over the perplexity bound)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report_headline(artifact: Path) -> list[tuple[str, str]]:
    """This stage's row of the report's summary (figure, value): the decoding defaults it chose per backend."""
    from kibidango.tools.tune import describe

    path = artifact / "tuning.json"
    if not path.is_file():
        return []
    tuning = json.loads(path.read_text())
    shown = "; ".join(
        f"{b}: {describe(tuning['tuned_defaults'][b])} at {t['chosen_speed_vs_ar']:.2f}x ar"
        for b, t in tuning["tuning"].items()
    )
    return [("decoding defaults chosen by tuning (greedy, held-out prompts)", shown)]
