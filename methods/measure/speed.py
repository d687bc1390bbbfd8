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
    names = list(models)
    cells: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model = models[name]
            for ids in prompts:
                session = model.new_session()
                row = session.feed(ids, first=len(ids) - 1)[-1]
                started = time.perf_counter()
                for _ in range(new_tokens):
                    row = session.feed([int(np.argmax(row))])[0]
                cells[name].append((new_tokens, time.perf_counter() - started))
    return cells


def generate_cells(
    runs: dict[str, tuple[object, object]], prompts: list[list[int]], rounds: int
) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(tokens, seconds), ...]}`` as :func:`decode_cells`, of whole requests: each run a
    (runtime pipeline, decoding config), timed from the prompt to the last token (prompt processing,
    drafting and verification included; the answer ends where its config stops it), runs in turn."""
    names = list(runs)
    cells: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            pipe, cfg = runs[name]
            for ids in prompts:
                started = time.perf_counter()
                tokens = sum(len(new) for new in pipe.decoder.generate(list(ids), cfg))
                cells[name].append((tokens, time.perf_counter() - started))
    return cells


def tokens_per_s(cells: list[tuple[int, float]]) -> float:
    """All the cells' tokens over all their seconds."""
    return sum(t for t, _ in cells) / max(sum(s for _, s in cells), 1e-9)
