"""Judges: does an answer solve its task? One interface, ``judge(task, answer) -> Verdict``, and
one kind per way of knowing:

- ``math`` (:mod:`methods.judges.math`): the final number against the reference, exactly;
- ``code`` (:mod:`methods.judges.code`): the program run against the task's tests in a sandbox;
- ``reference`` (:mod:`methods.judges.reference`): chrF against the gold answer, with a threshold;
- ``llm`` (:mod:`methods.judges.llm`): a rubric prompt to an OpenAI-compatible endpoint, the reply
  parsed as JSON against a schema.

Judges are pure library code: stages (failure mining, critique filtering, gates) and evaluation
scripts build one with :func:`make_judge` from a recipe's settings
(:mod:`methods.judges.settings`: one typed model per kind).
"""

from __future__ import annotations

from methods.judges.base import Judge, Task, Verdict

__all__ = ["KINDS", "Judge", "Task", "Verdict", "make_judge", "make_judges", "sandbox_note"]

KINDS = ("math", "code", "reference", "llm")


def _class(kind: str) -> type:
    if kind == "math":
        from methods.judges.math import MathJudge

        return MathJudge
    if kind == "code":
        from methods.judges.code import CodeJudge

        return CodeJudge
    if kind == "reference":
        from methods.judges.reference import ReferenceJudge

        return ReferenceJudge
    if kind == "llm":
        from methods.judges.llm import LLMJudge

        return LLMJudge
    raise ValueError(f"unknown judge kind {kind!r}; known: {', '.join(KINDS)}")


def make_judge(kind_or_settings, **settings) -> Judge:
    """A judge from typed settings (:data:`methods.judges.settings.JudgeSettings`), or from a kind
    (one of :data:`KINDS`) and its settings, which are checked the same way."""
    from methods.judges.settings import judge_settings

    spec = judge_settings(
        kind_or_settings if not isinstance(kind_or_settings, str) else {"kind": kind_or_settings, **settings}
    )
    return _class(spec.kind)(**spec.model_dump(exclude={"kind"}))


def make_judges(specs: dict) -> dict[str, Judge]:
    """One judge per domain from a recipe's ``judges`` table (domain -> settings)."""
    return {domain: make_judge(spec) for domain, spec in specs.items()}


def sandbox_note(specs: dict) -> str:
    """One sentence for a stage's card: where the code judge of a recipe's ``judges`` table ran
    answers (bubblewrap, or the weaker fallback the recipe opted into), or "" when none runs code."""
    if not any(j.kind == "code" for j in specs.values()):
        return ""
    from methods.judges.code import isolation

    iso = isolation()
    if iso["kind"] == "bubblewrap":
        uid = "a uid of its own per sandbox" if iso["own_uid"] else "uid 65534 shared by every sandbox"
        memory = (
            f"a memory and process limit per answer (cgroup v{iso['cgroup']})"
            if iso["cgroup"]
            else "a memory limit per process (no cgroup here)"
        )
        return (
            "Code answers ran in bubblewrap (own PID, network and mount namespaces, a read-only root and a private "
            f"size-capped /tmp, {uid}, {memory}, rlimits; the tests in a second sandbox; a sandbox that failed is run "
            "again, and a verdict it never gave is counted apart as a judge error; docs/security.md)."
        )
    return (
        "Code answers ran in the WEAKER FALLBACK sandbox (bubblewrap could not run; the recipe set weak_sandbox_ok): "
        f"unshare network namespace {iso['network_namespace']}, user nobody {iso['user_nobody']}, an audit hook."
    )
