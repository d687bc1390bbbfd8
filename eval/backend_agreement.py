"""Greedy `ar` on the torch and llamacpp backends over the same weights: identical outputs,
where they first differ, how close the top two logits were there, and the largest logit
difference between the backends along the torch output.

    python -m eval.backend_agreement [--bundle B] [--tier target]

Without --bundle, stories260K (../shared) is converted to GGUF F32 with llama.cpp's pinned
converter and compared with its HF weights.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from eval.shared_data import SHARED

PROMPTS = Path(__file__).parent / "prompts" / "stories.txt"


def main() -> None:
    from kibidango import Pipeline, write_bundle
    from methods.llama_cpp_tools import convert_hf_to_gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle
        if bundle is None:
            hf = SHARED / "models" / "stories260K" / "hf"
            gguf = convert_hf_to_gguf(hf, Path(tmp) / "stories260K-f32.gguf", "f32")
            bundle = write_bundle(Path(tmp) / "bundle", {"target": {"hf": hf, "gguf": gguf}})
        pt = Pipeline.from_bundle(bundle, backend="torch", mode="ar")
        pl = Pipeline.from_bundle(bundle, backend="llamacpp", mode="ar")
        prompts = [p for p in PROMPTS.read_text().splitlines() if p.strip()]
        identical, worst = 0, 0.0
        print("| prompt | identical | first difference at | top-2 logit gap there (torch) |\n|---|---|---:|---:|")
        for prompt in prompts:
            ids = pt.encode(prompt)
            a = pt.generate(prompt, max_new_tokens=args.max_new_tokens, stop_ids=()).token_ids
            b = pl.generate(prompt, max_new_tokens=args.max_new_tokens, stop_ids=()).token_ids
            lt = pt.models["target"].new_session().feed(ids + a)
            ll = pl.models["target"].new_session().feed(ids + a)
            worst = max(worst, float(np.abs(lt - ll).max()))
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            identical += at is None
            gap = "-"
            if at is not None:
                top2 = np.sort(lt[len(ids) - 1 + at])[-2:]
                gap = f"{top2[1] - top2[0]:.4f}"
            print(f"| {prompt} | {'yes' if at is None else 'no'} | {'-' if at is None else at} | {gap} |")
        print(f"\nidentical greedy outputs: {identical}/{len(prompts)} prompts x {args.max_new_tokens} tokens")
        print(f"largest |logit difference| between the backends: {worst:.4f}")


if __name__ == "__main__":
    main()
