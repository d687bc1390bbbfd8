"""``kibidango bench``: every decoding mode on the same bundle and prompts, in one process,
interleaved (prompt by prompt, mode by mode, so that machine noise hits all modes alike), plus
peers on the same models: Hugging Face ``generate(assistant_model=draft)`` and, with the
llamacpp extra, llama.cpp's own speculative loop.

Reports ratios to ``ar`` and counts, not absolute speeds: on shared machines only those compare.
Also prints Leviathan et al.'s predicted speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)) from the
measured a (per-token acceptance) and c (draft/target cost of one forward step)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from kibidango.pipeline import Pipeline
from kibidango.speculative import DecodeConfig, Decoder, Metrics

__all__ = ["BenchResult", "leviathan_speedup", "read_prompts", "run_bench"]


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line, or JSONL with a "prompt" field."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' string ({e})") from e
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def leviathan_speedup(a: float, k: int, c: float) -> float:
    """Expected walltime improvement of SD with k drafted tokens, per-token acceptance a and
    draft/target cost ratio c (Leviathan et al., 2023, Theorem 3.8)."""
    if a >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


@dataclass
class BenchResult:
    rows: list[dict] = field(default_factory=list)
    cost_ratio: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _step_cost(model, tokens: list[int], steps: int = 24) -> float:
    """Seconds per one-token forward step with a warm KV cache (the draft's inner loop)."""
    s = model.new_session()
    s.feed(tokens)
    t = time.perf_counter()
    for i in range(steps):
        s.feed([tokens[i % len(tokens)]])
    return (time.perf_counter() - t) / steps


def run_bench(bundle: str | Path, prompts: list[str], modes: list[str], max_new_tokens: int = 64, repeats: int = 1,
              peers: tuple[str, ...] = ("hf",), **decode) -> BenchResult:  # fmt: skip
    specs = {m: m.split("-", 1) if m.startswith("pyramid-") else [m, None] for m in modes}
    needs = {mode for mode, _ in specs.values()}
    base = Pipeline.from_bundle(bundle, mode="pyramid" if "pyramid" in needs else "sd" if "sd" in needs else "ar")
    decoder = Decoder(base.models)
    ids = [base.encode(p) for p in prompts]
    # No stop ids: every mode generates the full budget, so token counts match across modes.
    cfgs = {
        m: base.config(mode=mode, variant=variant, max_new_tokens=max_new_tokens, stop_ids=(), **decode)
        for m, (mode, variant) in specs.items()
    }
    totals = {m: Metrics(m) for m in modes}
    hf_peer = "hf" in peers and "draft" in base.models
    hf_time = hf_plain_time = 0.0
    hf_tokens = 0
    for _ in range(repeats):
        for prompt_ids in ids:
            for m in modes:
                metrics = Metrics(m)
                for _chunk in decoder.generate(prompt_ids, cfgs[m], metrics):
                    pass
                totals[m].add(metrics)
            if hf_peer:
                dt, n = _hf_generate(base, prompt_ids, max_new_tokens, assistant=True)
                hf_time += dt
                hf_tokens += n
                hf_plain_time += _hf_generate(base, prompt_ids, max_new_tokens, assistant=False)[0]
    result = BenchResult()
    ar_tps = totals["ar"].tokens_per_second if "ar" in totals else None
    for m in modes:
        t = totals[m]
        row = {
            "mode": m if m != "pyramid" else f"pyramid-{cfgs[m].variant}",
            "tau": (cfgs[m].tau_Q, cfgs[m].tau_T) if cfgs[m].mode == "pyramid" else None,
            "tokens": t.generated_tokens,
            "speed_vs_ar": t.tokens_per_second / ar_tps if ar_tps else None,
            "acceptance": {s: t.acceptance_rate(s) for s in t.num_draft_tokens},
            "target_forwards_per_token": t.target_forwards_per_token,
            "mean_acceptance_length": t.mean_acceptance_length,
        }
        result.rows.append(row)
    if hf_peer:
        result.rows.append({"mode": "HF generate(assistant_model=draft)", "tokens": hf_tokens,
                            "speed_vs_ar": (hf_plain_time / hf_time) if hf_time else None,
                            "note": "ratio to HF generate() without assistant"})  # fmt: skip
    costs = {name: _step_cost(model, ids[0]) for name, model in base.models.items()}
    result.cost_ratio = {name: costs[name] / costs["target"] for name in costs}
    if "sd" in totals and totals["sd"].token_acceptance_probability("draft") is not None:
        a = totals["sd"].token_acceptance_probability("draft")
        k = cfgs["sd"].k
        c = result.cost_ratio["draft"]
        predicted = leviathan_speedup(a, k, c)
        measured = next(r["speed_vs_ar"] for r in result.rows if r["mode"] == "sd")
        result.notes.append(f"sd: Leviathan model predicts {predicted:.2f}x from a={a:.3f}, k={k}, c={c:.3f}; measured {measured:.2f}x")
    return result


def _hf_generate(pipe: Pipeline, prompt_ids: list[int], max_new_tokens: int, assistant: bool) -> tuple[float, int]:
    import torch

    target = pipe.models["target"].hf
    kwargs = {"assistant_model": pipe.models["draft"].hf} if assistant else {}
    ids = torch.tensor([prompt_ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                              pad_token_id=0, **kwargs)  # fmt: skip
    return time.perf_counter() - t, out.shape[1] - len(prompt_ids)


def format_table(result: BenchResult) -> str:
    header = ["mode", "tokens", "tokens/s vs ar", "acceptance (draft / qualifier)", "target fwd/token", "mean accepted len"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in result.rows:
        acc = r.get("acceptance") or {}
        acc_s = " / ".join(f"{acc[s]:.3f}" for s in ("draft", "qualifier") if acc.get(s) is not None) or "-"
        speed = f"{r['speed_vs_ar']:.2f}x" if r.get("speed_vs_ar") is not None else "-"
        fwd = f"{r['target_forwards_per_token']:.3f}" if "target_forwards_per_token" in r else "-"
        mal = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
        lines.append(" | ".join([r["mode"], str(r["tokens"]), speed + (f" ({r['note']})" if r.get("note") else ""), acc_s, fwd, mal]))
    lines.append("")
    lines.append("cost of one forward step relative to the target: " + ", ".join(f"{k} {v:.3f}" for k, v in result.cost_ratio.items()))
    lines += result.notes
    return "\n".join(lines)
