"""The task ladder (methods/ladder): deterministic by seed, levels rising in a measured difficulty,
every reference passing its own judge, parts fixed by the problem (never by wording, seed or
cut-off), and no evaluation task in anything stage 0, mining, teaching or training reads."""

from __future__ import annotations

import random
import statistics

import pytest

from methods.ladder import LEVELS, LadderSource, ladder_rows, ladder_tasks, part


def test_the_same_seed_gives_the_same_tasks_and_a_bigger_n_extends_a_smaller_one():
    for domain in LEVELS:
        for level in (1, LEVELS[domain]):
            small = ladder_tasks(domain, level, "train", 10, seed=3)
            assert small == ladder_tasks(domain, level, "train", 10, seed=3)
            assert ladder_tasks(domain, level, "train", 25, seed=3)[:10] == small
            other = ladder_tasks(domain, level, "train", 10, seed=4)
            assert [t.instruction for t in other] != [t.instruction for t in small]  # the seed words them


def test_a_problem_keeps_its_id_and_part_whatever_the_seed():
    for domain in LEVELS:
        by_id = {}
        for seed in range(4):
            for which in ("train", "mining", "evaluation"):
                for t in ladder_tasks(domain, 2, which, 60, seed):
                    assert t.part == which
                    assert by_id.setdefault(t.id, which) == which, t.id
        assert len(by_id) > 300


def test_parts_take_their_shares():
    from methods.curation.split import unit_hash  # noqa: F401  (the split's hash, as the benchmarks')

    keys = [f"3:{a}+{b}" for a in range(10, 100) for b in range(10, 60)]
    shares = {p: sum(part("math", k) == p for k in keys) / len(keys) for p in ("train", "mining", "evaluation")}
    assert shares["evaluation"] == pytest.approx(0.2, abs=0.02)
    assert shares["mining"] == pytest.approx(0.2, abs=0.02)


@pytest.mark.parametrize("domain", sorted(LEVELS))
def test_each_level_is_harder_than_the_one_below(domain):
    """Mean measured difficulty (math: single-digit operations; code: AST nodes of the reference)
    rises strictly with the level."""
    means = []
    for level in range(1, LEVELS[domain] + 1):
        tasks = [t for which in ("train", "mining") for t in ladder_tasks(domain, level, which, 60)]
        means.append(statistics.mean(t.difficulty for t in tasks))
    assert all(a < b for a, b in zip(means, means[1:])), means


def test_math_wording_varies_within_a_level():
    tasks = ladder_tasks("math", 5, "train", 80)
    openings = {t.instruction.split(" ")[1] for t in tasks}
    assert len(openings) >= 3  # several templates, not one sentence with new numbers
    assert len({t.instruction for t in tasks}) == len(tasks)


def test_every_math_reference_passes_the_math_judge():
    from methods.judges.math import MathJudge

    judge = MathJudge()
    for level in range(1, LEVELS["math"] + 1):
        for t in ladder_tasks("math", level, "evaluation", 40) + ladder_tasks("math", level, "train", 40):
            assert judge(t.task, t.output).passed, (t.id, t.output)
            wrong = t.output.rsplit("#### ", 1)[0] + f"#### {int(t.output.rsplit('#### ', 1)[1]) + 1}"
            assert not judge(t.task, wrong).passed


def test_every_code_reference_passes_its_own_tests_in_the_sandbox():
    """Two tasks per level through the real code judge (bubblewrap), and a wrong program fails."""
    from methods.judges.code import CodeJudge

    judge = CodeJudge(weak_sandbox_ok=True)
    for level in range(1, LEVELS["code"] + 1):
        for t in ladder_tasks("code", level, "evaluation", 2):
            verdict = judge(t.task, t.output)
            assert verdict.passed, (t.id, verdict.reason, t.output, t.task.tests)
            assert len(t.task.tests) >= 3 and t.task.tests[0] in t.input  # the prompt shows one test
            name = t.output.split("(")[0].removeprefix("def ")
            assert not judge(t.task, f"def {name}(v):\n    return None\n").passed


