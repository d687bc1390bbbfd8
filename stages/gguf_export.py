"""Stage 2D — GGUF export of every tier, gated on token agreement.

Per tier: llama.cpp's pinned converter (``convert_hf_to_gguf.py``, :mod:`methods.llama_cpp_tools`)
writes F16, llama.cpp's quantizer turns it into the recipe's type (the plan: Q5_K_M target,
Q4_K_M draft), and the quantized file is compared with the transformers model it came from:
greedy continuations of held-out prompts, share of positions where the GGUF picks the same token
(:func:`methods.compression.gguf.token_agreement`). Shown below ``min_agreement`` (the plan: 95%;
the upper end of the agreement's 95% interval over prompts under it, as the fidelity table's rule
reads it) the stage fails with a table of where the GGUF diverges; nothing is published.

A tier may instead let a **fidelity table** choose its type (``quant: auto``, its ``fidelity``
block; :mod:`methods.compression.fidelity`): each candidate (a source model, a llama.cpp type, with
or without an importance matrix computed on calibration rows, the embedding at its own type, and
optionally an AWQ recipe applied to the source first: AWQ exported to GGUF) is
measured against the uncompressed reference (1R's F16 GGUF) — bits per weight, bytes, perplexity
ratio and mean KL on the validation rows, ladder pass (math, and code where the recipe asks) on the
ladder's mining part, less the tasks 1B answered (the optional ``mined`` input: 1R trained on the
corrected ones, so a row would be measured on what 1R memorised), agreement
with the reference's transformers model along its greedy paths, tokens/s — and the smallest file
within the recipe's bounds ships. Divergence and agreement are one pass over the validation rows
(:func:`methods.compression.fidelity.fidelity_pass`): an agreement path continues its row's prompt in
the same llama.cpp session, so no model reads a prompt twice.
Nothing is chosen on stage 9's evaluation tasks.

The sources are the full-precision tiers (the pruned target, the distilled draft and
qualifier, and 1R's uncompressed model as the reference): llama.cpp quantizes from F16 with its own
types. An AWQ row runs llm-compressor on its source (the recipe, the table's calibration rows),
dequantizes the checkpoint (its weights stay on the grid AWQ chose) and quantizes that: an
asymmetric 4-bit group of 32 is a Q4_1 block exactly, so AWQ's choice of scales survives the
export. The AWQ checkpoints of 2B/2C are the transformers/vLLM form of the tiers.

Outputs: ``<tier>/<tier>-<QUANT>.gguf`` per tier (and llama.cpp's quantization log beside it), ``gguf.json`` (metrics),
``gguf_report.md``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult
from methods.compression import fidelity as fid
from methods.compression.gguf import (
    QUANT_TYPES,
    TENSOR_TYPES,
    AgreementReport,
    agreement_report,
    fallback_tensors,
    gguf_parameters,
    gguf_response_loss,
    gguf_type,
    greedy_paths,
    quantize,
    token_agreement,
)
from methods.failures import answered_tasks
from methods.llama_cpp_tools import convert_hf_to_gguf
from methods.measure import lm
from methods.measure.speed import decode_cells, tokens_per_s
from methods.measure.weights import weight_bytes
from methods.training.chat import load_split
from methods.training.models import resolve_base

LIBRARIES = ("llama_cpp_python", "transformers", "torch", "gguf", "llmcompressor", "compressed-tensors")

log = logging.getLogger("kibidango.stage.2D")


class Candidate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    input: str | None = Field(None, description="Stage input holding the source model (default: the tier's input).")
    quant: str = Field(description=f"llama.cpp type: one of {', '.join(QUANT_TYPES)}.")
    imatrix: bool = Field(False, description="Quantize with an importance matrix of the source on calibration rows.")
    embedding: str | None = Field(
        None, description="llama.cpp tensor type for the token embedding and head (default: the type's own choice)."
    )
    tensors: dict[str, str] = Field(
        {},
        description="llama.cpp tensor type by tensor-name pattern (`llama-quantize --tensor-type`: a regular "
        "expression searched in each GGUF tensor name, e.g. `ffn_down: Q4_K`); the rest keep the type's own choice.",
    )
    awq: str | None = Field(
        None,
        description="An llm-compressor AWQ recipe (relative to the repository root) applied to the source first, "
        "calibrated on the table's calibration rows; the weights it chose, dequantized, are what llama.cpp quantizes "
        "(AWQ exported to GGUF: a Q4_1 block of 32 holds an asymmetric 4-bit group of 32 exactly).",
    )

    @model_validator(mode="after")
    def _known_types(self) -> Candidate:
        if self.quant not in QUANT_TYPES:
            raise ValueError(f"unknown quant {self.quant!r}; known: {', '.join(QUANT_TYPES)}")
        if self.embedding is not None and self.embedding not in TENSOR_TYPES:
            raise ValueError(f"unknown embedding type {self.embedding!r}; known: {', '.join(TENSOR_TYPES)}")
        for pattern, type_name in self.tensors.items():
            if type_name not in TENSOR_TYPES:
                raise ValueError(f"unknown tensor type {type_name!r} for {pattern!r}; known: {', '.join(TENSOR_TYPES)}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"tensor pattern {pattern!r} is not a regular expression: {e}") from None
        return self

    def file_type(self) -> str:
        """The type the shipped file is named for: a mix says so (the table and gguf.json name its parts)."""
        return f"{self.quant}-mix" if self.tensors or self.embedding else self.quant

    def source(self, tier_input: str) -> str:
        """The model this row quantizes: a stage input, or that input after this row's AWQ recipe."""
        src = self.input or tier_input
        return f"{src} AWQ {Path(self.awq).name.split('.')[0]}" if self.awq else src

    def label(self, tier_input: str) -> str:
        extra = (" +imatrix" if self.imatrix else "") + (f" emb {self.embedding}" if self.embedding else "")
        # the patterns for a reader (and a markdown cell): `blk\.(0|1)\.ffn_(gate|up)` as `blk.(0,1).ffn_(gate,up)`
        extra += "".join(f" {p.replace(chr(92), '').replace('|', ',')} {t}" for p, t in self.tensors.items())
        return f"{self.source(tier_input)} {self.quant}{extra}"


