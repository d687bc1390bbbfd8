"""Evaluation on held-out tasks no stage trains or mines on: the **evaluation** parts of the
verifiable benchmarks (:func:`methods.benchmarks.part`; failure mining, the teachers and the
retraining round read only the mining parts, and stage 0 never reads an evaluation row) and, for
general instructions, self-instruct's human-written seed tasks (``shared/data/alpaca_seed``), which
no stage reads, less any whose text stage 0 holds; and the evaluation part of the task ladder
(:mod:`methods.ladder`), per level.

- :class:`EvalSample` and :func:`evaluation_tasks`: which tasks a recipe's samples take
  (deterministic by seed; a bigger sample contains the smaller one);
- :func:`wilson`: the Wilson score interval of a pass rate (sound at 0 and 1 and for small n,
  where the normal approximation is not);
- :func:`mcnemar`: the exact McNemar test of two models' pass/fail on the same tasks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from core.contract import KibidangoError, StageConfig
from methods.benchmarks import BENCHMARKS, load_tasks
from methods.failures import row_key, sample
from methods.judges import Task
from methods.ladder import LEVELS, check_levels, ladder_rows
from methods.training.chat import prompt_text

__all__ = ["EvalSample", "evaluation_tasks", "mcnemar", "seed_tasks", "wilson"]

SEED_TASKS_DOMAIN = "general"


class EvalSample(StageConfig):
    name: str = Field(description="Name of the sample in tables and metric keys (eval/<model>/<name>).")
    source: Literal["gsm8k", "mbpp", "humaneval", "alpaca_seed", "ladder"] = Field(
        description="A benchmark (its evaluation part), self-instruct's seed tasks (general, reference judge), "
        "or the task ladder's evaluation part (methods/ladder)."
    )
    path: str | None = Field(None, description="The file (../shared/data/...); not for the ladder.")
    domain: Literal["math", "code"] | None = Field(None, description="ladder: which rungs (the others: their own).")
    levels: list[int] | None = Field(None, description="ladder: the levels, `size` spread evenly over them.")
    band: str | None = Field(
        None,
        description="ladder, instead of `levels`: the levels of the band stage 1B chose for its sample of this name "
        "(the `mined` input), and `above` levels over it, `size` spread over them; `rest` tasks at each other level.",
    )
    above: int = Field(1, ge=0, description="band: levels above the band evaluated with it.")
    rest: int = Field(0, ge=0, description="band: tasks at each level outside it (where every arm may score 0).")
    size: int = Field(gt=0, description="Tasks to evaluate (fewer when the file has fewer).")
    seen_by_base: str | None = Field(
        None,
        description="Why these tasks are not held out for this preset's starting point (a base model trained "
        "on the file before this pipeline saw it); the card and the report print it beside the figures.",
    )

    @model_validator(mode="after")
    def _where(self) -> EvalSample:
        if self.source == "ladder":
            if self.path is not None:
                raise ValueError(f"evaluation sample {self.name!r}: the ladder is generated; it has no `path`")
            if (self.band is None) == (self.levels is None):
                raise ValueError(f"evaluation sample {self.name!r}: a ladder sample takes `levels` or a `band`")
            if self.band is None:
                check_levels(self.name, self.domain, self.levels)
            elif self.domain not in LEVELS:
                raise ValueError(f"evaluation sample {self.name!r}: ladder domain {self.domain!r} is not math or code")
        elif self.path is None or self.domain is not None or self.levels is not None:
            raise ValueError(f"evaluation sample {self.name!r}: {self.source} takes a `path` (and no ladder fields)")
        return self

    @property
    def sample_domain(self) -> str:
        if self.source == "ladder":
            return self.domain
        return BENCHMARKS[self.source]["domain"] if self.source in BENCHMARKS else SEED_TASKS_DOMAIN


def _band_tasks(s: EvalSample, band: list[int] | None, seed: int) -> list[dict]:
    """A band sample's evaluation tasks: ``size`` over the band and ``above`` levels over it,
    ``rest`` at each other level of the domain."""
    if not band:
        raise KibidangoError(
            f"evaluation sample {s.name!r}: no band {s.band!r} from stage 1B (wire it as input `mined`, with a ladder "
            "sample of that name that has a `band`)"
        )
    top = min(LEVELS[s.domain], max(band) + s.above)
    focus = sorted(set(band) | set(range(max(band) + 1, top + 1)))
    others = [lv for lv in range(1, LEVELS[s.domain] + 1) if lv not in focus]
    rows = ladder_rows(s.domain, focus, "evaluation", s.size, seed)
    if s.rest and others:
        rows += ladder_rows(s.domain, others, "evaluation", s.rest * len(others), seed)
    return sorted(rows, key=lambda r: r["level"])


def mined_bands(mined: Path | None) -> dict[str, list[int]]:
    """The bands stage 1B chose (its ``mining.json``), by sample name; {} without that input."""
    if mined is None or not (mined / "mining.json").is_file():
        return {}
    bands = json.loads((mined / "mining.json").read_text()).get("bands", {})
    return {name: [int(level) for level in b["levels"]] for name, b in bands.items()}


def mcnemar_power(n: int, gain: float, discordance: float, alpha: float = 0.01) -> float:
    """The chance that an exact McNemar test (two-sided, at ``alpha``) on ``n`` paired tasks detects
    a pass-rate ``gain`` when a share ``discordance`` of the tasks come out differently under the
    two arms: discordant tasks ~ Binomial(n, discordance), of which the better arm's ~
    Binomial(k, (discordance + gain) / (2 discordance)). Sizes an evaluation before it runs."""
    import numpy as np
    from scipy.stats import binom

    if not 0 < discordance <= 1 or not 0 <= gain <= discordance:
        raise ValueError(f"need 0 <= gain ({gain}) <= discordance ({discordance}) <= 1")
    share = (discordance + gain) / (2 * discordance)
    k = np.arange(1, n + 1)
    # the fewest wins of the better arm among k discordant tasks that reject: 2 P(X >= a) <= alpha
    wins = binom.isf(alpha / 2, k, 0.5) + 1
    reject = binom.sf(wins - 1, k, share) * (2 * binom.sf(wins - 1, k, 0.5) <= alpha)
    return float(np.sum(binom.pmf(k, n, discordance) * reject))


def wilson(passes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of ``passes`` out of ``n``."""
    if n <= 0:
        return 0.0, 1.0
    p = passes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar(a: dict[str, bool], b: dict[str, bool], alternative: str = "two-sided") -> dict:
    """The exact McNemar test of ``a`` vs ``b`` (task id -> passed) on the tasks both have: the
    discordant counts (``a_only``: a passed and b failed; ``b_only``: the reverse) and the p-value of
    the binomial test that they are equally likely (scipy's ``binomtest``; ``alternative="greater"``:
    one-sided, that ``a`` passes more; 1.0 when no task is discordant)."""
    from scipy.stats import binomtest

    both = sorted(set(a) & set(b))
    a_only = sum(1 for t in both if a[t] and not b[t])
    b_only = sum(1 for t in both if b[t] and not a[t])
    p = binomtest(a_only, a_only + b_only, 0.5, alternative=alternative).pvalue if a_only + b_only else 1.0
    return {"n": len(both), "a_only": a_only, "b_only": b_only, "p": float(p)}


