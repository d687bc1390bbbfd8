"""Stage 1T — stand-in teachers for presets that cannot reach a paid model: the student, trained
further on the task ladder's train part at **every** level, becomes the teacher tiers 1D serves
locally (llama-cpp-python's OpenAI-compatible server on 127.0.0.1) in place of cloud models.

Each tier is the 1A student fine-tuned for its own number of steps on the same mix (the ladder's
train part of the levels the recipe names, above the student's cut-off too, and ``stage0_rows``
rows of stage 0's train split): a longer-trained tier is a stronger one, so 1D's cascade has a
capability gradient below its gold tier. The student never trains on these rows; only the
teachers' answers to the failures 1B mined, judged and paid for by 1D, reach it (1R). No tier reads
the ladder's mining or evaluation part.

Outputs: ``<tier>/`` (transformers checkpoints with the family's tokenizer), ``logs/<tier>.log``,
``axolotl/<tier>.yaml``, ``teachers.json``.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from pathlib import Path

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from methods.failures import sample
from methods.ladder import LadderSource
from methods.training import axolotl
from methods.training.chat import axolotl_dataset, load_split, messages, write_jsonl
from methods.training.finetune import fine_tune
from methods.training.recipe import TrainRecipe

RESUMABLE = True
LIBRARIES = ("transformers", "torch")

log = logging.getLogger("kibidango.stage.1T")


class Config(StageConfig):
    tier: str = Field("target", description="Tier directory of the `student` input (stage 1A's output).")
    tokenizer_type: str | None = Field(None, description="axolotl tokenizer_type (None: from the student's files).")
    ladder: list[LadderSource] = Field(
        min_length=1, description="The ladder rows the teachers learn (train part; every level they should know)."
    )
    stage0_rows: int = Field(0, ge=0, description="Rows of stage 0's train split mixed in (a seeded sample).")
    seed: int = Field(0, description="Which stage-0 rows are drawn.")
    teachers: dict[str, TrainRecipe] = Field(
        min_length=1, description="Teacher tier name -> its fine-tune of the student (a longer one: a stronger tier)."
    )


def axolotl_configs(cfg: Config, cuda: bool) -> dict[str, dict]:
    return {
        name: axolotl.render(
            recipe,
            f"<stage 1A artifact>/{cfg.tier}",
            [axolotl_dataset("<work>/data/train.jsonl")],
            f"<work>/{name}",
            tokenizer_type=cfg.tokenizer_type,
            cuda=cuda,
        )
        for name, recipe in cfg.teachers.items()
    }


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    student = inputs["student"] / cfg.tier
    if not (student / "config.json").is_file():
        raise KibidangoError(f"the student input has no transformers checkpoint at {student}")
    rows = sample(load_split(inputs["data"] / "dataset", "train"), cfg.stage0_rows, cfg.seed, key=lambda r: r["id"])
    ladder = [t for source in cfg.ladder for t in source.rows()]
    rows += [{"instruction": t.instruction, "input": t.input, "output": t.output} for t in ladder]
    data_file = work_dir / "data" / "train.jsonl"
    write_jsonl(data_file, ({"messages": messages(r)} for r in rows))
    levels = Counter(f"{t.domain}/L{t.level}" for t in ladder)
    log.info(f"teacher data: {len(rows):,} rows ({len(ladder):,} ladder rows: {dict(sorted(levels.items()))})")

    (out_dir / "axolotl").mkdir()
    (out_dir / "logs").mkdir()
    stats = {"rows": len(rows), "ladder_rows": dict(sorted(levels.items())), "teachers": {}}
    metrics = {"rows": float(len(rows))}
    for name, recipe in cfg.teachers.items():
        run_out = work_dir / name / "out"
        if not (run_out / name / "config.json").is_file():  # a finished tier is not trained again on resume
            shutil.rmtree(run_out, ignore_errors=True)
            run_out.mkdir(parents=True)
            fine_tune(
                recipe, student, data_file, work_dir / name / "work", run_out, name, f"1T/{name}", cfg.tokenizer_type
            )
        shutil.copytree(run_out / name, out_dir / name)
        shutil.copy2(run_out / "logs" / "train.log", out_dir / "logs" / f"{name}.log")
        shutil.copy2(run_out / "axolotl.yaml", out_dir / "axolotl" / f"{name}.yaml")
        stats["teachers"][name] = {"steps": recipe.max_steps, "sequences": recipe.sequences_seen}
        metrics[f"{name}_steps"] = float(recipe.max_steps)
    (out_dir / "teachers.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
    summary = (
        f"{len(cfg.teachers)} stand-in teachers from the 1A student on {len(rows):,} rows "
        f"({len(ladder):,} of the ladder's train part, levels up to "
        + ", ".join(f"{s.domain} {s.train_max_level}" for s in cfg.ladder)
        + "): "
        + ", ".join(f"{n} {r.max_steps} steps" for n, r in cfg.teachers.items())
    )
    return StageResult(metrics, ["teachers.json", *[f"axolotl/{n}.yaml" for n in cfg.teachers]], summary)