class Fidelity(BaseModel):
    """The fidelity table of a tier whose type is ``auto``, and the rule that chooses from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reference: str = Field(description="Stage input holding the uncompressed reference model (`<input>/<tier>/`).")
    candidates: list[Candidate] = Field(min_length=1, description="The rows measured against the reference.")
    max_ppl_ratio: float = Field(1.05, gt=1, description="Rule: most perplexity over the reference's.")
    max_ladder_drop: int | None = Field(
        1, ge=0, description="Rule: most ladder tasks passed fewer than the reference (None: no such bound)."
    )
    ladder_alpha: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Rule: refuse a row that passes fewer ladder tasks than the reference by a one-sided exact "
        "McNemar test at p below this (None: no test).",
    )
    max_bytes: int | None = Field(
        None, gt=0, description="Rule: the largest file a row may be (e.g. the input model's own; None: any size)."
    )
    prefer: Literal["smallest", "fastest"] = Field(
        "smallest", description="Rule: of the rows within every bound, the smallest file or the most tokens/s."
    )
    over_size: Literal["fallback", "smallest"] = Field(
        "fallback",
        description="Rule, with `max_bytes`: when no row within that size keeps the other bounds, `smallest` ships "
        "the smallest row that does (the card says by how much it is over); `fallback` ships `fallback`.",
    )
    fallback: str | None = Field(
        None, description="Type shipped from the tier's input when no candidate fits (None: the stage fails)."
    )
    ladder_levels: list[int] = Field([1, 2, 3, 4], min_length=1, description="Math-ladder levels (mining part).")
    ladder_per_level: int = Field(12, gt=0, description="Mining-part tasks per level.")
    ladder_code_levels: list[int] = Field(
        [],
        description="Code-ladder levels (mining part, `ladder_per_level` tasks each, judged in the code judge's "
        "sandbox) answered beside the math ones; the ladder bounds read both (empty: math only).",
    )
    ladder_new_tokens: int = Field(96, gt=0, description="Greedy tokens per ladder answer.")
    ladder_parallel: int = Field(
        16, gt=0, description="Ladder answers decoded together (the runtime's batching; 1: one at a time)."
    )
    imatrix_rows: int = Field(
        16, gt=0, description="Calibration rows (stage 0 train) for the importance matrix and the AWQ rows."
    )
    imatrix_max_len: int = Field(256, gt=8, description="Tokens per calibration row.")
    speed_prompts: int = Field(6, gt=0, description="Held-out prompts timed per row.")
    speed_tokens: int = Field(48, gt=0, description="Greedy tokens timed per prompt.")
    speed_rounds: int = Field(2, gt=0, description="Rounds of timing, every row in turn in each.")
    threads: int = Field(2, gt=0, description="llama.cpp threads while measuring.")

    @model_validator(mode="after")
    def _known_fallback(self) -> Fidelity:
        if self.fallback is not None and self.fallback not in QUANT_TYPES:
            raise ValueError(f"unknown fallback {self.fallback!r}; known: {', '.join(QUANT_TYPES)}")
        return self


class TierExport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    input: str = Field(description="Name of the stage input whose artifact holds this tier (`<input>/<tier>/`).")
    quant: str = Field(
        description=f"llama.cpp type to quantize to: one of {', '.join(QUANT_TYPES)}, or auto (the fidelity table's)."
    )
    min_agreement: float | None = Field(
        None, ge=0, le=1, description="This tier's gate (default: the stage's min_agreement)."
    )
    fidelity: Fidelity | None = Field(None, description="The fidelity table that chooses an `auto` type.")

    @model_validator(mode="after")
    def _auto_needs_a_table(self) -> TierExport:
        if self.quant not in QUANT_TYPES and self.quant != "auto":
            raise ValueError(f"unknown quant {self.quant!r}; known: {', '.join(QUANT_TYPES)}, auto")
        if (self.quant == "auto") != (self.fidelity is not None):
            raise ValueError("quant: auto and a fidelity block go together (the table chooses the type)")
        return self


class Config(StageConfig):
    tiers: dict[str, TierExport] = Field(
        min_length=1, description="Tier name -> where it comes from and its GGUF type."
    )
    min_agreement: float = Field(
        0.95, ge=0, le=1, description="Gate: least token agreement of each GGUF with its HF model."
    )
    prompts: int = Field(24, gt=0, description="Held-out prompts (stage 0 validation) for the agreement gate.")
    new_tokens: int = Field(32, gt=0, description="Greedy tokens per prompt for the agreement gate.")
    eval_rows: int = Field(200, gt=0, description="Validation rows for GGUF perplexity (the rows 2A-2C use).")
    eval_max_len: int = Field(256, gt=8, description="Tokens per validation row in the perplexity passes.")


def external_inputs(cfg: Config) -> dict[str, str]:
    """The digests of the AWQ recipes the fidelity tables apply: editing one changes the cache key."""
    from methods.compression import llmc

    recipes = sorted({c.awq for t in cfg.tiers.values() if t.fidelity for c in t.fidelity.candidates if c.awq})
    return {f"awq:{r}": llmc.recipe_digest(r)["recipe"] for r in recipes}


def _check_inputs(tier: str, spec: TierExport, inputs: dict[str, Path]) -> None:
    named = [spec.input]
    if spec.fidelity is not None:
        named += [spec.fidelity.reference, *(c.input for c in spec.fidelity.candidates if c.input)]
    for name in named:
        if name not in inputs:
            raise KibidangoError(
                f"tier {tier} reads input {name!r}, which the preset does not give (needs: {{{name}: ...}})"
            )


@dataclass
class _Table:
    """A tier's fidelity table and what it chose: the GGUF in ``<tier>/`` and the model it came from."""

    tier: str
    rows: list[fid.FidelityRow]
    chosen: fid.FidelityRow | None
    gguf: Path
    source: str
    """The stage input the shipped GGUF was quantized from."""
    source_dir: Path
    f16_bytes: int
    rule: str
    agreement: AgreementReport | None
    """The chosen row's agreement with the reference's transformers model, measured for the table (None:
    the fallback ships)."""
    ladder: str = ""
    """The table's ladder tasks in words (:func:`_ladder_said`)."""

    def metrics(self) -> dict[str, float]:
        ref = next(r for r in self.rows if r.reference)
        m = {"reference_ladder_passed": float(ref.ladder_passed), "fidelity_rows": float(len(self.rows) - 1)}
        if self.chosen is not None:
            c = self.chosen
            m |= {
                "chosen_ppl_ratio": c.ppl_ratio,
                "chosen_kl": c.kl,
                "chosen_ladder_passed": float(c.ladder_passed),
                "chosen_tokens_per_s_ratio": c.tokens_per_s / max(ref.tokens_per_s, 1e-9),
            }
        return m

    def report(self) -> list[str]:
        ref = next(r for r in self.rows if r.reference)
        if self.chosen is None:
            picked = f"no candidate fits: the fallback {gguf_type(self.gguf)} ships"
        elif self.chosen.why_not:  # over the size cap (`over_size: smallest`)
            picked = (
                f"no row within the size bound keeps the others: chosen **{self.chosen.name}**, the smallest "
                f"that does ({'; '.join(self.chosen.why_not)})"
            )
        else:
            picked = f"chosen: **{self.chosen.name}**"
        return [
            f"## {self.tier}: fidelity table",
            "",
            f"Reference: {ref.name} (uncompressed). Perplexity and KL on {self.rows[0].tokens} held-out response "
            f"tokens (stage 0 validation); ladder: {ref.ladder_tasks} tasks ({self.ladder}), greedy; tokens/s: "
            "llama.cpp greedy, every row in the same rounds. Rule: " + self.rule + f". {picked}.",
            "",
            fid.table(self.rows),
            "",
        ]


