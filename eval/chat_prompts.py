"""Instruction prompts rendered in a bundle's chat format, as a prompts file for ``kibidango bench``
and ``kibidango ngram-table`` (JSONL, one ``{"prompt": ...}`` per row).

    python -m eval.chat_prompts --bundle B --rows 0:300 --out table.jsonl     (prompts to count a table on)
    python -m eval.chat_prompts --bundle B --rows 969:999 --out bench.jsonl   (prompts to measure on)
    python -m eval.chat_prompts --bundle B --rows 300:999 --min-input 150 --out quote.jsonl
                                (rows that carry a text to work on: summarise, edit, list from it)

Rows of ../shared's Alpaca-GPT4 demo (``llamafactory_demo/alpaca_en_demo.json``, 999 rows), the
instruction and its input as the user's turn, through the bundle tokenizer's own chat template
with the assistant's turn opened: the prompt the server's ``/v1/chat/completions`` would decode
after. Disjoint row ranges keep a table's prompts apart from the ones it is measured on."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SOURCE = "llamafactory_demo/alpaca_en_demo.json"


def render(bundle: Path, start: int, stop: int, min_input: int = 0, limit: int | None = None) -> list[str]:
    """The rows ``start:stop`` whose input text has ``min_input`` characters or more, ``limit`` at most."""
    from transformers import AutoTokenizer

    from eval.shared_data import SHARED
    from kibidango import load_bundle
    from methods.training.chat import prompt_text

    rows = json.loads((SHARED / "data" / SOURCE).read_text(encoding="utf-8"))
    if not 0 <= start < stop <= len(rows):
        raise SystemExit(f"--rows {start}:{stop}: {SOURCE} has rows 0:{len(rows)}")
    tokenizer = AutoTokenizer.from_pretrained(str(load_bundle(bundle).tokenizer_dir))
    if not tokenizer.chat_template:
        raise SystemExit(f"{bundle}: the tokenizer has no chat template")
    out = []
    chosen = [r for r in rows[start:stop] if len(r.get("input") or "") >= min_input][:limit]
    for row in chosen:
        messages = [{"role": "user", "content": prompt_text(row["instruction"], row.get("input") or "")}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.chat_prompts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="whose tokenizer's chat template renders them")
    parser.add_argument("--rows", required=True, metavar="START:STOP", help="a range of the source's rows")
    parser.add_argument(
        "--min-input",
        type=int,
        default=0,
        metavar="CHARS",
        help="only rows whose input text has this many characters (the answer works on a text in the prompt)",
    )
    parser.add_argument("--limit", type=int, help="at most this many rows")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        start, stop = (int(x) for x in args.rows.split(":"))
    except ValueError:
        parser.error(f"--rows {args.rows!r}: START:STOP, two whole numbers")
    prompts = render(args.bundle, start, stop, args.min_input, args.limit)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    print(f"{args.out}: {len(prompts)} prompts (rows {start}:{stop} of {SOURCE})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
