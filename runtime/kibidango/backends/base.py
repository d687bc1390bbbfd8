"""The interface every backend implements."""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = [
    "KV_BYTES_PER_ELEMENT",
    "KV_CACHE_TYPES",
    "ContextLengthError",
    "Model",
    "Session",
    "check_feed",
    "sync_and_feed",
]

KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")
"""llama.cpp K/V cache types (a bundle's ``kv_cache`` default, ``--kv-cache``)."""
KV_BYTES_PER_ELEMENT = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
"""Bytes per cached element of each type: f16's two; ggml's q8_0 and q4_0 blocks of 32 values with
one f16 scale (34 and 18 bytes)."""


class ContextLengthError(ValueError):
    """The sequence would not fit in the model's context window."""


class Session(Protocol):
    """One sequence's KV cache on one model.

    ``tokens`` are the tokens whose keys and values are cached; ``forward_calls`` and
    ``tokens_fed`` count the work done (a rejected speculative token that is cropped away and
    never fed again costs one fed token; a prefix is never fed twice)."""

    tokens: list[int]
    forward_calls: int
    tokens_fed: int

    def feed(self, tokens: list[int], first: int = 0) -> np.ndarray:
        """Append ``tokens`` in one forward pass; returns float32 logits ``[len(tokens) - first,
        vocab]``, row i being the next-token logits after ``tokens[first + i]``. ``first``: the rows
        before it are not needed (a prompt's, where only its last row chooses the next token), so a
        backend need not compute or keep them (a 49K vocabulary's row is 196 KB)."""
        ...

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` cached tokens."""
        ...


class Model(Protocol):
    name: str
    vocab_size: int
    context_length: int

    def new_session(self) -> Session: ...

    def parameters(self) -> int: ...


def check_feed(name: str, cached: int, tokens: list[int], first: int, context: int) -> None:
    """What every backend's :meth:`Session.feed` refuses: no tokens, a ``first`` that is not one of
    their rows, and a sequence (``cached`` tokens before them) longer than the model's ``context``."""
    if not tokens:
        raise ValueError("feed() needs at least one token")
    if not 0 <= first < len(tokens):
        raise ValueError(f"feed(): first={first} is not a row of {len(tokens)} tokens")
    if cached + len(tokens) > context:
        raise ContextLengthError(f"{name}: {cached + len(tokens)} tokens exceed the context of {context}")


def sync_and_feed(session: Session, committed: list[int], extra: list[int]) -> np.ndarray:
    """Bring ``session`` to ``committed`` and score ``extra`` after it, in one forward pass.
    Returns ``len(extra) + 1`` rows of logits: the next-token logits after the last committed
    token, then after each extra token. (Every decoding mode's one way to use a session, and the
    llama.cpp draft hook's: here, below both.)"""
    shared = 0
    for a, b in zip(session.tokens, committed):
        if a != b:
            break
        shared += 1
    # Keep at least the last committed token pending: its row is the one we need first.
    keep = min(shared, len(committed) - 1)
    session.crop(keep)
    pending = committed[keep:]
    return session.feed(pending + extra, first=len(pending) - 1)
