"""The reference judge: chrF (sacrebleu's implementation, character n-grams up to 6, word
bigrams: chrF++) of the answer against the gold answer, passed at ``threshold``. For open-ended
instructions whose answers can be right in other words, this is a weak signal: the recipe says
which domains use it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from methods.judges.base import Task, Verdict

__all__ = ["ReferenceJudge"]


@dataclass
class ReferenceJudge:
    threshold: float = 0.4
    word_order: int = 2
    kind: str = "reference"

    def __call__(self, task: Task, answer: str) -> Verdict:
        from sacrebleu.metrics import CHRF

        started = time.monotonic()
        if not task.reference.strip():
            return Verdict(
                False, 0.0, f"task {task.id} has no reference answer", "judge_error", time.monotonic() - started
            )
        score = CHRF(word_order=self.word_order).sentence_score(answer, [task.reference]).score / 100.0
        ok = score >= self.threshold
        reason = f"chrF++ {score:.3f} {'>=' if ok else '<'} threshold {self.threshold}"
        return Verdict(ok, score, reason, "passed" if ok else "failed", time.monotonic() - started)