def test_code_tests_tell_programs_apart():
    """Three tests with three different expected values (drawn again until they differ), so a
    program that returns one constant cannot pass."""
    for level in range(1, LEVELS["code"] + 1):
        tasks = ladder_tasks("code", level, "mining", 30)
        distinct = [len({test.rsplit("==", 1)[1] for test in t.task.tests[:3]}) == 3 for t in tasks]
        assert sum(distinct) >= 0.9 * len(tasks), level


def test_code_tests_fail_a_program_that_skips_a_step():
    """A loop's condition made always or never true, or the argument returned unchanged, fails
    at least one of the task's three tests (7-20% of loop tasks were passed by a program ignoring
    its filter before the generator drew again on its mutants)."""
    import re

    def passes(code: str, name: str, tests: tuple[str, ...]) -> bool:
        scope: dict = {"__builtins__": {"len": len, "max": max, "min": min, "sum": sum}}
        try:
            exec(code, scope)
            return all(eval(t.removeprefix("assert "), scope) for t in tests)
        except Exception:
            return False

    for level in range(1, LEVELS["code"] + 1):
        for t in ladder_tasks("code", level, "mining", 60):
            reference, tests = t.output, t.task.tests
            name = re.match(r"def (\w+)\((\w+)\)", reference)
            assert passes(reference, name[1], tests)
            mutants = [f"def {name[1]}({name[2]}):\n    return {name[2]}\n"]
            condition = re.search(r"if (.+):\n", reference)
            if condition and level >= 4:
                mutants += [reference.replace(condition[0], f"if {v}:\n", 1) for v in ("True", "False")]
            for mutant in mutants:
                assert not passes(mutant, name[1], tests), (level, reference, mutant)


def test_code_tests_fail_a_program_off_by_one_at_its_condition():
    """A condition's boundary moved (``x > k`` as ``x >= k`` or ``x > k+1``; ``x % k`` as ``x % (k+1)``)
    fails a test wherever it changes what the program returns on some input: on the three drawn
    tests alone 89% of level 3's such programs and about half of levels 4-6's passed."""
    import re

    from methods.ladder.programs import _boundary_mutants

    def run(code: str, name: str, value):
        scope: dict = {"__builtins__": {"len": len, "max": max, "min": min, "sum": sum}}
        exec(code, scope)
        return scope[name](value)

    tested = 0
    for level in range(3, LEVELS["code"] + 1):
        for t in ladder_tasks("code", level, "mining", 60):
            reference, tests = t.output, t.task.tests
            name = re.match(r"def (\w+)\(", reference)[1]
            probe = range(0, 70) if level == 3 else [[v] for v in range(0, 70)] + [[v, v + 1] for v in range(0, 70)]
            for mutant in _boundary_mutants(reference):
                if all(run(mutant, name, v) == run(reference, name, v) for v in probe):
                    continue  # the same program on these inputs: both branches agree at the boundary
                tested += 1
                scope: dict = {"__builtins__": {"len": len, "max": max, "min": min, "sum": sum}}
                exec(mutant, scope)
                assert not all(eval(x.removeprefix("assert "), scope) for x in tests), (level, reference, mutant)
    assert tested > 400


def test_a_stage0_ladder_source_reads_only_the_train_part_up_to_its_cut_off():
    from methods.curation.ingest import SourceSpec, read_source, source_digest

    spec = SourceSpec(
        name="ladder_math",
        format="ladder",
        domain="math",
        license="Apache-2.0",
        ladder={"domain": "math", "train_max_level": 3, "per_level": 30},
    )
    rows = list(read_source(spec))
    levels = {int(r.id.split("-")[2]) for r in rows}
    assert levels == {1, 2, 3} and len(rows) == 90
    train_ids = {t.id for level in (1, 2, 3) for t in ladder_tasks("math", level, "train", 30)}
    assert {r.id for r in rows} == train_ids
    held = {
        t.id for level in range(1, 8) for w in ("mining", "evaluation") for t in ladder_tasks("math", level, w, 200)
    }
    assert not held & {r.id for r in rows}
    assert source_digest(spec).startswith("ladder:")
    with pytest.raises(ValueError, match="exactly one of"):
        SourceSpec(name="x", path="a.json", format="ladder", domain="math", license="-", ladder=spec.ladder)
    with pytest.raises(ValueError, match="train_max_level"):
        LadderSource(domain="code", train_max_level=9, per_level=1)


