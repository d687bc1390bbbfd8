"""Near-duplicate detection: the acceptance figure (recall >= 0.95 at precision >= 0.99 on
planted near-duplicates) and behaviour on hand-made rows."""

from __future__ import annotations

import random

from eval.dedup_quality import EDITS, evaluate_planted
from eval.shared_data import instruction_texts
from methods.curation.dedup import DedupConfig, find_duplicates
from tests.conftest import needs_shared


def test_exact_and_near_duplicates_keep_the_first_row():
    rows = [
        "Once upon a time a small fox lived near the river and liked to watch the boats go by every day.",
        "ONCE upon a time,   a small fox lived near the river and liked to watch the boats go by every day!",
        "Every day a small fox who lived near the river liked to watch the boats go by, once upon a time.",
        "Explain how photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen.",
        "A small fox lived near the river and really liked to watch the boats go by every day once upon a time.",
    ]
    dups = {d.index: (d.kept, d.reason) for d in find_duplicates(rows, DedupConfig())}
    assert dups[1] == (0, "exact_duplicate")  # case, punctuation, whitespace
    assert dups[4] == (0, "near_duplicate")
    assert 3 not in dups and 0 not in dups


def test_every_edit_kind_yields_a_near_duplicate():
    rng = random.Random(1)
    text = (
        "To bake bread, mix flour, water, salt and yeast into a dough. Knead it for ten minutes until it is smooth. "
        "Let it rise for an hour in a warm place. Shape the loaf, let it rise again, and bake it at 220 degrees."
    )
    for kind, edit in EDITS.items():
        copy = edit(rng, text)
        assert copy != text
        assert [d.kept for d in find_duplicates([text, copy], DedupConfig())] == [0], kind


def test_planted_near_duplicates_recall_and_precision():
    needs_shared()
    texts = random.Random(0).sample(instruction_texts(), 2000)
    result = evaluate_planted(texts, DedupConfig(), n_copies=1000, seed=0)
    print(f"recall {result.recall:.4f} precision {result.precision:.4f} by edit {result.recall_by_edit}")
    assert result.recall >= 0.95
    assert result.precision >= 0.99


def test_the_precision_figure_can_fail():
    """A threshold far too low merges unrelated rows: the evaluation must show it."""
    needs_shared()
    texts = random.Random(0).sample(instruction_texts(), 1000)
    result = evaluate_planted(texts, DedupConfig(threshold=0.15), n_copies=500, seed=0)
    assert result.precision < 0.99
