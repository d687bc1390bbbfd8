"""Greedy decoding speed of several models measured side by side: every round times each model on
every prompt, models in turn (the order rotating by round), so a machine's drift falls on all of
them. Absolute timings on a shared machine are noise; the ratio of two models' cells, paired by
prompt and round (:func:`kibidango.tools.bench.bootstrap_ratio`), is the figure."""

from __future__ import annotations

import time

import numpy as np

__all__ = ["decode_cells", "generate_cells", "tokens_per_s"]


def decode_cells(
    models: dict[str, object], prompts: list[list[int]], new_tokens: int, rounds: int
) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(tokens, seconds), ...]}``: one cell per round and prompt (the same order for every
    model), greedy one-token steps of a runtime model after the prompt, prompt processing excluded."""

    def steps(model, ids: list[int]) -> tuple[int, float]:
        session = model.new_session()
        row = session.feed(ids, first=len(ids) - 1)[-1]
        started = time.perf_counter()
        for _ in range(new_tokens):
            row = session.feed([int(np.argmax(row))])[0]
        return new_tokens, time.perf_counter() - started

    return _in_turn(models, prompts, rounds, steps)


def generate_cells(
    runs: dict[str, tuple[object, object]], prompts: list[list[int]], rounds: int
) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(tokens, seconds), ...]}`` as :func:`decode_cells`, of whole requests: each run a
    (runtime pipeline, decoding config), timed from the prompt to the last token (prompt processing,
    drafting and verification included; the answer ends where its config stops it), runs in turn."""

    def request(run: tuple[object, object], ids: list[int]) -> tuple[int, float]:
        pipe, cfg = run
        started = time.perf_counter()
        tokens = sum(len(new) for new in pipe.decoder.generate(list(ids), cfg))
        return tokens, time.perf_counter() - started

    return _in_turn(runs, prompts, rounds, request)


def _in_turn(things: dict[str, object], prompts: list[list[int]], rounds: int, cell) -> dict[str, list]:
    """``cell(thing, prompt)`` for every thing and prompt, every round, the things in turn (the order
    rotating by round, so a machine's drift falls on all of them)."""
    names = list(things)
    cells: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cells[name] += [cell(things[name], ids) for ids in prompts]
    return cells


def tokens_per_s(cells: list[tuple[int, float]]) -> float:
    """All the cells' tokens over all their seconds."""
    return sum(t for t, _ in cells) / max(sum(s for _, s in cells), 1e-9)