def seed_tasks(path: Path, seen: set[str]) -> list[dict]:
    """Self-instruct's seed tasks (first instance each) as ``{id, instruction, input, task}``, in file
    order, less those whose text is in ``seen``; a malformed line is an error naming it."""
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            instance = rec["instances"][0]
            instruction, input_, output = rec["instruction"], instance["input"], instance["output"]
            tid = f"alpaca_seed/{rec['id']}"
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise KibidangoError(
                f"{path}:{n}: a self-instruct seed task needs id, instruction, instances[0] ({e})"
            ) from None
        if row_key(instruction, input_) in seen:
            continue
        rows.append(
            {
                "id": tid,
                "instruction": instruction,
                "input": input_,
                "task": Task(tid, prompt_text(instruction, input_), output),
            }
        )
    return rows


def evaluation_tasks(
    samples: list[EvalSample], seed: int, seen: set[str], bands: dict[str, list[int]] | None = None
) -> list[dict]:
    """The tasks of each sample, in a fixed order: ``{id, sample, source, domain, instruction,
    input, task}``. ``seen``: :func:`methods.failures.training_texts` of every stage-0 split (a
    seed task whose text stage 0 holds is left out). ``bands``: 1B's bands by sample name
    (:func:`mined_bands`), for samples with a ``band``. A missing file is an error naming it."""
    rows: list[dict] = []
    for s in samples:
        if s.source == "ladder":  # generated; its evaluation part is read by no other stage
            if s.band is not None:
                pool = _band_tasks(s, (bands or {}).get(s.band), seed)
            else:
                pool = ladder_rows(s.domain, s.levels, "evaluation", s.size, seed)
            rows += [{**r, "sample": s.name, "source": s.source, "domain": s.sample_domain} for r in pool]
            continue
        path = Path(s.path)
        if not path.is_file():
            raise KibidangoError(f"evaluation sample {s.name!r}: {path} not found")
        if s.source == "alpaca_seed":
            pool = seed_tasks(path, seen)
        else:
            pool = []
            for bt in load_tasks(s.source, path, "evaluation"):
                instruction, input_ = bt.instruction()
                pool.append({"id": bt.id, "instruction": instruction, "input": input_, "task": bt.task})
        for r in sample(pool, s.size, seed, key=lambda r: r["id"]):
            rows.append({**r, "sample": s.name, "source": s.source, "domain": s.sample_domain})
    return rows
