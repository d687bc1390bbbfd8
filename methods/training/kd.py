"""Offline top-k knowledge distillation through axolotl's KD plugin, for any stage that trains
a student on a teacher's distribution (1E's draft and qualifier, 2F's recovery LoRA).

The teacher scores each example once; its top-k log-probabilities at every position go to a
JSONL file in the plugin's dataset format (``axolotl.integrations.kd.chat_template``:
``messages``, ``target_token_ids``, ``logprobs``); axolotl trains the student on a mix of the
forward KL to those distributions and the plain cross-entropy on the data (:class:`KDLoss`).
Before training, the ids axolotl prepared are checked against the ids the teacher scored
(:func:`check_alignment`): misaligned log-probabilities would train silently on garbage.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from core.contract import KibidangoError
from core.progress import Progress
from methods.training.chat import axolotl_dataset, encode, messages

log = logging.getLogger("kibidango.kd")

KD_DATASET_TYPE = "axolotl.integrations.kd.chat_template"


class KDLoss(BaseModel):
    """The distillation loss: how much of the teacher's distribution is kept and how it is weighed."""

    model_config = {"extra": "forbid"}

    top_k: int = Field(8, gt=0, le=64, description="Teacher log-probabilities kept per position.")
    alpha: float = Field(0.9, ge=0, description="Weight of the KD (forward KL on the teacher's top-k) loss.")
    ce_alpha: float = Field(0.1, ge=0, description="Weight of the plain cross-entropy on the data.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of the KD loss (axolotl's kd_temperature).")
    normalize_topk: bool = Field(
        True,
        description="Compare the student's distribution renormalised over the teacher's top-k (axolotl "
        "kd_normalize_topk). Without it the student is pushed to put all its mass on the top-k (the teacher's "
        "top-k is renormalised), sharper than the teacher: agreement rises while expected acceptance falls.",
    )

    def axolotl_keys(self) -> dict:
        """The keys of an axolotl YAML that turn its trainer into the KD trainer with this loss."""
        return {
            "plugins": ["axolotl.integrations.kd.KDPlugin"],
            "kd_trainer": True,
            "kd_alpha": self.alpha,
            "kd_ce_alpha": self.ce_alpha,
            "kd_temperature": self.temperature,
            "kd_normalize_topk": self.normalize_topk,
        }


def kd_dataset(path: str) -> dict:
    """An axolotl dataset entry for a file :func:`teacher_logprobs` wrote."""
    return axolotl_dataset(path, type=KD_DATASET_TYPE, logprobs_field="logprobs")


def fitting_examples(tokenizer, rows: list[dict], sequence_len: int, limit: int | None = None):
    """(messages, token ids) of the rows whose whole conversation fits in ``sequence_len`` (the first
    ``limit`` of them). Longer rows are left out rather than truncated: axolotl aligns the teacher's
    log-probabilities from the end of the *untruncated* sequence and truncates after, so a truncated
    row would pair every position with the wrong teacher distribution."""
    out = []
    for row in rows:
        turns = messages(row)
        ids, _ = encode(tokenizer, turns, 1 << 30)
        if len(ids) <= sequence_len:
            out.append((turns, ids))
            if len(out) == limit:
                break
    return out


def teacher_logprobs(teacher, examples: list[tuple[list[dict], list[int]]], top_k: int, out: Path, label: str) -> None:
    """Write the teacher's top-k log-probabilities at every position of every example."""
    out.parent.mkdir(parents=True, exist_ok=True)
    progress = Progress(f"{label} teacher top-k log-probabilities", len(examples), log)
    with out.open("w", encoding="utf-8") as f, torch.inference_mode():
        for i, (turns, ids) in enumerate(examples):
            logp = torch.log_softmax(
                teacher(input_ids=torch.tensor([ids], device=teacher.device)).logits[0].float().cpu(), dim=-1
            )
            top = logp.topk(top_k, dim=-1)
            record = {
                "messages": turns,
                "target_token_ids": top.indices.tolist(),
                "logprobs": [[round(v, 5) for v in pos] for pos in top.values.tolist()],
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            progress.update(i + 1)
    progress.finish(len(examples))


def check_alignment(prepared: Path, scored: list[list[int]], label: str) -> None:
    """axolotl's tokenization of the distillation set must be the ids the teacher scored."""
    from datasets import load_from_disk

    dirs = [p.parent for p in prepared.rglob("dataset_info.json")]
    if not dirs:
        raise KibidangoError(f"{label}: axolotl preprocess wrote no dataset under {prepared}")
    prepared_ds = load_from_disk(str(dirs[0]))
    for i, row in enumerate(prepared_ds):
        if not len(row["input_ids"]) == len(row["target_logprobs"]) == len(row["target_token_ids"]):
            raise KibidangoError(
                f"{label}: prepared row {i} has {len(row['input_ids'])} tokens but {len(row['target_logprobs'])} "
                "teacher positions: axolotl would pair tokens with the wrong teacher distributions"
            )
    theirs = sorted(tuple(r) for r in prepared_ds["input_ids"])
    ours = sorted(tuple(r) for r in scored)
    if theirs != ours:
        diff = sum(a != b for a, b in zip(theirs, ours, strict=False)) + abs(len(theirs) - len(ours))
        raise KibidangoError(
            f"{label}: axolotl tokenized {diff} of {len(ours)} distillation rows differently from the ids the teacher "
            "scored; the teacher's log-probabilities would be misaligned. Check the chat template "
            "(methods/training/chat.py) and the tokenizer files of teacher and student."
        )
    log.info(f"{label}: axolotl's token ids match the teacher's on all {len(ours)} rows")
