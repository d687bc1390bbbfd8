"""A static n-gram table: what the target tends to write next, counted over its own outputs.

llama.cpp's lookup decoding keeps three n-gram caches: the text at hand (our ``lookup`` tier),
a dynamic one grown across requests, and a *static* one built once from a corpus
(``llama-lookup-create``, ``--lookup-cache-static``). This is the static one, built from the
target's own continuations of prompts it will not be judged on (the sequence-level distillation
data of a draft, counted instead of learned): for every context of 1..``n_max`` tokens, the
token that most often followed it, how often, and how often the context occurred at all.

It proposes where the text's own n-grams find nothing (:meth:`NgramTable.propose`): from the
longest context of the committed tokens it holds (``ngram_min`` tokens at least), the most
frequent next token if it is frequent enough (``min_count`` times and ``min_share`` of the
context's occurrences), then again after that token, up to ``k`` tokens. Its proposals cost a
dictionary lookup; the target verifies them as certain proposals, so decoding stays lossless.

:func:`count_outputs` builds one from a pipeline's own greedy continuations of prompts, and
:func:`kibidango.bundle.with_ngram_table` writes a copy of a bundle that ships it
(``kibidango ngram-table``).

Stored as ``.npz`` (numpy, no pickles): ``contexts`` (int32, one row per context, left-padded
with -1 to ``n_max``), ``next``, ``count``, ``total`` (int32 per row) and ``vocab_size``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kibidango.integrity import BundleError

__all__ = ["NgramTable", "TABLE_PATH", "count_outputs"]

TABLE_PATH = "ngrams/ngrams.npz"
"""Where a bundle keeps its table (bundle.json's ``ngrams``)."""

_FIELDS = ("contexts", "next", "count", "total", "vocab_size")


class NgramTable:
    def __init__(self, entries: dict[tuple[int, ...], tuple[int, int, int]], n_max: int, vocab_size: int):
        """``entries``: context -> (most frequent next token, its count, the context's count)."""
        self.entries = entries
        self.n_max = n_max
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.entries)

    @classmethod
    def build(cls, sequences: Iterable[list[int]], vocab_size: int, n_max: int = 4) -> NgramTable:
        """Count every context of 1..``n_max`` tokens in ``sequences`` (prompt + continuation,
        token ids) and the token after it; ties go to the token seen first."""
        if n_max < 1:
            raise ValueError("n_max must be >= 1")
        follow: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for seq in sequences:
            seq = [int(t) for t in seq]
            bad = next((t for t in seq if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary of {vocab_size}")
            for i in range(1, len(seq)):
                for n in range(1, min(n_max, i) + 1):
                    follow[tuple(seq[i - n : i])][seq[i]] += 1
        entries = {}
        for context, counter in follow.items():
            token, count = counter.most_common(1)[0]
            entries[context] = (token, count, sum(counter.values()))
        return cls(entries, n_max, vocab_size)

    def propose(
        self, tokens: list[int], k: int, ngram_min: int = 2, min_count: int = 2, min_share: float = 0.5
    ) -> list[int]:
        """Up to ``k`` tokens, each the most frequent follower of the longest context (at most
        ``n_max``, at least ``ngram_min`` tokens) of the tokens so far that the table holds,
        while it followed that context ``min_count`` times and in ``min_share`` of its
        occurrences; [] when the first is not."""
        seq = list(tokens[-self.n_max :])
        out: list[int] = []
        while len(out) < k:
            for n in range(min(self.n_max, len(seq)), ngram_min - 1, -1):
                entry = self.entries.get(tuple(seq[len(seq) - n :]))
                if entry is not None:
                    break
            else:
                break
            token, count, total = entry
            if count < min_count or count < min_share * total:
                break
            out.append(token)
            seq = seq[1:] + [token] if len(seq) >= self.n_max else seq + [token]
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        rows = sorted(self.entries.items())
        contexts = np.full((len(rows), self.n_max), -1, dtype=np.int32)
        for i, (context, _) in enumerate(rows):
            contexts[i, self.n_max - len(context) :] = context
        values = np.array([v for _, v in rows], dtype=np.int32).reshape(len(rows), 3)
        with open(path, "wb") as f:  # np.savez would append .npz to a name without it
            np.savez_compressed(
                f,
                contexts=contexts,
                next=values[:, 0],
                count=values[:, 1],
                total=values[:, 2],
                vocab_size=np.int32(self.vocab_size),
            )
        return path

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> NgramTable:
        """The table at ``path``; BundleError naming the file and what is wrong with it.
        ``vocab_size``: the model's, which every token id must be below."""
        path = Path(path)
        arrays = _read_arrays(path)
        contexts, nxt, count, total = (arrays[n] for n in ("contexts", "next", "count", "total"))
        table_vocab = int(arrays["vocab_size"])
        if contexts.ndim != 2 or contexts.shape[1] < 1 or any(a.shape != (len(contexts),) for a in (nxt, count, total)):
            raise BundleError(f"{path}: contexts, next, count and total do not have one row per context")
        if vocab_size is not None and table_vocab != vocab_size:
            raise BundleError(f"{path}: counted over a vocabulary of {table_vocab}; the model has {vocab_size}")
        ids = np.concatenate([contexts[contexts >= 0], nxt])
        if ids.size and (ids.min() < 0 or ids.max() >= table_vocab):
            raise BundleError(f"{path}: token ids outside the vocabulary of {table_vocab}")
        if ((count < 1) | (count > total)).any():
            raise BundleError(f"{path}: a count is below 1 or above its context's total")
        padded = contexts < 0
        if (padded[:, 1:] > padded[:, :-1]).any() or padded[:, -1].any():
            raise BundleError(f"{path}: a context row is not left-padded with -1")
        entries = {
            tuple(t for t in row if t >= 0): (a, b, c)
            for row, a, b, c in zip(contexts.tolist(), nxt.tolist(), count.tolist(), total.tolist())
        }
        return cls(entries, contexts.shape[1], table_vocab)


_MAX_N = 64  # the longest context a table may hold
_MAX_EXPANSION = 256  # bytes the arrays may declare per byte of the file (a real table compresses ~3-5x)


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The table's arrays, their shapes and types checked from the ``.npy`` headers before any
    array is read (a 0.2 MB file declaring 600 MB of rows is refused unread); a file that is not
    a readable ``.npz`` (empty, truncated) is a BundleError naming it."""
    import zipfile

    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as z:
            names = {n.removesuffix(".npy"): n for n in z.namelist()}
            missing = [name for name in _FIELDS if name not in names]
            if missing:
                raise BundleError(f"{path}: not an n-gram table (missing array {', '.join(missing)})")
            headers = {}
            for name in _FIELDS:
                with z.open(names[name]) as fh:
                    version = np.lib.format.read_magic(fh)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    headers[name] = read(fh, max_header_size=10_000)
            _check_headers(path, headers, size)
            arrays = {}
            for name in _FIELDS:
                with z.open(names[name]) as fh:
                    arrays[name] = np.lib.format.read_array(fh, allow_pickle=False)
    except BundleError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, NotImplementedError) as e:
        raise BundleError(f"{path}: not an n-gram table ({type(e).__name__}: {str(e)[:200]})") from None
    return arrays


def _check_headers(path: Path, headers: dict, size: int) -> None:
    """``headers``: name -> (shape, fortran_order, dtype) as the ``.npy`` files declare them."""
    for name, (_, _, dtype) in headers.items():
        if not np.issubdtype(dtype, np.integer) or dtype.itemsize > 8:
            raise BundleError(f"{path}: not an n-gram table ({name}: arrays of whole numbers)")
    rows, n_max = headers["contexts"][0] if len(headers["contexts"][0]) == 2 else (-1, -1)
    if headers["vocab_size"][0] != ():
        raise BundleError(f"{path}: not an n-gram table (arrays of whole numbers, vocab_size one number)")
    if rows < 0 or not 1 <= n_max <= _MAX_N or any(headers[n][0] != (rows,) for n in ("next", "count", "total")):
        raise BundleError(f"{path}: contexts, next, count and total do not have one row per context")
    declared = sum(int(np.prod(shape)) * dtype.itemsize for shape, _, dtype in headers.values())
    if declared > max(1 << 20, _MAX_EXPANSION * size):
        raise BundleError(f"{path}: its arrays declare {declared:,} bytes in a {size:,}-byte file: refused unread")


def count_outputs(pipe, prompts: list[str], max_new_tokens: int = 64, progress=None) -> NgramTable:
    """The table of ``pipe``'s target over its own greedy continuations (``ar``, the bundle's stop
    ids) of ``prompts``, each counted with its prompt. The prompts should be the workload's, and
    not the ones the table will be judged on. ``progress(done, total)`` after each prompt."""
    cfg = pipe.config(mode="ar", temperature=0.0, max_new_tokens=max_new_tokens)
    sequences = []
    for i, prompt in enumerate(prompts, 1):
        ids = pipe.encode(prompt)
        out = [t for chunk in pipe.decoder.generate(ids, cfg) for t in chunk]
        sequences.append(ids + out)
        if progress is not None:
            progress(i, len(prompts))
    return NgramTable.build(sequences, vocab_size=pipe.models["target"].vocab_size)
