"""Stage 2D — GGUF export of every tier, gated on token agreement.

Per tier: llama.cpp's pinned converter (``convert_hf_to_gguf.py``, :mod:`methods.llama_cpp_tools`)
writes F16, llama.cpp's quantizer turns it into the recipe's type (the plan: Q5_K_M target,
Q4_K_M draft), and the quantized file is compared with the transformers model it came from:
greedy continuations of held-out prompts, share of positions where the GGUF picks the same token
(:func:`methods.compression.gguf.token_agreement`). Below ``min_agreement`` (the plan: 95%) the
stage fails with a table of where the GGUF diverges; nothing is published.

The sources are the full-precision tiers (the pruned target, the distilled draft and
qualifier): llama.cpp quantizes from F16 with its own k-quants. The AWQ checkpoints of 2B/2C are
the transformers/vLLM form of the same tiers.

Outputs: ``<tier>/<tier>-<QUANT>.gguf`` per tier (and llama.cpp's quantization log beside it), ``gguf.json`` (metrics),
``gguf_report.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from core.contract import KibidangoError, StageConfig, StageResult
from methods.compression.gguf import QUANT_TYPES, fallback_tensors, gguf_response_loss, quantize, token_agreement
from methods.llama_cpp_tools import convert_hf_to_gguf
from methods.measure import lm
from methods.measure.weights import weight_bytes
from methods.training.chat import load_split
from methods.training.models import resolve_base

LIBRARIES = ("llama_cpp_python", "transformers", "torch")


class TierExport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    input: str = Field(description="Name of the stage input whose artifact holds this tier (`<input>/<tier>/`).")
    quant: str = Field(description=f"llama.cpp type to quantize to: one of {', '.join(QUANT_TYPES)}.")
    min_agreement: float | None = Field(
        None, ge=0, le=1, description="This tier's gate (default: the stage's min_agreement)."
    )


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
    eval_max_len: int = Field(256, gt=8)


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    from transformers import AutoTokenizer

    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from kibidango.backends.torch_backend import TorchModel

    data = inputs["data"] / "dataset"
    rows = load_split(data, "validation", limit=cfg.eval_rows, by_domain=True)  # the rows 2A-2C read
    metrics: dict[str, float] = {}
    report, failed = ["# Stage 2D — GGUF export", ""], []
    for tier, spec in cfg.tiers.items():
        if spec.quant not in QUANT_TYPES:
            raise KibidangoError(f"tier {tier}: unknown quant {spec.quant!r}; known: {', '.join(QUANT_TYPES)}")
        if spec.input not in inputs:
            raise KibidangoError(
                f"tier {tier} reads input {spec.input!r}, which the preset does not give (needs: {{{spec.input}: ...}})"
            )
        hf_dir = Path(resolve_base(None, inputs[spec.input], tier, f"GGUF export ({tier})"))
        f16 = convert_hf_to_gguf(hf_dir, out_dir / tier / f"{tier}-F16.gguf", "f16")
        gguf = quantize(f16, out_dir / tier / f"{tier}-{spec.quant}.gguf", spec.quant)
        f16_bytes = f16.stat().st_size
        fallbacks = fallback_tensors(gguf.with_suffix(".log"))
        f16.unlink()  # the bundle ships the quantized file; F16 is only the converter's output

        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        prompts = [p.ids for p in lm.held_out_prompts(tokenizer, rows)[: cfg.prompts]]
        hf, model = TorchModel(hf_dir, name=tier), LlamaCppModel(gguf, name=tier)
        agreement = token_agreement(hf, model, tokenizer, prompts, cfg.new_tokens)
        loss = gguf_response_loss(model, tokenizer, rows, cfg.eval_max_len)
        hf_loss = lm.response_loss(hf.hf, tokenizer, rows, cfg.eval_max_len)
        m = {
            "hf_bytes": float(weight_bytes(hf_dir)),
            "f16_bytes": float(f16_bytes),
            "gguf_bytes": float(gguf.stat().st_size),
            "bits_per_weight": 8 * gguf.stat().st_size / model.parameters(),
            "fallback_tensors": float(fallbacks),
            "token_agreement": agreement.agreement,
            "identical_prompts": float(agreement.identical_prompts),
            "val_perplexity_hf": hf_loss["perplexity"],
            "val_perplexity_gguf": loss["perplexity"],
        }
        metrics.update({f"{tier}_{k}": v for k, v in m.items()})
        gate = cfg.min_agreement if spec.min_agreement is None else spec.min_agreement
        verdict = "PASS" if agreement.agreement >= gate else "FAIL"
        report += [
            f"## {tier}: {spec.quant}, {m['gguf_bytes'] / 1e6:.2f} MB ({m['bits_per_weight']:.2f} bits/weight)  "
            f"{verdict}",
            "",
            f"{fallbacks} tensors in llama.cpp's fallback type (rows not a multiple of the quant block; "
            f"see {tier}/{gguf.with_suffix('.log').name})",
            "",
            f"token agreement with {hf_dir.name} (HF): {agreement.agreement:.2%} of {agreement.positions} positions "
            f"({agreement.identical_prompts}/{agreement.prompts} prompts x {cfg.new_tokens} tokens identical); "
            f"gate {gate:.0%}",
            "",
            f"validation perplexity: HF {hf_loss['perplexity']:.2f}, GGUF {loss['perplexity']:.2f}",
            "",
        ]
        if agreement.divergences:
            report += ["where the GGUF first differs:", "", agreement.table(), ""]
        if verdict == "FAIL":
            failed.append(f"{tier} ({spec.quant}): agreement {agreement.agreement:.2%} < {gate:.0%}")
        del model
    text = "\n".join(report)
    if failed:
        raise KibidangoError(f"GGUF token-agreement gate failed: {'; '.join(failed)}\n\n{text}")
    (out_dir / "gguf_report.md").write_text(text + "\n")
    (out_dir / "gguf.json").write_text(
        json.dumps({"tiers": {t: s.model_dump() for t, s in cfg.tiers.items()}, "metrics": metrics}, indent=2)
    )
    summary = "GGUF export:\n  " + "\n  ".join(
        f"{t} {s.quant}: {metrics[f'{t}_gguf_bytes'] / 1e6:.2f} MB, agreement {metrics[f'{t}_token_agreement']:.1%}, "
        f"perplexity HF {metrics[f'{t}_val_perplexity_hf']:.2f} -> GGUF {metrics[f'{t}_val_perplexity_gguf']:.2f}"
        for t, s in cfg.tiers.items()
    )
    return StageResult(metrics, ["gguf.json", "gguf_report.md"], summary)