@dataclass
class _Candidates:
    """A tier's candidate GGUFs, quantized, and the models they come from."""

    sources: dict[str, Path]
    """Stage input -> its transformers model."""
    f16: dict[str, Path]
    """Stage input -> its F16 GGUF (the reference's is the table's reference)."""
    files: dict[str, tuple[Candidate, str, Path]]
    """Row label -> (candidate, stage input it comes from, its GGUF)."""


@dataclass
class _Measured:
    """What the table reads of every row: divergence from the reference, ladder verdicts, tokens/s
    and agreement with the reference's transformers model."""

    div: dict[str, fid.Divergence]
    ladder: dict[str, list[bool]]
    ladder_domains: list[str]
    """Each ladder task's domain, in the verdicts' order."""
    speed: dict[str, float]
    agreement: dict[str, AgreementReport]
    parameters: int


def _quantize_candidates(tier: str, spec: TierExport, inputs: dict[str, Path], work: Path) -> _Candidates:
    """Convert every source the fidelity block names to F16 and quantize each candidate from it
    (with the source's importance matrix where the candidate asks for one). A candidate with an AWQ
    recipe has a source of its own: its input after the recipe, dequantized."""
    from methods.compression.imatrix import compute_imatrix

    f = spec.fidelity
    names = dict.fromkeys([f.reference, *(c.input or spec.input for c in f.candidates)])  # the fallback's: on demand
    sources = {n: _source_dir(inputs, n, tier) for n in names}
    calibration = load_split(inputs["data"] / "dataset", "train", limit=f.imatrix_rows, by_domain=True)
    for c in f.candidates:
        if c.awq and c.source(spec.input) not in sources:
            sources[c.source(spec.input)] = _awq_source(c, sources[c.input or spec.input], inputs, f, work)
    f16 = {n: _to_f16(d, n, work) for n, d in sources.items()}
    need_imatrix = {c.source(spec.input) for c in f.candidates if c.imatrix}
    imatrix = {n: compute_imatrix(sources[n], f16[n], calibration, f.imatrix_max_len) for n in need_imatrix}
    files: dict[str, tuple[Candidate, str, Path]] = {}
    for i, c in enumerate(f.candidates):
        src = c.source(spec.input)
        log.info("2D %s fidelity: quantizing %s (%d/%d)", tier, c.label(spec.input), i + 1, len(f.candidates))
        out = quantize(
            f16[src],
            work / f"{i}-{c.quant}.gguf",
            c.quant,
            imatrix=imatrix[src] if c.imatrix else None,
            embedding_type=c.embedding,
            tensor_types=c.tensors,
        )
        files[c.label(spec.input)] = (c, src, out)
    return _Candidates(sources, f16, files)


