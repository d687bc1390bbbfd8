"""The one chat format the family is trained, distilled and evaluated in.

A stage-0 example becomes ``messages``: a ``user`` turn (instruction, then input) when the
example has an instruction, and an ``assistant`` turn (the output). Plain text (a story) is a lone
assistant turn, so a raw prompt such as "Once upon a time" at inference is in-distribution.

The template is handed to axolotl (``chat_template: jinja``) *and* used here through the
tokenizer's ``apply_chat_template``: training, teacher log-probabilities and evaluation all see
the same token ids (stage 1E checks this against axolotl's own tokenization).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "SERVING_TEMPLATE",
    "TEMPLATE",
    "axolotl_dataset",
    "messages",
    "prompt_text",
    "write_jsonl",
    "load_split",
    "encode",
]

TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n### Response:\n"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

SERVING_TEMPLATE = TEMPLATE.replace("{% else %}", "{% elif m['role'] == 'assistant' and m['content'] %}")
"""The same format for llama-cpp-python's server (``chat_format: hf-tokenizer-config``), which
appends an empty assistant turn to prompt a reply and passes the client's system message: both
render as nothing, so a served model sees exactly the prompt it was trained on."""


def prompt_text(instruction: str, input_: str = "") -> str:
    """The user turn of a row: its instruction, then its input, a blank line apart."""
    return "\n\n".join(part for part in (instruction, input_) if part)


def messages(row: dict) -> list[dict[str, str]]:
    """Chat turns of a stage-0 row (fields instruction, input, output)."""
    turns = []
    prompt = prompt_text(row["instruction"], row["input"])
    if prompt:
        turns.append({"role": "user", "content": prompt})
    turns.append({"role": "assistant", "content": row["output"]})
    return turns


def axolotl_dataset(
    path: str, roles: tuple[str, ...] = ("assistant",), train_on_eos: str = "turn", **extra: str
) -> dict:
    """The axolotl dataset entry for a JSONL file of ``messages`` in this format (``chat_template``
    with :data:`TEMPLATE`, set by :func:`methods.training.axolotl.render`); loss on ``roles``.
    ``extra`` adds or replaces keys (the KD plugin's dataset type and logprobs field)."""
    return {
        "path": path,
        "ds_type": "json",
        "type": "chat_template",
        "field_messages": "messages",
        "roles_to_train": list(roles),
        "train_on_eos": train_on_eos,
        **extra,
    }


def load_split(dataset_dir: Path, split: str, domain: str | None = None, limit: int | None = None) -> list[dict]:
    """Rows of one split of stage 0's DatasetDict, optionally of one domain, in stored order."""
    from datasets import load_from_disk

    ds = load_from_disk(str(dataset_dir))[split]
    rows = []
    for row in ds:
        if domain is None or row["domain"] == domain:
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def write_jsonl(path: Path, records: Iterable[dict]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def encode(tokenizer, turns: list[dict[str, str]], max_len: int) -> tuple[list[int], int]:
    """Token ids of a conversation (truncated to ``max_len``) and where the last assistant turn
    starts (the prompt length): what axolotl trains on and the position evaluation starts at."""
    ids = tokenizer.apply_chat_template(turns, chat_template=TEMPLATE, tokenize=True, return_dict=False)
    if turns[-1]["role"] == "assistant" and len(turns) > 1:
        prompt = tokenizer.apply_chat_template(turns[:-1], chat_template=TEMPLATE, tokenize=True, return_dict=False)
        start = len(prompt)
    else:
        start = 1  # after BOS
    return list(ids)[:max_len], start
