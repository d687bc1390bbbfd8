"""What `make demo` shows at the end of a run that exported a bundle: the bundle's size and
perplexity table (from its BUNDLE_CARD.md, i.e. from the stage metrics), the evaluation (stage 9)
and the quality gates' verdict (9A), held-out ladder tasks (one math, one code: the first of the
evaluation part at :data:`LADDER_LEVEL`, fixed, never picked for passing) and a self-instruct seed
task answered greedily by the shipped bundle in its chat template (the ladder's with the judge's
verdict beside each), and a story generated
with the runtime package and the bundle's own sampling defaults, as a user would run it."""

from __future__ import annotations

from pathlib import Path

from core.store import Artifact

__all__ = ["show_bundle"]

PROMPT = "Once upon a time"
SEED = 0
LADDER_LEVEL = 2


def _section(card: str, title: str) -> str:
    start = card.find(title)
    if start < 0:
        return ""
    end = card.find("\n## ", start + len(title))
    return card[start : end if end >= 0 else None].strip()


def show_bundle(artifacts: dict[str, Artifact]) -> None:
    shipped = [sid for sid in ("9A", "1F", "X") if sid in artifacts]  # gates stamp 1F's tuned copy of X's
    if not shipped:
        return
    from kibidango import Pipeline

    bundle = Path(artifacts[shipped[0]].path) / "bundle"
    packed = Path(artifacts["2E"].path) / "packed" if "2E" in artifacts else None
    card = (bundle / "BUNDLE_CARD.md").read_text()
    print(f"\n== the bundle ({bundle}) ==\n")
    print(_section(card, "## Sizes, perplexity and GGUF agreement per tier"))
    if "9" in artifacts:
        evaluation = Path(artifacts["9"].path) / "EVALUATION_CARD.md"
        print(f"\n== evaluation on held-out tasks, greedy ({evaluation}) ==\n")
        print(evaluation.read_text().split("\n", 2)[2].strip())
    if "9A" in artifacts:
        gates = Path(artifacts["9A"].path) / "GATES_CARD.md"
        print(f"\n== quality gates ({gates}) ==\n")
        print(gates.read_text().split("\n", 2)[2].strip())
    source = packed or bundle
    from kibidango.bundle import load_bundle, resolve_backend

    shipped = load_bundle(bundle, verify=False)
    backend = resolve_backend(shipped, "auto")  # the profile's (stage 9A)
    if backend == "torch" and shipped.tiers["target"].gguf is not None:
        try:  # a full bundle: llama.cpp where it is installed
            import llama_cpp  # noqa: F401

            backend = "llamacpp"
        except ImportError:
            pass
    pipe = Pipeline.from_bundle(source, backend=backend)
    _show_instruction(pipe, source, backend, artifacts.get("9"))
    _show_ladder_tasks(pipe, source, backend)
    d = pipe.defaults
    result = pipe.generate(PROMPT, max_new_tokens=d.max_new_tokens, seed=SEED)
    m = result.metrics.to_dict()
    print(
        f"\n== a story from {'the packed bundle ' if packed else ''}{source} "
        f'(kibidango generate --bundle {source} --backend {backend} --seed {SEED} "{PROMPT}") ==\n'
    )
    # the prompt and the story decoded as one text: decoded alone, a sentencepiece continuation loses the
    # space before its first word ("Once upon a timethere")
    print(pipe.tokenizer.decode(pipe.encode(PROMPT) + result.token_ids, skip_special_tokens=True))
    rates = ", ".join(f"{tier} {rate:.0%}" for tier, rate in m["draft_acceptance_rate"].items() if rate is not None)
    sampling = f"temperature {d.temperature:g}, top-p {d.top_p:g}" if d.temperature > 0 else "greedy"
    lossless = d.mode in ("ar", "sd", "lookup") or (d.mode == "pyramid" and d.variant == "exact")
    print(
        f"\n(the bundle's defaults: mode {d.mode} ({'lossless' if lossless else 'lossy: ' + d.variant}), {sampling}; "
        f"{len(result.token_ids)} tokens, acceptance {rates or '-'}, "
        f"mean acceptance length {m['mean_acceptance_length'] or 0:.2f}, target forwards per token "
        f"{m['target_forwards_per_token'] or 0:.2f})"
    )
    if m["domain"] is not None:  # the bundle's router (6A) and calibrator (2G) at work
        confidence = "-" if m["confidence"] is None else f"{m['confidence']:.3f}"
        print(
            f"(routed to {m['domain']} at {m['router_confidence']:.2f}, adapter {m['adapter'] or 'none'}; "
            f"calibrated confidence {confidence})"
        )


def _show_instruction(pipe, source: Path, backend: str, evaluation: Artifact | None) -> None:
    """The first self-instruct seed task of stage 9's general sample (read by no training stage),
    answered greedily by the bundle in its chat template."""
    from methods.evaluation import seed_tasks
    from methods.training.chat import prompt_ids

    samples = evaluation.manifest["config"].get("samples", []) if evaluation is not None else []
    paths = [Path(s["path"]) for s in samples if s.get("source") == "alpaca_seed" and s.get("path")]
    if not paths or not paths[0].is_file():
        return
    row = seed_tasks(paths[0], set())[0]
    query = row["task"].prompt
    ids = prompt_ids(pipe.tokenizer, [{"role": "user", "content": query}])
    result = pipe.generate(ids, query=query, max_new_tokens=128, temperature=0.0)
    print(
        f"\n== a held-out instruction ({row['id']}), answered greedily by {source} ({backend}) ==\n\n{query}"
        f"\n\n-- answer --\n{result.text.strip()}"
    )


def _show_ladder_tasks(pipe, source: Path, backend: str) -> None:
    """One held-out math and one code task of the ladder, answered by the bundle and judged."""
    from methods.judges import make_judge
    from methods.ladder import ladder_tasks
    from methods.training.chat import prompt_ids

    for domain in ("math", "code"):
        (task,) = ladder_tasks(domain, LADDER_LEVEL, "evaluation", 1)
        turns = [{"role": "user", "content": task.task.prompt}]
        ids = prompt_ids(pipe.tokenizer, turns)
        result = pipe.generate(ids, query=task.task.prompt, max_new_tokens=128, temperature=0.0)
        try:
            v = make_judge(domain)(task.task, result.text)
            verdict = f"{'PASS' if v.passed else 'FAIL'} ({v.reason})"
        except Exception as e:  # no sandbox on this machine: say so, the answer still shows
            verdict = f"not judged: {e}"
        print(
            f"\n== a held-out ladder task ({task.id}, {domain} level {LADDER_LEVEL}, evaluation part), answered "
            f"greedily by {source} ({backend}) ==\n\n{task.task.prompt}\n\n-- answer --\n{result.text.strip()}"
            f"\n\n-- the {domain} judge: {verdict}"
        )
