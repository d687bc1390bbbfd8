"""The runtime benchmark's bundle: ../shared's bench family (a 0.26M draft, a 5M qualifier and a
26M target, one tokenizer, distilled for agreement; ``shared/models/bench-family/NOTICE.md``),
written as a bundle with the runtime's own ``write_bundle``: each tier's transformers checkpoint
and its GGUF (llama.cpp's pinned converter; ``--gguf`` picks the type: f16 by default, or a
k-quant through llama.cpp's own quantizer).

    python -m eval.bench_family --out .kibidango/bench_family      (make bench-runtime)
    python -m eval.bench_family --selection-prompts selection.txt  (openings for choosing settings)
    python -m eval.bench_family --instruction-prompts instructions.jsonl  (a second benchmark set)

Three prompt sets, each from a different place, so that no speed figure rests on the prompts its
settings were chosen on: the family's ``prompts.txt`` (the first 30 held-out story openings: the
benchmark's own), the *selection* openings (the 22 other held-out stories: where the bench's draft
lengths and n-gram settings were chosen), and the *instructions* (held-out Alpaca-GPT4 rows in the
family's ``Instruction:``/``Response:`` format: another source and another kind of text, reported
beside the first).

The bundle ships a static n-gram table (``ngrams/ngrams.npz``, :mod:`kibidango.decode.ngrams`): the
target's own greedy continuations of the *training* stories' openings, counted (no held-out
story's opening, so neither the benchmark's prompts nor the selection prompts, is among them).
``--table-prompts 0`` leaves it out.

Its target costs about 100x the draft and 5x the qualifier in matmul FLOPs per token, so the
target's cost dominates as it does in a real family (the pipeline's tiny family is too small for
that: every forward pass there is mostly fixed overhead)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

TIERS = ("draft", "qualifier", "target")


def build(out: Path, gguf_type: str | None = "f16", family: Path | None = None, table_prompts: int = 0) -> Path:
    """The bundle of ``family`` (default: ../shared's) at ``out``; ``gguf_type`` None: the
    transformers weights only (no converter needed: ``eval.bench_gpu`` on a machine without the
    pipeline installed). ``table_prompts``: the n-gram table counts the target's continuations
    of that many training-story openings (0: no table)."""
    from kibidango import load_bundle, write_bundle

    if family is None:
        from eval.shared_data import SHARED

        family = SHARED / "models" / "bench-family"
    missing = [t for t in TIERS if not (family / t / "config.json").is_file()]
    if missing:
        raise SystemExit(f"the bench family is not at {family} (missing {', '.join(missing)}): it ships in ../shared")
    with tempfile.TemporaryDirectory(prefix="kbd-bench-family-") as tmp:
        tiers = {}
        for tier in TIERS:
            tiers[tier] = {"hf": family / tier}
            if gguf_type is None:
                continue
            from methods.compression.gguf import quantize
            from methods.llama_cpp_tools import convert_hf_to_gguf

            lossless = gguf_type.lower() if gguf_type.lower() in ("f16", "f32") else "f16"
            gguf = convert_hf_to_gguf(family / tier, Path(tmp) / f"{tier}-{lossless}.gguf", lossless)
            if gguf_type.lower() not in ("f16", "f32"):
                gguf = quantize(gguf, Path(tmp) / f"{tier}-{gguf_type}.gguf", gguf_type)
            tiers[tier]["gguf"] = gguf
            print(f"{tier}: {gguf.name} ({gguf.stat().st_size / 1e6:.1f} MB)", flush=True)
        table = ngram_table(family, table_prompts) if table_prompts else None

        def finalize(root: Path) -> dict:
            from kibidango.decode.ngrams import TABLE_PATH

            if table is None:
                return {}
            (root / TABLE_PATH).parent.mkdir(parents=True)
            table.save(root / TABLE_PATH)
            return {"ngrams": TABLE_PATH}

        if out.exists():
            shutil.rmtree(out)
        write_bundle(
            out,
            tiers,
            {"mode": "sd", "k": 4, "l_D": 3, "l_Q": 6, "tau_Q": 0.3, "tau_T": 0.2, "max_new_tokens": 64},
            finalize=finalize,
            preset="bench-family",
        )
    load_bundle(out)  # every hash, one tokenizer across the tiers
    return out


TABLE_TOKENS = 64
"""Tokens the target continues each training opening with for the n-gram table (the benchmark's
budget; no stop token, as the benchmark decodes)."""


def ngram_table(family: Path, prompts: int, batch: int = 64):
    """A :class:`kibidango.decode.ngrams.NgramTable` of the family target's greedy continuations
    (``TABLE_TOKENS`` each, transformers' batched ``generate``, float32 on the CPU) of the first
    ``prompts`` distinct 8-word openings of the family's *training* stories, leaving out any
    opening that is also a held-out story's (the benchmark's and the selection prompts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kibidango.decode.ngrams import NgramTable

    openings = training_openings(family)[:prompts]
    tok = AutoTokenizer.from_pretrained(family / "target")
    model = AutoModelForCausalLM.from_pretrained(family / "target", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # no stop token: the full budget, as the benchmark decodes
    sequences = []
    for start in range(0, len(openings), batch):
        ids = [tok(o)["input_ids"] for o in openings[start : start + batch]]
        width = max(map(len, ids))
        pad = [[0] * (width - len(x)) + x for x in ids]  # left-padded, masked
        mask = [[0] * (width - len(x)) + [1] * len(x) for x in ids]
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor(pad),
                attention_mask=torch.tensor(mask),
                max_new_tokens=TABLE_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        sequences += [x + out[j, width:].tolist() for j, x in enumerate(ids)]
        print(f"  n-gram table: {len(sequences)}/{len(openings)} openings continued", file=sys.stderr, flush=True)
    table = NgramTable.build(sequences, vocab_size=model.config.vocab_size)
    print(f"n-gram table: {len(table)} contexts from {len(sequences)} continuations of training openings", flush=True)
    return table


def training_openings(family: Path | None = None) -> list[str]:
    """The distinct 8-word openings of the family's training stories that no held-out story opens
    with (what the n-gram table is counted over)."""
    from eval.shared_data import SHARED

    stories, held_out = _split(family or SHARED / "models" / "bench-family")
    held = {_opening(d) for d in held_out}
    return [o for o in dict.fromkeys(_opening(d) for d in stories[: len(stories) - len(held_out)]) if o not in held]


def _opening(doc: str) -> str:
    return " ".join(doc.split()[:8])


def _training_script(family: Path):
    """The family's own ``train_family.py``, imported: its data loaders say what it trained on."""
    import importlib.util

    script = family / "train_family.py"
    if not script.is_file():
        raise SystemExit(f"the bench family is not at {family} (train_family.py): it ships in ../shared")
    spec = importlib.util.spec_from_file_location("bench_family_train", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _held_out(docs: list[str]) -> list[str]:
    """The last 5% of a source's documents: what the family held out (its ``train_family.py``)."""
    return docs[-max(1, round(0.05 * len(docs))) :]


def _split(family: Path) -> tuple[list[str], list[str]]:
    """The family's stories and its held-out last 5% (its own ``train_family.py`` split)."""
    module = _training_script(family)
    stories = module.tinystories(family.parent.parent / "data" / "tinystories_sample" / "tiny_stories.txt")
    return stories, _held_out(stories)


def selection_prompts(family: Path | None = None) -> list[str]:
    """The first 8 words of the held-out TinyStories stories that the family's ``prompts.txt`` leaves
    out (the family holds out the last 5% of stories and benchmarks on the first 30 distinct
    openings; 22 remain): prompts to choose decoding settings on without choosing on the benchmark's
    own. The stories are split by the family's own ``train_family.py``."""
    from eval.shared_data import SHARED

    family = family or SHARED / "models" / "bench-family"
    bench = family / "prompts.txt"
    if not bench.is_file():
        raise SystemExit(f"the bench family is not at {family} (prompts.txt): it ships in ../shared")
    _, held_out = _split(family)
    openings = list(dict.fromkeys(_opening(d) for d in held_out))
    used = bench.read_text(encoding="utf-8").splitlines()
    if openings[: len(used)] != used:
        raise SystemExit(f"{bench}: not the first held-out openings this split gives; the family's data changed")
    return openings[len(used) :]


def instruction_prompts(family: Path | None = None, n: int = 30, max_words: int = 60) -> list[str]:
    """The first ``n`` held-out Alpaca-GPT4 rows (the family holds out the last 5% of every source)
    of at most ``max_words`` words, cut after ``Response:`` in the family's own instruction format
    (its ``train_family.py`` writes them): a prompt set of another provenance than the stories."""
    from eval.shared_data import SHARED

    family = family or SHARED / "models" / "bench-family"
    docs = _training_script(family).load_sources(family.parent.parent / "data")["lf_alpaca_en"]
    prompts = [d[: d.index("\nResponse:")] + "\nResponse:" for d in _held_out(docs) if "\nResponse:" in d]
    return [p for p in prompts if len(p.split()) <= max_words][:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_family", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the bundle here")
    parser.add_argument("--gguf", default="f16", help="f16 (default), f32, or a llama.cpp type such as Q8_0")
    parser.add_argument(
        "--table-prompts",
        type=int,
        default=2000,
        help="training-story openings the target continues for the bundle's n-gram table (0: none; the default "
        "takes every one)",
    )
    parser.add_argument(
        "--selection-prompts",
        type=Path,
        metavar="FILE",
        help="write the held-out story openings the benchmark's prompts leave out (for choosing settings)",
    )
    parser.add_argument(
        "--instruction-prompts",
        type=Path,
        metavar="FILE",
        help="write held-out Alpaca-GPT4 instructions in the family's format (JSONL), a second benchmark set",
    )
    args = parser.parse_args(argv)
    if args.out is None and args.selection_prompts is None and args.instruction_prompts is None:
        parser.error("give --out, --selection-prompts, --instruction-prompts or several")
    if args.instruction_prompts is not None:
        import json

        prompts = instruction_prompts()
        args.instruction_prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"{args.instruction_prompts}: {len(prompts)} prompts")
    if args.selection_prompts is not None:
        prompts = selection_prompts()
        args.selection_prompts.write_text("\n".join(prompts) + "\n", encoding="utf-8")
        print(f"{args.selection_prompts}: {len(prompts)} prompts")
    if args.out is not None:
        print(f"bundle: {build(args.out, args.gguf, table_prompts=args.table_prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