def test_held_out_samples_take_the_mining_part_and_evaluation_the_evaluation_part(tmp_path):
    from methods.evaluation import EvalSample, evaluation_tasks
    from methods.heldout import HeldOutTasks, select_tasks

    cfg = HeldOutTasks.model_validate(
        {
            "samples": [{"name": "lm", "source": "ladder", "domain": "math", "levels": [1, 4, 7], "size": 31}],
            "judges": {"math": {"kind": "math"}},
        }
    )
    mined, _ = select_tasks(cfg, tmp_path, set())
    assert len(mined) == 31 and {r["level"] for r in mined} == {1, 4, 7}
    assert all(r["id"].startswith("ladder-math-") and r["domain"] == "math" for r in mined)
    mining_ids = {t.id for level in (1, 4, 7) for t in ladder_tasks("math", level, "mining", 400)}
    assert {r["id"] for r in mined} <= mining_ids

    sample = EvalSample(name="lm", source="ladder", domain="math", levels=[1, 4, 7], size=31)
    evaluated = evaluation_tasks([sample], seed=0, seen=set())
    assert len(evaluated) == 31 and not {r["id"] for r in evaluated} & {r["id"] for r in mined}
    with pytest.raises(ValueError, match="levels"):
        EvalSample(name="lm", source="ladder", domain="code", levels=[7], size=1)
    with pytest.raises(ValueError, match="path"):
        EvalSample(name="lm", source="ladder", domain="code", levels=[1], size=1, path="x.jsonl")


def test_ladder_rows_spread_a_size_over_levels():
    rows = ladder_rows("code", [2, 3, 5], "mining", 8)
    assert [r["level"] for r in rows] == [2, 2, 2, 3, 3, 3, 5, 5]


def test_level_problems_are_distinct_and_subtractions_never_go_negative():
    from methods.ladder.arithmetic import problem

    rng = random.Random(0)
    for level in range(1, LEVELS["math"] + 1):
        for _ in range(200):
            p = problem(level, rng)
            assert p.answer >= 0 and all(r >= 0 for *_, r in p.steps)


def test_worked_steps_are_single_digit_facts_whose_columns_spell_the_result():
    import re

    from methods.ladder.arithmetic import problem, worked_step

    assert worked_step("+", 3, 4, 7) == "3 + 4 = 7"
    assert worked_step("+", 37, 45, 82) == "37 + 45: 7 + 5 = 12, 3 + 4 + 1 = 8, so 37 + 45 = 82"
    assert worked_step("-", 82, 18, 64) == "82 - 18: 12 - 8 = 4, 8 - 1 - 1 = 6, so 82 - 18 = 64"
    assert worked_step("*", 6, 23, 138) == "6 * 23: 6 * 3 = 18, 6 * 2 + 1 = 13, so 6 * 23 = 138"
    fact = re.compile(r"(\d+) ([-+*]) (\d)(?: ([-+]) (\d))? = (\d+)")
    rng = random.Random(1)
    for level in range(1, LEVELS["math"] + 1):
        for _ in range(300):
            p = problem(level, rng)
            for op, a, b, result in p.steps:
                line = worked_step(op, a, b, result)
                if a < 10 and b < 10:
                    continue
                columns = line.split(": ", 1)[1].split(", so ")[0].split(", ")
                digits = ""
                for i, column in enumerate(columns):
                    x, o, y, o2, c, value = fact.fullmatch(column).groups()
                    assert int(x) < 20 and o == op  # one column: a digit (plus a borrowed ten)
                    assert eval(f"{x} {o} {y}" + (f" {o2} {c}" if o2 else "")) == int(value)
                    last = i == len(columns) - 1
                    digits = (value if last else value[-1]) + digits
                assert int(digits) == result and line.endswith(f"so {a} {op} {b} = {result}")