def _source_dir(inputs: dict[str, Path], name: str, tier: str) -> Path:
    """Stage input ``name``'s transformers model (a fidelity source)."""
    return Path(resolve_base(None, inputs[name], tier, f"GGUF fidelity ({tier}, {name})"))


def _to_f16(source: Path, name: str, work: Path) -> Path:
    """``source`` (the fidelity source ``name``) converted to F16 in ``work``."""
    return convert_hf_to_gguf(source, work / f"{name.replace(' ', '_')}-F16.gguf", "f16")


def _awq_source(c: Candidate, source: Path, inputs: dict[str, Path], f: Fidelity, work: Path) -> Path:
    """``source`` after the candidate's AWQ recipe (llm-compressor, the table's calibration rows),
    dequantized into a dense transformers checkpoint llama.cpp's converter reads."""
    from methods.compression import llmc

    where = work / "awq" / Path(c.awq).name.split(".")[0]
    if not (where / "compressed" / "config.json").is_file():
        llmc.compress(
            str(source),
            llmc.recipe_file(c.awq),
            inputs["data"] / "dataset",
            where / "compressed",
            stage=f"2D AWQ ({c.awq})",
            samples=f.imatrix_rows,
            max_len=f.imatrix_max_len,
            seed=0,
            save_compressed=True,
            log_file=where / "llmcompressor.log",
        )
    return llmc.decompress(where / "compressed", where / "dense")


