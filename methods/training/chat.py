"""The chat format a model is trained, distilled and evaluated in: its tokenizer's own template
(a pretrained instruct model's: SmolLM2's ChatML, Llama-3.1's), else the family's :data:`TEMPLATE`
(the tiny family's tokenizer has none).

A stage-0 example becomes ``messages``: a ``user`` turn (instruction, then input) when the
example has an instruction, and an ``assistant`` turn (the output). Plain text (a story) is a lone
assistant turn, so a raw prompt such as "Once upon a time" at inference is in-distribution.

The template is handed to axolotl (``chat_template: jinja`` with :data:`TEMPLATE`, or
``tokenizer_default`` for a model's own) *and* used here through the tokenizer's
``apply_chat_template``: training, teacher log-probabilities and evaluation all see the same token
ids (stage 1E checks this against axolotl's own tokenization).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "SERVING_TEMPLATE",
    "TEMPLATE",
    "axolotl_dataset",
    "axolotl_template",
    "own_template",
    "prompt_ids",
    "template",
    "messages",
    "prompt_text",
    "write_jsonl",
    "load_split",
    "encode",
    "preference_record",
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


def own_template(model: str | Path) -> bool:
    """Whether model directory ``model`` has a chat template of its own (its tokenizer's
    ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``)."""
    path = Path(model)
    config = path / "tokenizer_config.json"
    if (path / "chat_template.jinja").is_file():
        return True
    return config.is_file() and bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))


def template(tokenizer) -> str:
    """The chat template ``tokenizer``'s model is trained and prompted in: its own, else :data:`TEMPLATE`."""
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and own else TEMPLATE


def axolotl_template(model: str | Path) -> str | None:
    """What :func:`methods.training.axolotl.render` is given for base ``model``: None (axolotl's
    ``tokenizer_default``) where the base has its own template, else :data:`TEMPLATE`. A base that
    is not a directory yet (a dry run's placeholder) is taken to be the family's."""
    return None if own_template(model) else TEMPLATE


def prompt_ids(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """Token ids that prompt the model's reply to ``turns`` (the generation prompt added: ChatML's
    ``<|im_start|>assistant``; the family's template ends a user turn with it already)."""
    return list(
        tokenizer.apply_chat_template(
            turns, chat_template=template(tokenizer), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


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


def load_split(
    dataset_dir: Path, split: str, domain: str | None = None, limit: int | None = None, by_domain: bool = False
) -> list[dict]:
    """Rows of one split of stage 0's DatasetDict, optionally of one domain, in stored order; with
    ``by_domain``, the ``limit`` rows are taken in turn from each domain (round robin over the domains
    in order of first appearance, each in stored order): stage 0 stores a split domain after domain,
    so its first rows are all of one domain and a figure read on them says nothing of the others."""
    from datasets import load_from_disk

    ds = load_from_disk(str(dataset_dir))[split]
    if by_domain and domain is None and limit is not None:
        groups: dict[str, list[dict]] = {}
        for row in ds:
            groups.setdefault(row["domain"], []).append(row)
        turns = itertools.zip_longest(*groups.values())  # each domain's i-th row, then the (i+1)-th ...
        return [row for turn in turns for row in turn if row is not None][:limit]
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
    chat = template(tokenizer)
    ids = list(tokenizer.apply_chat_template(turns, chat_template=chat, tokenize=True, return_dict=False))
    if turns[-1]["role"] != "assistant":
        return ids[:max_len], len(ids)
    # the prompt is what the conversation shares with the same one ending in an empty reply:
    # BOS alone for a lone story (the family's template), the system turn and the assistant header (ChatML)
    empty = turns[:-1] + [{"role": "assistant", "content": ""}]
    other = tokenizer.apply_chat_template(empty, chat_template=chat, tokenize=True, return_dict=False)
    start = next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
    return ids[:max_len], start


def preference_record(tokenizer, row: dict, rejected: str | None = None) -> dict[str, str]:
    """A prompted stage-0 row as a preference run's strings (TRL's DPO format, axolotl's ``passthrough``):
    ``prompt`` (the conversation up to the reply, the generation prompt added), ``chosen`` (the row's
    output, through its end-of-turn token) and ``rejected`` (``rejected`` rendered the same way; None:
    the chosen reply itself, which makes the row an SFT row). TRL tokenizes ``prompt`` and ``prompt +
    chosen`` with the tokenizer's own special tokens, so a BOS the template writes and the tokenizer
    adds again is left out of ``prompt``, and ``chosen`` ends at the end-of-turn token where TRL would
    otherwise append another: the ids it trains on are :func:`encode`'s (tests/test_base_models.py checks)."""
    turns = messages(row)
    if turns[0]["role"] != "user":
        raise ValueError(f"row {row.get('id', '?')}: a preference row needs a prompt (instruction or input)")
    chat = template(tokenizer)

    def render(reply: list[dict[str, str]], generation: bool) -> str:
        return tokenizer.apply_chat_template(
            turns[:1] + reply, chat_template=chat, add_generation_prompt=generation, tokenize=False
        )

    prompt = render([], True)
    eos = tokenizer.eos_token or ""

    def reply(text: str) -> str:
        full = render([{"role": "assistant", "content": text}], False)
        if not full.startswith(prompt):
            raise ValueError(f"row {row.get('id', '?')}: the template renders the reply apart from its prompt")
        out = full[len(prompt) :]
        return out[: out.rindex(eos) + len(eos)] if eos and eos in out else out

    chosen = reply(row["output"])
    other = chosen if rejected is None else reply(rejected)
    bos = tokenizer.bos_token
    if bos and prompt.startswith(bos) and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]:
        prompt = prompt[len(bos) :]
    return {"prompt": prompt, "chosen": chosen, "rejected": other}
