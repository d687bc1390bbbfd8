"""`python -m eval.ladder_pass`: a checkpoint's held-out math-ladder answers, judged per level."""

from __future__ import annotations

import pytest

from eval.shared_data import SHARED
from methods.ladder import ladder_rows

STORIES = SHARED / "models" / "stories260K" / "hf"


def test_ladder_pass_judges_each_levels_tasks_of_the_part_asked(capsys):
    if not STORIES.is_dir():
        pytest.skip(f"needs {STORIES} (../shared)")
    from eval.ladder_pass import main, pass_rates

    passed = pass_rates(str(STORIES), [1, 2], 3, max_new_tokens=4, part="evaluation")
    assert {level: len(v) for level, v in passed.items()} == {1: 3, 2: 3}
    assert all(isinstance(ok, bool) for v in passed.values() for ok in v)
    assert len(ladder_rows("math", [1, 2], "evaluation", 6)) == 6  # the same tasks the table counts
    # the default, for choosing a recipe, reads none of stage 9's evaluation tasks
    mining = {r["id"] for r in ladder_rows("math", [1, 2], "mining", 40)}
    assert mining and not mining & {r["id"] for r in ladder_rows("math", [1, 2], "evaluation", 40)}
    main([str(STORIES), "--levels", "1", "--per-level", "2", "--threads", "1"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| model | L1 |") and table[2].startswith(f"| {STORIES} | ") and "/2 [" in table[2]
