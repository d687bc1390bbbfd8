"""``make bench-kv-cache`` (plan row 1H): llama.cpp's quantized K/V caches on the bench family's
target at a long context, against f16. For each cache type: bytes of cache per token (the growth
of llama.cpp's state between two context lengths), target-only decoding's tokens/s relative to
f16 (interleaved prompt by prompt), and greedy agreement with f16 (tokens identical, and where
the first difference falls). Prompts: held-out TinyStories text (the family held out the last 5%
of the stories) cut to ``--prompt-tokens``, so that prompt + new tokens fill most of the 512-token
context. ``make bench-kv-cache`` needs ``make bench-runtime``'s bundle (built on its first run)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from core.paths import home

TYPES = ("f16", "f16+fa", "q8_0", "q4_0")
"""f16+fa: the f16 cache with flash attention, which the quantized caches run with (llama.cpp needs
it for a quantized V), so that their speed compares with it too."""


def _prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    from eval.shared_data import SHARED

    stories = [s for s in (SHARED / "data" / "tinystories_sample" / "tiny_stories.txt").read_text().split("\n") if s]
    held_out = stories[-max(1, len(stories) // 20) :]  # the family's validation share
    ids = [t for story in held_out for t in tokenizer(story)["input_ids"]]
    step = max(1, (len(ids) - length) // n)
    return [ids[i * step : i * step + length] for i in range(n) if len(ids[i * step : i * step + length]) == length]


def main(argv: list[str] | None = None) -> int:
    import llama_cpp
    from transformers import AutoTokenizer

    from kibidango import load_bundle
    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from kibidango.decode.speculative import DecodeConfig, Decoder, Metrics

    parser = argparse.ArgumentParser(prog="python -m eval.kv_cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=home() / "bench_family", help="default: make bench-runtime's")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=440)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    bundle = load_bundle(args.bundle)
    tier = bundle.tier("target", "llamacpp")
    tokenizer = AutoTokenizer.from_pretrained(str(bundle.tokenizer_dir))
    prompts = _prompts(tokenizer, args.prompts, args.prompt_tokens)
    models = {
        t: LlamaCppModel(tier.gguf, f"target-{t}", kv_cache=t.split("+")[0], flash_attn=True if "+fa" in t else None)
        for t in TYPES
    }

    per_token = {}
    for t, m in models.items():
        s = m.new_session()
        s.feed(prompts[0][:64])
        small = llama_cpp.llama_state_get_size(m.llm._ctx.ctx)
        s.feed(prompts[0][64:])
        large = llama_cpp.llama_state_get_size(m.llm._ctx.ctx)
        per_token[t] = (large - small) / (len(prompts[0]) - 64)
    cfg = DecodeConfig(mode="ar", max_new_tokens=args.new_tokens, temperature=0.0)
    seconds = dict.fromkeys(TYPES, 0.0)
    outputs: dict[str, list[list[int]]] = {t: [] for t in TYPES}
    for prompt in prompts:
        for t, m in models.items():
            decoder = Decoder({"target": m})
            start = time.perf_counter()
            out = [tok for chunk in decoder.generate(prompt, cfg, Metrics("ar")) for tok in chunk]
            seconds[t] += time.perf_counter() - start
            outputs[t].append(out)
    lines = [
        f"bench family target ({tier.gguf.name}), {len(prompts)} held-out prompts of {args.prompt_tokens} tokens "
        f"+ {args.new_tokens} new (greedy, target only), llama.cpp K/V cache types side by side",
        "",
        "| K/V cache | bytes per token | tokens/s vs f16 | prompts whose greedy output equals f16's | tokens before "
        "the first difference |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in TYPES:
        firsts = [
            next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
            for ref, out in zip(outputs["f16"], outputs[t])
        ]
        equal = sum(ref == out for ref, out in zip(outputs["f16"], outputs[t]))
        total = sum(len(ref) for ref in outputs["f16"])
        lines.append(
            f"| {t} | {per_token[t]:,.0f} | {seconds['f16'] / seconds[t]:.2f}x | {equal}/{len(prompts)} | "
            f"{sum(firsts) / total:.1%} |"
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
