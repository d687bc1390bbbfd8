"""One supervised fine-tune of a checkpoint on a chat JSONL file with axolotl, as stages 1A (SFT) and
1R (the retraining round) run it: the YAML saved beside the output, the training log copied, a LoRA
merged into the base when the recipe asks, and the base's own tokenizer files copied byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from methods.training import axolotl
from methods.training.chat import axolotl_dataset, axolotl_template
from methods.training.models import copy_tokenizer, merge_lora, tokenizer_type
from methods.training.recipe import PreferenceSpec, TrainRecipe

__all__ = ["fine_tune", "preference_recipe"]


def fine_tune(
    recipe: TrainRecipe,
    base: str | Path,
    data_file: Path,
    work_dir: Path,
    out_dir: Path,
    tier: str,
    label: str,
    tokenizer: str | None = None,
) -> tuple[Path, dict[str, float]]:
    """Train ``base`` on ``data_file`` (``{"messages": ...}`` rows); the model goes to
    ``out_dir/<tier>`` (or a peft adapter there, for an unmerged LoRA), ``axolotl.yaml`` and
    ``logs/train.log`` beside it. Returns the model directory and the last logged metrics."""
    spec = axolotl.render(
        recipe,
        str(base),
        [axolotl_dataset(str(data_file))],
        str(work_dir / "sft"),
        tokenizer_type=tokenizer or tokenizer_type(base),
        chat_template=axolotl_template(base),
    )
    (out_dir / "axolotl.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    last = axolotl.train(spec, work_dir / "sft", label, gpus=recipe.gpus)
    (out_dir / "logs").mkdir()
    shutil.copy2(work_dir / "sft" / "axolotl.log", out_dir / "logs" / "train.log")
    model_dir = out_dir / tier
    if recipe.adapter == "lora" and recipe.merge_lora:
        merge_lora(str(base), axolotl.trained_files(work_dir / "sft", work_dir / "adapter"), model_dir)
    else:
        axolotl.trained_files(work_dir / "sft", model_dir)
    copy_tokenizer(Path(base), model_dir)
    return model_dir, last


def preference_recipe(recipe: TrainRecipe, spec: PreferenceSpec, data_file: str) -> TrainRecipe:
    """``recipe`` as a preference run of :func:`fine_tune` on ``data_file`` (rows of
    :func:`methods.training.chat.preference_record`): axolotl's ``rl: dpo`` with TRL's losses ``sigmoid``
    and ``sft`` (weighted 1 and ``nll_weight``) and the file as an already-rendered ``passthrough``
    dataset, through the recipe's pass-through keys (which replace the chat dataset
    :func:`fine_tune` writes). ``group_by_length`` goes: TRL's preference rows have no ``input_ids``."""
    keys = {
        "datasets": [{"path": data_file, "ds_type": "json", "type": "passthrough", "split": "train"}],
        "rl": "dpo",
        "rl_beta": spec.beta,
        "dpo_loss_type": ["sigmoid", "sft"],
        "dpo_loss_weights": [1.0, spec.nll_weight],
        "group_by_length": False,
    }
    return recipe.model_copy(update={"axolotl": {**recipe.axolotl, **keys}})