def _answered(inputs: dict[str, Path]) -> frozenset[str] | None:
    """The ids of the ladder tasks 1B answered (the ``mined`` input; None without it)."""
    if "mined" not in inputs:
        return None
    return answered_tasks(inputs["mined"], "the mined input (wire `mined` to stage 1B)")[1]


def _ladder_tasks(f: Fidelity, exclude: frozenset[str] | None = None) -> list[dict]:
    """The table's mining-part ladder tasks: math at ``ladder_levels``, then code at ``ladder_code_levels``,
    ``ladder_per_level`` a level, none in ``exclude``."""
    from methods.ladder import ladder_rows

    return [
        {**row, "domain": domain}
        for domain, levels in (("math", f.ladder_levels), ("code", f.ladder_code_levels))
        if levels
        for row in ladder_rows(
            domain, levels, "mining", f.ladder_per_level * len(levels), exclude=exclude or frozenset()
        )
    ]


def _ladder_said(f: Fidelity, exclude: frozenset[str] | None) -> str:
    """The table's ladder in words, for its card."""
    parts = [f"math levels {', '.join(map(str, f.ladder_levels))}"]
    if f.ladder_code_levels:
        parts.append(f"code levels {', '.join(map(str, f.ladder_code_levels))}")
    said = f"{' and '.join(parts)}, {f.ladder_per_level} mining-part tasks a level"
    return said + (", none that 1B answered" if exclude is not None else "")


