"""The bundle's lineage and ``BUNDLE_CARD.md``: every figure in the card is read from a stage's
metrics (the same numbers MLflow holds for that stage's run), never typed in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kibidango.bundle import TIER_ORDER

__all__ = ["lineage", "bundle_card", "scheme_label", "size_table", "tier_figures", "weight_bits"]


def lineage(inputs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Stage id -> {key, mlflow_run_id, metrics} for every artifact the inputs were built from
    (the inputs, their inputs, ...), found through the manifests in the artifact store
    (``<store>/<stage>/<key>/manifest.json``)."""
    found: dict[str, dict[str, Any]] = {}
    todo = list(inputs.values())
    while todo:
        artifact = todo.pop()
        manifest_file = artifact / "manifest.json"
        if not manifest_file.is_file():
            continue
        manifest = json.loads(manifest_file.read_text())
        stage = artifact.parent.name
        if stage in found:
            continue
        found[stage] = {
            "key": manifest.get("key", artifact.name),
            "mlflow_run_id": manifest.get("mlflow_run_id"),
            "git_sha": manifest.get("git_sha", "unknown"),
            "metrics": manifest.get("metrics", {}),
        }
        store = artifact.parent.parent
        for up in manifest.get("inputs", {}).values():
            todo += [p for p in store.glob(f"*/{up['key']}") if p.is_dir()]
    return dict(sorted(found.items()))


