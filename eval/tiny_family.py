"""A 3-tier family for runtime benchmarks until the pipeline trains one (stage P, issue 4):
stories260K (../shared) is the draft; a qualifier and a target, several times larger each, are
trained here from scratch on the TinyStories sample with stories260K's 512-token tokenizer, then
the three are converted to GGUF (F32, llama.cpp's pinned converter) and written as a bundle.

    python -m eval.tiny_family --out .kibidango/bench_bundle     (make bench-runtime)

Plain torch training (next-token cross-entropy, AdamW, cosine schedule); deterministic for a
seed on one machine. Prints each tier's parameters and validation perplexity.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import torch

from eval.shared_data import SHARED

STORIES = SHARED / "models" / "stories260K" / "hf"
TEXT = SHARED / "data" / "tinystories_sample" / "tiny_stories.txt"

# (hidden, layers, heads, kv heads, intermediate): the qualifier ~4x the draft's 260K
# parameters, the target ~4x the qualifier.
SIZES = {"qualifier": (128, 5, 8, 4, 344), "target": (256, 6, 8, 4, 688)}


def _tokens(tokenizer) -> torch.Tensor:
    ids: list[int] = []
    for story in TEXT.read_text(encoding="utf-8", errors="replace").split("\n"):
        if story.strip():
            ids += tokenizer(story)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def _model(size: tuple[int, ...], seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter = size
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(cfg)


def perplexity(model, data: torch.Tensor, seq: int = 256) -> float:
    model.eval()
    losses = []
    with torch.inference_mode():
        for i in range(0, len(data) - seq - 1, seq):
            x = data[i : i + seq][None]
            losses.append(model(input_ids=x, labels=x).loss.item())
    return math.exp(sum(losses) / len(losses))


def train(model, data: torch.Tensor, steps: int, batch: int, seq: int, lr: float, seed: int, label: str):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    start = time.monotonic()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0 or step + 1 == steps:
            eta = (time.monotonic() - start) / (step + 1) * (steps - step - 1)
            print(f"{label}: step {step + 1}/{steps} loss {loss.item():.3f} ETA {eta:.0f}s", flush=True)
    return model


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kibidango import write_bundle
    from methods.llama_cpp_tools import convert_hf_to_gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".kibidango/bench_bundle")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not STORIES.is_dir() or not TEXT.is_file():
        raise SystemExit(f"needs {STORIES} and {TEXT} (../shared)")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(str(STORIES))
    data = _tokens(tokenizer)
    split = int(0.95 * len(data))
    train_data, val_data = data[:split], data[split:]
    print(f"tokens: {len(data):,} (train {len(train_data):,}, validation {len(val_data):,})")
    work = Path(args.out).with_name(Path(args.out).name + ".tiers")
    tiers = {"draft": {"hf": STORIES, "gguf": convert_hf_to_gguf(STORIES, work / "draft.gguf", "f32")}}
    table = []
    draft = AutoModelForCausalLM.from_pretrained(str(STORIES))
    table.append(("draft (stories260K)", sum(p.numel() for p in draft.parameters()), perplexity(draft, val_data)))
    for i, (name, size) in enumerate(SIZES.items()):
        model = train(
            _model(size, args.seed + i), train_data, args.steps, args.batch, args.seq, 3e-3, args.seed + i, name
        )
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(str(out))
        for f in ("tokenizer.model", "tokenizer_config.json"):  # the draft's tokenizer files, byte for byte
            shutil.copy2(STORIES / f, out / f)
        tiers[name] = {"hf": out, "gguf": convert_hf_to_gguf(out, work / f"{name}.gguf", "f32")}
        table.append((name, sum(p.numel() for p in model.parameters()), perplexity(model, val_data)))
    for spec in tiers.values():
        spec["vocab_size"] = 512
    defaults = {
        "mode": "pyramid",
        "variant": "fuzzy",
        "k": 4,
        "l_D": 3,
        "l_Q": 6,
        "tau_Q": 0.3,
        "tau_T": 0.2,
        "stop_ids": [1, 2],
    }
    write_bundle(args.out, tiers, defaults, preset="tiny-bench", note="trained by eval/tiny_family.py")
    shutil.rmtree(work, ignore_errors=True)
    print("\n| tier | parameters | validation perplexity |\n|---|---:|---:|")
    for name, n, ppl in table:
        print(f"| {name} | {n:,} | {ppl:.2f} |")
    print(f"\nbundle: {args.out}")


if __name__ == "__main__":
    main()