def _measure(
    tier: str, f: Fidelity, cfg: Config, made: _Candidates, rows: list[dict], exclude: frozenset[str] | None
) -> _Measured:
    """Every candidate and the reference on the same tokens, tasks and prompts."""
    from transformers import AutoTokenizer

    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from kibidango.backends.torch_backend import TorchModel

    tokenizer = AutoTokenizer.from_pretrained(str(made.sources[f.reference]))
    trained = json.loads((made.sources[f.reference] / "config.json").read_text()).get("max_position_embeddings", 1024)
    n_ctx = min(max(cfg.eval_max_len, 1024), trained)  # room for a ladder answer, within the trained context
    load = lambda path, name: LlamaCppModel(path, name=name, n_ctx=n_ctx, threads=f.threads)  # noqa: E731
    ref_label = f"{f.reference} F16"
    reference = load(made.f16[f.reference], ref_label)
    models = {label: load(path, label) for label, (_, _, path) in made.files.items()}
    held = lm.held_out_prompts(tokenizer, rows)
    agree_prompts = held[: cfg.prompts]
    agree_ids = [p.ids for p in agree_prompts]
    # every row along the reference's greedy paths (torch decoding: once), judged by the reference's
    # transformers model: a row from another source (a pruned or AWQ model) is measured for what the
    # table asks, fidelity to the uncompressed model, and the reference F16's own agreement is what a
    # faithful export reaches
    hf = TorchModel(made.sources[f.reference], name=f.reference)
    log.info("2D %s fidelity: %s's greedy paths on %d prompts (agreement)", tier, f.reference, len(agree_prompts))
    paths = greedy_paths(hf, agree_ids, cfg.new_tokens)
    del hf
    log.info(
        "2D %s fidelity: perplexity and KL of %d rows on %d validation rows, agreement along %d paths",
        tier,
        len(models),
        len(rows),
        len(paths),
    )
    along = {p.row: (len(p.ids), path) for p, (path, _) in zip(agree_prompts, paths, strict=True)}
    scored = fid.fidelity_pass(reference, models, tokenizer, rows, cfg.eval_max_len, along)
    agreement = {
        label: agreement_report(tokenizer, agree_ids, paths, [scored.along[key][p.row] for p in agree_prompts])
        for label, key in {ref_label: None, **{m: m for m in models}}.items()
    }
    tasks = _ladder_tasks(f, exclude)
    ladder = {}
    for label, model in {ref_label: reference, **models}.items():
        log.info("2D %s fidelity: %d mining-part ladder tasks, %s", tier, len(tasks), label)
        ladder[label] = fid.ladder_pass(model, tokenizer, tasks, f.ladder_new_tokens, f.ladder_parallel)
    prompts = [p.ids for p in held[: f.speed_prompts]]
    cells = decode_cells({ref_label: reference, **models}, prompts, f.speed_tokens, f.speed_rounds)
    speed = {label: tokens_per_s(c) for label, c in cells.items()}
    return _Measured(scored.divergence, ladder, [t["domain"] for t in tasks], speed, agreement, reference.parameters())


def _rows(f: Fidelity, made: _Candidates, m: _Measured) -> list[fid.FidelityRow]:
    """The table: the reference's row, then one per candidate."""
    ref_label, ref_file = f"{f.reference} F16", made.f16[f.reference]
    ref_div = next(iter(m.div.values()))
    rows = [
        fid.FidelityRow.reference_of(
            ref_label,
            f.reference,
            ref_file.stat().st_size,
            m.parameters,
            ref_div,
            m.ladder[ref_label],
            m.speed[ref_label],
            m.agreement[ref_label].agreement,
            m.agreement[ref_label].interval(),
            ladder_domains=m.ladder_domains,
        )
    ]
    for label, (c, src, path) in made.files.items():
        rows.append(
            fid.FidelityRow.measured(
                label,
                src,
                c.quant,
                path.stat().st_size,
                m.parameters,
                m.div[label],
                m.ladder[label],
                m.speed[label],
                agreement=m.agreement[label].agreement,
                imatrix=c.imatrix,
                embedding=c.embedding,
                agreement_interval=m.agreement[label].interval(),
                ladder_domains=m.ladder_domains,
            )
        )
    return rows


