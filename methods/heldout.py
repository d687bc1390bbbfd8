"""Held-out tasks and the judges that grade answers to them, as one typed recipe section, and the
one resumable answer-and-judge loop of the stages that use it (1B failure mining, 2G
calibration, 9 evaluation).

- :class:`HeldOutSample` and :class:`HeldOutTasks`: what the student or target answers — the
  **mining** half of the verifiable benchmarks or stage 0's held-out rows
  (:func:`select_tasks`) — and, per domain, the judge (:data:`methods.judges.settings.JudgeSettings`,
  a tagged union per judge kind); :class:`Judged` is the judges part alone (stage 9 takes the
  benchmarks' evaluation halves: :class:`methods.evaluation.EvalSample`);
- :func:`answer_and_judge`: every task answered and judged once, appended to the work directory's
  ``rows.jsonl`` as it finishes (:class:`methods.failures.RowLog`): a killed attempt's rerun answers
  only the tasks not there, and again only those whose judge was unreachable (``retryable``), so a
  paid judge call is never repeated for an answer it graded. With ``parallel`` > 1 up to that many
  tasks are answered and judged at once, on threads (the answer callback must be thread-safe: an
  :class:`methods.measure.generate.Answerer` with ``parallel`` batches their decoding, and bounds
  it: twice as many threads run, so that judging one answer does not leave a slot of the batch
  idle); each row is written as it finishes (a long answer holds back no other's), and the list
  returned follows ``rows``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from core.contract import StageConfig
from core.progress import Progress
from methods.benchmarks import load_tasks
from methods.curation.split import BENCHMARKS
from methods.failures import RowLog, row_key, sample
from methods.judges import Task, make_judges
from methods.judges.settings import JudgeSettings
from methods.ladder import LEVELS, check_levels, ladder_rows
from methods.training.chat import load_split, prompt_text

__all__ = [
    "Band",
    "HeldOutSample",
    "HeldOutTasks",
    "Judged",
    "answer_and_judge",
    "band_rows",
    "choose_band",
    "levels_above",
    "parallel_field",
    "select_tasks",
]

log = logging.getLogger("kibidango.heldout")


def parallel_field():
    """A stage's ``parallel``: answers decoded together (:func:`answer_and_judge`)."""
    return Field(
        1,
        ge=1,
        le=64,
        description="Answers decoded together, batched (1: one at a time; greedy answers may differ at near-ties).",
    )