def scheme_label(config: dict) -> str:
    """What a compressed-tensors checkpoint holds, read from its ``config.json``'s
    ``quantization_config``: e.g. ``W8A16 asymmetric, groups of 64`` (the recipe decides the bits;
    "?" where the config does not say). Several config groups are joined with " + "."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    labels = []
    for group in groups.values():
        w = group.get("weights") or {}
        a = group.get("input_activations") or {}
        label = f"W{w.get('num_bits', '?')}A{a.get('num_bits', 16)}"
        if "symmetric" in w:
            label += " symmetric" if w["symmetric"] else " asymmetric"
        if w.get("strategy") == "group" and w.get("group_size"):
            label += f", groups of {w['group_size']}"
        elif w.get("strategy"):
            label += f", per {w['strategy']}"
        labels.append(label)
    return " + ".join(labels) or "?"


def weight_bits(config: dict) -> int | None:
    """The widest weight bits of a compressed-tensors checkpoint's config groups (None: not said)."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    bits = [g["weights"]["num_bits"] for g in groups.values() if (g.get("weights") or {}).get("num_bits")]
    return max(bits) if bits else None


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.3f} MB"


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def tier_figures(stages: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per tier the export measured (2D): bytes and validation perplexity of each form — full
    precision (the target after pruning, 2A; draft and qualifier after distillation), pruned (2A),
    AWQ (2B target, 2C others; its weight bits where the stage recorded them), AWQ + recovery
    LoRA (2F), the GGUFs — with the GGUF's bits per weight and token agreement, from the stages'
    metrics."""
    m = {s: v["metrics"] for s, v in stages.items()}
    g, p, r = m.get("2D", {}), m.get("2A", {}), m.get("2F", {})
    figures = {}
    for tier in TIER_ORDER:
        if f"{tier}_gguf_bytes" not in g:
            continue
        awq = m.get("2B" if tier == "target" else "2C", {})
        target = tier == "target"
        figures[tier] = {
            "hf_bytes": g.get(f"{tier}_hf_bytes"),
            "f16_bytes": g.get(f"{tier}_f16_bytes"),
            "awq_bytes": awq.get(f"{tier}_bytes_after"),
            "awq_bits": awq.get(f"{tier}_weight_bits"),
            "gguf_bytes": g.get(f"{tier}_gguf_bytes"),
            "bits_per_weight": g.get(f"{tier}_bits_per_weight"),
            "ppl_full": p.get("val_perplexity_before") if target and p else awq.get(f"{tier}_val_perplexity_before"),
            "ppl_pruned": p.get("val_perplexity_after") if target else None,
            "ppl_awq": awq.get(f"{tier}_val_perplexity_after"),
            "ppl_recovered": r.get("val_perplexity_recovered") if target else None,
            "ppl_gguf": g.get(f"{tier}_val_perplexity_gguf"),
            "agreement": g.get(f"{tier}_token_agreement"),
        }
    return figures


def size_table(stages: dict[str, dict[str, Any]]) -> str:
    """Per tier: bytes of the full-precision safetensors, GGUF F16, AWQ and the quantized
    GGUF; perplexity after each step; the GGUF's token agreement (:func:`tier_figures`)."""
    rows = [
        "| tier | full precision | GGUF F16 | AWQ | GGUF quantized | bits/weight (GGUF) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    ppl = [
        "| tier | full precision | pruned (2A) | AWQ (2B/2C) | AWQ + recovery LoRA (2F) | GGUF "
        "| GGUF token agreement |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for tier, f in tier_figures(stages).items():
        awq = _mb(f["awq_bytes"]) + (f" ({f['awq_bits']:.0f}-bit)" if f["awq_bits"] else "")
        rows.append(
            f"| {tier} | {_mb(f['hf_bytes'])} | {_mb(f['f16_bytes'])} | {awq} | "
            f"{_mb(f['gguf_bytes'])} | {_num(f['bits_per_weight'])} |"
        )
        ppl.append(
            f"| {tier} | {_num(f['ppl_full'])} | {_num(f['ppl_pruned'])} | {_num(f['ppl_awq'])} | "
            f"{_num(f['ppl_recovered'])} | {_num(f['ppl_gguf'])} | {_num(f['agreement'], '.1%')} |"
        )
    return (
        "\n".join(rows)
        + "\n\nValidation perplexity (response tokens, the same stage-0 validation rows at every step):\n\n"
        + "\n".join(ppl)
    )


def _recovery_rows(f: dict[str, float]) -> str:
    """What 2F's LoRA trained on, from its metrics."""
    if "loop_pair_rows" in f:
        return (
            f"what 1R learned ({int(f['loop_pair_rows'])} corrected pair rows of 1D and "
            f"{int(f['loop_replay_rows'])} replay rows: 1R's own mix)"
        )
    return f"{int(f['hardest_rows'])} of {int(f['candidate_rows'])} training rows, the compressed target's hardest"


def bundle_card(
    preset: str,
    metrics: dict[str, dict],
    adapters: list[dict],
    stages: dict[str, dict[str, Any]],
    defaults: dict[str, Any],
    default_adapter: str | None = None,
) -> str:
    m = {s: v["metrics"] for s, v in stages.items()}
    lines = [
        f"# kibidango bundle — preset `{preset}`",
        "",
        "Every figure below is a stage metric recorded by the pipeline run that built this bundle "
        f"(`python -m flows run --preset {preset}`, i.e. `make demo`); the MLflow run of each stage is listed "
        "at the end (`make compare STAGE=<id> METRICS=<names>` prints them again). Load it with "
        '`kibidango inspect <bundle>` / `kibidango generate --bundle <bundle> "Once upon a time"`.',
        "",
        "## Sizes, perplexity and GGUF agreement per tier",
        "",
        "Full precision: the tier before quantization (the target after pruning, stage 2A; draft and "
        "qualifier after distillation, stage 1E). GGUF files are llama.cpp's quantization of it (stage 2D); "
        "AWQ checkpoints are llm-compressor's, at the weight bits of each stage's recipe (stages 2B, 2C).",
        "",
        size_table(stages),
        "",
    ]
    if "sparsity" in m.get("2A", {}):
        a = m["2A"]
        lines += [
            f"Pruning (2A): {a['sparsity']:.1%} of the target's decoder linear weights are zero in the saved "
            f"tensors (least/most sparse tensor {a['sparsity_min_tensor']:.1%}/{a['sparsity_max_tensor']:.1%}).",
            "",
        ]
    if "recovered_share" in m.get("2F", {}):
        f = m["2F"]
        share = f["recovered_share"]
        verdict = (
            f"it wins back {share:.0%} of the perplexity compression cost"
            if share == share
            else "compression cost under 1% perplexity, so there was nothing to win back"
        )
        lines += [
            f"Recovery LoRA (2F): trained on {_recovery_rows(f)}; {verdict} "
            f"({f['val_perplexity_reference']:.2f} before compression, "
            f"{f['val_perplexity_compressed']:.2f} after, {f['val_perplexity_recovered']:.2f} with the LoRA). The "
            + (
                "adapter ships under adapters/recovery as the target's default weights on the torch backend "
                "(`--adapter auto` where no domain adapter is routed; `--adapter none` runs without it), the "
                "weights the calibration (2G) was fitted on."
                if default_adapter == "recovery"
                else "adapter ships under adapters/recovery and is applied only on request."
            ),
            "",
        ]
    if adapters:
        lines += [
            "## Adapters",
            "",
            "| domain | path | base tier | formats | validation loss without -> with |",
            "|---|---|---|---|---|",
        ]
        by_input = {a["stage_input"]: a for a in adapters}
        for name, a in by_input.items():
            am = metrics.get(name, {})
            if "domain_val_loss_base" in am:
                fig = f"{am['domain_val_loss_base']:.3f} -> {am['domain_val_loss_adapter']:.3f} (its domain)"
            elif "val_perplexity_recovered" in am:
                fig = (
                    f"perplexity {am['val_perplexity_compressed']:.2f} -> {am['val_perplexity_recovered']:.2f} (all "
                    "domains)"
                )
            else:
                fig = "-"
            lines.append(f"| {a['domain']} | {a['path']} | {a['base_tier']} | {', '.join(a['formats'])} | {fig} |")
        lines += [
            "",
            "Domain adapters (3-5) were trained on the full-precision target of stage 1R; the recovery "
            "adapter on the AWQ target (torch backend)."
            + (
                f" Default where no domain adapter is routed (`--adapter auto`): `{default_adapter}`."
                if default_adapter
                else ""
            ),
            "",
        ]
    lines += [
        "## Runtime defaults",
        "",
        "```json",
        json.dumps(defaults, indent=2, sort_keys=True),
        "```",
        "",
        "## Lineage",
        "",
        "Each stage's artifact, by cache key (its manifest in the artifact store holds the MLflow run, "
        "git sha and build time; the card holds nothing that changes when the same inputs are rebuilt).",
        "",
        "| stage | cache key |",
        "|---|---|",
    ]
    lines += [f"| {s} | {v['key']} |" for s, v in stages.items()]
    return "\n".join(lines) + "\n"