def _choose_by_fidelity(
    tier: str, spec: TierExport, gate: float, cfg: Config, inputs: dict[str, Path], rows: list[dict], out_dir: Path
) -> _Table:
    """Measure every candidate of ``spec.fidelity`` against the reference, choose by its rule and
    leave the chosen GGUF (and its quantization log) in ``<out_dir>/<tier>/``."""
    f = spec.fidelity
    made = _quantize_candidates(tier, spec, inputs, out_dir / "_fidelity" / tier)
    exclude = _answered(inputs)
    measured = _measure(tier, f, cfg, made, rows, exclude)
    table_rows = _rows(f, made, measured)
    rule = fid.Rule(f.max_ppl_ratio, gate, f.max_ladder_drop, f.ladder_alpha, f.max_bytes, f.prefer, f.over_size)
    chosen = rule.choose(table_rows)
    dest = out_dir / tier
    dest.mkdir(parents=True, exist_ok=True)
    if chosen is not None:
        cand, src, path = made.files[chosen.name]
        gguf = path.rename(dest / f"{tier}-{cand.file_type()}.gguf")
        if path.with_suffix(".log").is_file():
            path.with_suffix(".log").rename(gguf.with_suffix(".log"))
    elif f.fallback is not None:
        src = spec.input
        if src not in made.f16:  # no candidate came from it: converted now
            made.sources[src] = _source_dir(inputs, src, tier)
            made.f16[src] = _to_f16(made.sources[src], src, out_dir / "_fidelity" / tier)
        gguf = quantize(made.f16[src], dest / f"{tier}-{f.fallback}.gguf", f.fallback)
    else:
        raise KibidangoError(
            f"stage 2D, tier {tier}: no fidelity candidate fits the rule ({rule}) and the recipe gives no "
            f"fallback\n\n{fid.table(table_rows)}"
        )
    f16_bytes = made.f16[src].stat().st_size
    shutil.rmtree(out_dir / "_fidelity")
    agreement = measured.agreement[chosen.name] if chosen is not None else None
    return _Table(
        tier,
        table_rows,
        chosen,
        gguf,
        src,
        made.sources[src],
        f16_bytes,
        str(rule),
        agreement,
        _ladder_said(f, exclude),
    )


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    from transformers import AutoTokenizer

    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from kibidango.backends.torch_backend import TorchModel

    data = inputs["data"] / "dataset"
    rows = load_split(data, "validation", limit=cfg.eval_rows, by_domain=True)  # the rows 2A-2C read
    metrics: dict[str, float] = {}
    report, failed, shipped = ["# Stage 2D — GGUF export", ""], [], {}
    tables: dict[str, _Table] = {}
    for tier, spec in cfg.tiers.items():
        _check_inputs(tier, spec, inputs)
        gate = cfg.min_agreement if spec.min_agreement is None else spec.min_agreement
        if spec.fidelity is None:
            hf_dir, source = Path(resolve_base(None, inputs[spec.input], tier, f"GGUF export ({tier})")), spec.input
            f16 = convert_hf_to_gguf(hf_dir, out_dir / tier / f"{tier}-F16.gguf", "f16")
            gguf = quantize(f16, out_dir / tier / f"{tier}-{spec.quant}.gguf", spec.quant)
            f16_bytes = f16.stat().st_size
            f16.unlink()  # the bundle ships the quantized file; F16 is only the converter's output
        else:
            table = tables[tier] = _choose_by_fidelity(tier, spec, gate, cfg, inputs, rows, out_dir)
            hf_dir, gguf, f16_bytes, source = table.source_dir, table.gguf, table.f16_bytes, table.source
            metrics.update({f"{tier}_{k}": v for k, v in table.metrics().items()})
            report += table.report()
        quant = shipped[tier] = gguf_type(gguf)
        fallbacks = fallback_tensors(gguf.with_suffix(".log"))

        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        hf = TorchModel(hf_dir, name=tier)
        table = tables.get(tier)
        agreed_with = f"{source}'s {hf_dir.name}"
        if table is not None and table.chosen is not None:  # the table measured the shipped file
            agreement, gguf_ppl = table.agreement, table.chosen.ppl
            agreed_with = f"the reference ({spec.fidelity.reference})"
        else:
            model = LlamaCppModel(gguf, name=tier)
            prompts = [p.ids for p in lm.held_out_prompts(tokenizer, rows)[: cfg.prompts]]
            agreement = token_agreement(hf, model, tokenizer, prompts, cfg.new_tokens)
            gguf_ppl = gguf_response_loss(model, tokenizer, rows, cfg.eval_max_len)["perplexity"]
            del model
        hf_loss = lm.response_loss(hf.hf, tokenizer, rows, cfg.eval_max_len)
        m = {
            "hf_bytes": float(weight_bytes(hf_dir)),
            "f16_bytes": float(f16_bytes),
            "gguf_bytes": float(gguf.stat().st_size),
            "bits_per_weight": 8 * gguf.stat().st_size / gguf_parameters(gguf),
            "fallback_tensors": float(fallbacks),
            "token_agreement": agreement.agreement,
            "identical_prompts": float(agreement.identical_prompts),
            "val_perplexity_hf": hf_loss["perplexity"],
            "val_perplexity_gguf": gguf_ppl,
        }
        metrics.update({f"{tier}_{k}": v for k, v in m.items()})
        lo, hi = agreement.interval()
        verdict = "FAIL" if fid.agreement_below(agreement.agreement, (lo, hi), gate) else "PASS"
        report += [
            f"## {tier}: {quant}, {m['gguf_bytes'] / 1e6:.2f} MB ({m['bits_per_weight']:.2f} bits/weight)  {verdict}",
            "",
            f"{fallbacks} tensors in llama.cpp's fallback type (rows not a multiple of the quant block; "
            f"see {tier}/{gguf.with_suffix('.log').name})",
            "",
            f"token agreement with {agreed_with} (HF): {agreement.agreement:.2%} "
            f"[{lo:.1%}, {hi:.1%}: 95% bootstrap over prompts] of "
            f"{agreement.positions} positions ({agreement.identical_prompts}/{agreement.prompts} prompts x "
            f"{cfg.new_tokens} tokens identical); gate {gate:.0%} (failed when the interval lies below it)",
            "",
            f"validation perplexity: HF {hf_loss['perplexity']:.2f}, GGUF {gguf_ppl:.2f}",
            "",
        ]
        if agreement.divergences:
            report += ["where the GGUF first differs:", "", agreement.table(), ""]
        if verdict == "FAIL":
            failed.append(f"{tier} ({quant}): agreement {agreement.agreement:.2%} [{lo:.1%}, {hi:.1%}] < {gate:.0%}")
    text = "\n".join(report)
    if failed:
        raise KibidangoError(f"GGUF token-agreement gate failed: {'; '.join(failed)}\n\n{text}")
    (out_dir / "gguf_report.md").write_text(text + "\n")
    (out_dir / "gguf.json").write_text(
        json.dumps(
            {
                "tiers": {t: s.model_dump() for t, s in cfg.tiers.items()},
                "fidelity": {t: [r.as_dict() for r in table.rows] for t, table in tables.items()},
                "metrics": metrics,
            },
            indent=2,
        )
    )
    summary = "GGUF export:\n  " + "\n  ".join(
        f"{t} {q}: {metrics[f'{t}_gguf_bytes'] / 1e6:.2f} MB, agreement {metrics[f'{t}_token_agreement']:.1%}, "
        f"perplexity HF {metrics[f'{t}_val_perplexity_hf']:.2f} -> GGUF {metrics[f'{t}_val_perplexity_gguf']:.2f}"
        for t, q in shipped.items()
    )
    return StageResult(metrics, ["gguf.json", "gguf_report.md"], summary)