class Band(StageConfig):
    """Where a ladder sample mines: the levels at which the student passes between ``low`` and
    ``high`` of its tasks — it fails there often enough to be taught and passes often enough to
    learn from a correction — found by answering ``probe`` mining tasks of every level first."""

    low: float = Field(0.1, ge=0, le=1, description="The lowest pass rate of a level in the band.")
    high: float = Field(0.9, ge=0, le=1, description="The highest pass rate of a level in the band.")
    probe: int = Field(12, ge=1, description="Mining tasks per level answered to measure the pass rates.")
    above: int = Field(
        0,
        ge=0,
        description="Levels just above the band's highest that are mined too (not part of the band): where the "
        "student almost never passes, so the teachers above its own samples teach what the evaluation's level above "
        "the band tests.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Band:
        if self.low > self.high:
            raise ValueError(f"band: low {self.low} is above high {self.high}")
        return self


def choose_band(rates: dict[int, tuple[int, int]], band: Band) -> list[int]:
    """The levels whose pass rate (``rates``: level -> (passed, answered)) lies in [low, high];
    when none does, the level(s) nearest that range (the lowest of equals): a student that passes
    nothing is taught where it is closest to passing."""

    def rate(level: int) -> float:
        passed, n = rates[level]
        return passed / n if n else 0.0

    levels = sorted(rates)
    inside = [lv for lv in levels if band.low <= rate(lv) <= band.high]
    if inside or not levels:
        return inside
    distance = {lv: max(band.low - rate(lv), rate(lv) - band.high) for lv in levels}
    return [min(levels, key=lambda lv: (distance[lv], lv))]


def levels_above(band: list[int], above: int, top: int) -> list[int]:
    """The ``above`` levels just above ``band``'s highest, up to the ladder's ``top`` level."""
    return list(range(max(band) + 1, min(max(band) + above, top) + 1)) if band else []


def band_rows(
    domain: str, levels: list[int], probe: int, size: int, seed: int, exclude: frozenset[str] = frozenset()
) -> list[dict]:
    """A band's mining rows: ``size`` tasks beyond the ``probe`` tasks of each of its ``levels``
    (those come first: the same tasks the probe answered), less ``exclude``."""
    return ladder_rows(domain, levels, "mining", probe * len(levels) + size, seed, exclude)


class HeldOutSample(StageConfig):
    name: str = Field(description="Label of this sample in the table and the metrics.")
    source: Literal["gsm8k", "mbpp", "humaneval", "stage0", "ladder"] = Field(
        description="A benchmark's mining half, stage 0's held-out rows (`domain`), or the task ladder's mining "
        "part (`domain` math or code, `levels`; methods/ladder)."
    )
    path: str | None = Field(None, description="The benchmark's task file (a benchmark source only).")
    domain: str | None = Field(
        None, description="stage0: the stage-0 domain to sample; ladder: math or code; benchmarks: their own."
    )
    levels: list[int] | None = Field(None, description="ladder: the levels to draw from, `size` spread evenly.")
    band: Band | None = Field(
        None,
        description="ladder, instead of `levels`: mine where the student sits between band.low and band.high, "
        "found by a probe of every level (then `size` more tasks spread over the band's levels).",
    )
    size: int = Field(gt=0, description="Rows to test (fewer when fewer are held out).")
    optional: bool = Field(True, description="Skip with a warning when the benchmark file is absent.")

    @model_validator(mode="after")
    def _where(self) -> HeldOutSample:
        if self.source in ("stage0", "ladder"):
            if not self.domain or self.path:
                raise ValueError(f"sample {self.name!r}: a {self.source} sample names a `domain` and no `path`")
            if self.source == "ladder" and self.band is None:
                check_levels(self.name, self.domain, self.levels)
            if self.band is not None and (self.source != "ladder" or self.levels is not None):
                raise ValueError(f"sample {self.name!r}: a `band` is a ladder sample's, instead of its `levels`")
        elif not self.path:
            raise ValueError(f"sample {self.name!r}: benchmark {self.source} needs its `path`")
        if self.levels is not None and self.source != "ladder":
            raise ValueError(f"sample {self.name!r}: only a ladder sample has `levels`")
        return self

    @property
    def sample_domain(self) -> str:
        return self.domain or BENCHMARKS[self.source]["domain"]


class Judged(StageConfig):
    """A recipe's ``judges``: per domain, the judge of its answers (``{kind: math|code|reference|llm,
    ...its settings}``; llm: base_url, model and api_key_env — the variable's name, never the key).
    Subclasses name their samples' domains (:meth:`domains`); each must have a judge."""

    judges: dict[str, JudgeSettings] = Field(
        description="Per domain, the judge: {kind: math|code|reference|llm, ...its settings} (methods/judges)."
    )

    def domains(self) -> dict[str, str]:
        """Sample name -> its domain."""
        return {}

    @model_validator(mode="after")
    def _every_domain_judged(self) -> Judged:
        for name, domain in self.domains().items():
            if domain not in self.judges:
                raise ValueError(f"sample {name!r}: no judge for its domain {domain!r} in `judges`")
        return self


class HeldOutTasks(Judged):
    samples: list[HeldOutSample] = Field(min_length=1, description="What is answered and judged.")
    held_out_splits: list[str] = Field(["validation", "test"], description="Stage-0 splits stage0 samples draw from.")
    max_new_tokens: int = Field(128, gt=0, description="Tokens per answer.")
    parallel: int = parallel_field()
    seed: int = Field(0, description="Which rows a sample of a given size takes.")

    def domains(self) -> dict[str, str]:
        return {s.name: s.sample_domain for s in self.samples}

    @model_validator(mode="after")
    def _code_needs_tests(self) -> HeldOutTasks:
        for s in self.samples:
            if s.source == "stage0" and self.judges[s.sample_domain].kind == "code":
                raise ValueError(f"sample {s.name!r}: stage-0 rows carry no tests; the code judge needs a benchmark")
        return self


def select_tasks(
    cfg: HeldOutTasks, data: Path, seen: set[str], exclude: frozenset[str] = frozenset()
) -> tuple[list[dict], dict[str, int]]:
    """The held-out tasks of ``cfg.samples`` (stage-0 held-out splits ``cfg.held_out_splits`` or
    benchmark files), ``cfg.seed`` choosing which, in a fixed order, none of ``exclude`` (task ids an
    earlier round answered); and per sample how many were left out as seen in training (``seen``:
    :func:`methods.failures.training_texts`)."""
    rows: list[dict] = []
    excluded: dict[str, int] = {}
    taken: set[str] = set()
    for s in cfg.samples:
        if s.source == "stage0":
            pool = []
            for split in cfg.held_out_splits:
                for r in load_split(data, split, s.sample_domain):
                    if not r["instruction"]:  # a plain text (a story) is no task to answer
                        continue
                    task = Task(r["id"], prompt_text(r["instruction"], r["input"]), r["output"])
                    pool.append({"id": r["id"], "instruction": r["instruction"], "input": r["input"], "task": task})
            excluded[s.name] = 0
        elif s.source == "ladder":  # the mining part: no stage-0 source reads it (methods/ladder)
            if s.band is not None:  # the probe: `probe` tasks of every level (the band is chosen on them)
                every = list(range(1, LEVELS[s.domain] + 1))
                pool = ladder_rows(s.domain, every, "mining", s.band.probe * len(every), cfg.seed, exclude)
            else:
                pool = ladder_rows(s.domain, s.levels, "mining", s.size, cfg.seed, exclude)
            excluded[s.name] = 0
            rows += [{**r, "sample": s.name, "source": s.source, "domain": s.sample_domain} for r in pool]
            if len(pool) < s.size and s.band is None:
                log.warning(f"sample {s.name!r}: {len(pool)} ladder tasks, fewer than its size {s.size}")
            continue
        else:
            if not Path(s.path).is_file():
                log.warning(f"sample {s.name!r}: {s.path} is absent; skipped (optional)")
                continue
            pool, excluded[s.name] = [], 0
            for bt in load_tasks(s.source, s.path, "mining"):
                instruction, input_ = bt.instruction()
                if row_key(instruction, input_) in seen:
                    excluded[s.name] += 1  # curated into training by stage 0: not held out
                    continue
                pool.append({"id": bt.id, "instruction": instruction, "input": input_, "task": bt.task})
        ranked = sample(pool, None, cfg.seed, key=lambda r: r["id"])
        chosen = [r for r in ranked if r["id"] not in taken and r["id"] not in exclude][: s.size]
        if len(chosen) < s.size:
            log.warning(f"sample {s.name!r}: {len(chosen)} held-out rows, fewer than its size {s.size}")
        for r in chosen:
            taken.add(r["id"])
            rows.append({**r, "sample": s.name, "source": s.source, "domain": s.sample_domain})
    return rows, excluded


Answer = Callable[[dict, dict | None, Callable], dict]
"""``answer(row, prior, judge) -> record``: answers one task and judges it with ``judge`` (its
domain's judge); ``prior`` is the record an earlier attempt left when its judge was unreachable
(None otherwise), so its answer can be judged again rather than generated again. The record holds
``id`` and ``retryable``."""


def answer_and_judge(
    judges: Judged | dict, rows: list[dict], work_dir: Path, label: str, answer: Answer, parallel: int = 1
) -> tuple[list[dict], int]:
    """Every row answered and judged (see the module), in ``rows``' order; and how many rows an
    earlier attempt had finished. ``judges``: a recipe's judges section, or judges already built
    (:func:`methods.failures.mined_judges`); ``label`` names the progress lines (``"9 answers"``);
    ``parallel``: tasks in flight at once."""
    if isinstance(judges, Judged):
        judges = make_judges(judges.judges)
    done = RowLog(work_dir / "rows.jsonl")
    if done.resumed:
        log.info(f"{label}: {done.resumed:,} tasks already answered (by an earlier attempt, or an earlier pass)")
    todo = [(row, done.get(row["id"])) for row in rows]
    todo = [(row, prior) for row, prior in todo if prior is None or prior.get("retryable")]
    progress = Progress(label, len(rows), log)
    finished = len(rows) - len(todo)  # rows an earlier attempt settled
    # Twice as many threads as answers decoded together: the answer callbacks hold their decoding
    # slot only while they decode (a batcher's turn), so while some judge an answer (a sandboxed
    # program: seconds), others fill their slots and the batch stays full.
    pool = ThreadPoolExecutor(2 * parallel, thread_name_prefix="answer") if parallel > 1 else None
    try:
        if pool is None:
            for row, prior in todo:
                done.add(answer(row, prior, judges[row["domain"]]))
                finished += 1
                progress.update(finished)
        else:
            # each row journaled as it finishes, not in the rows' order: a long answer holds back
            # neither the progress line nor what a killed run keeps of the answers after it
            futures = [pool.submit(answer, row, prior, judges[row["domain"]]) for row, prior in todo]
            for future in as_completed(futures):
                done.add(future.result())
                finished += 1
                progress.update(finished)
        progress.finish(len(rows))
    finally:
        if pool is not None:  # after an error: the tasks not started are dropped, those running finish
            pool.shutdown(wait=True, cancel_futures=True)
        done.close()
    return [done.get(r["id"]) for r in rows], done.resumed