def report_headline(artifact: Path) -> list[tuple[str, str]]:
    """This stage's rows of the report's summary (figure, value): per tier with a fidelity table,
    the row its rule chose."""
    path = artifact / "gguf.json"
    fidelity = json.loads(path.read_text()).get("fidelity") if path.is_file() else None
    rows = []
    for tier, table in (fidelity or {}).items():
        ref = next(r for r in table if r["reference"])
        chosen = next((r for r in table if r["chosen"]), None)
        shown = (
            f"{chosen['name']}: {chosen['bytes'] / 1e6:.1f} MB, {chosen['bits_per_weight']:.2f} bits/weight, "
            f"perplexity {chosen['ppl_ratio']:.3f}x the reference's, mean KL {chosen['kl']:.4f}, mining ladder "
            f"{chosen['ladder_passed']}/{chosen['ladder_tasks']} (reference {ref['ladder_passed']})"
            + (
                f"; over the size bound ({'; '.join(chosen['why_not'])}): no row within it kept the others"
                if chosen["why_not"]
                else ""
            )
            if chosen
            else "no candidate fits the rule: the recipe's fallback ships"
        )
        rows.append((f"the {tier}'s GGUF, chosen by 2D's fidelity table ({len(table) - 1} rows)", shown))
    return rows
