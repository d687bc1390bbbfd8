"""llama.cpp quantization of a converted GGUF, and the measurements stage 2D gates on: token
agreement of a GGUF with the transformers model it came from, and GGUF perplexity.

Quantization is llama.cpp's own ``llama_model_quantize`` through llama-cpp-python (the same
library build the runtime loads the files with). Tensors whose rows are not a multiple of a
k-quant's block (256) get llama.cpp's fallback type; the stage reports bits per weight from the
file, so the fallback shows.

Token agreement follows the HF model's greedy continuation of each held-out prompt: at every
generated position, does the GGUF's argmax equal the token the HF model chose? (Teacher-forced,
so one early difference does not count every later token as a miss; the free-running first
difference is in the report.)
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.contract import KibidangoError
from methods.training.chat import encode, messages

__all__ = [
    "QUANT_TYPES",
    "TENSOR_TYPES",
    "AgreementReport",
    "fallback_tensors",
    "tier_gguf",
    "gguf_type",
    "quantize",
    "agreement_report",
    "greedy_paths",
    "token_agreement",
    "gguf_response_loss",
]

QUANT_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q6_K",
    "Q5_K_M",
    "Q5_K_S",
    "Q5_1",
    "Q5_0",
    "Q4_K_M",
    "Q4_K_S",
    "Q4_1",
    "Q4_0",
    "IQ4_NL",
    "IQ4_XS",
    "Q3_K_M",
    "Q2_K",
)


TENSOR_TYPES = (
    "F32",
    "F16",
    "Q8_0",
    "Q6_K",
    "Q5_K",
    "Q5_1",
    "Q5_0",
    "Q4_K",
    "Q4_1",
    "Q4_0",
    "IQ4_NL",
    "IQ4_XS",
    "Q3_K",
    "Q2_K",
)
"""llama.cpp tensor types one tensor (the embedding) may be stored in (``GGML_TYPE_<name>``)."""


@contextlib.contextmanager
def _native_output_to(log: Path) -> Iterator[None]:
    """Send what native code writes to stdout/stderr (llama.cpp's per-tensor quantization lines)
    to ``log`` instead of the console."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def fallback_tensors(log: Path) -> int:
    """How many tensors llama.cpp stored in a fallback type (rows not a multiple of the block)."""
    return (
        sum("falling back to" in line for line in log.read_text(errors="replace").splitlines()) if log.is_file() else 0
    )


def tier_gguf(artifact: Path, tier: str, what: str) -> Path:
    """The one GGUF of ``tier`` in a stage 2D artifact (``<artifact>/<tier>/*.gguf``); ``what`` names
    the input in the error when there is none or more than one."""
    found = sorted((artifact / tier).glob("*.gguf"))
    if len(found) != 1:
        raise KibidangoError(f"{what}: expected one GGUF of tier {tier!r} in {artifact / tier}, found {len(found)}")
    return found[0]


def gguf_type(path: Path) -> str:
    """The type a tier's GGUF is named for, after the tier: ``target-Q5_0.gguf`` -> ``Q5_0``,
    ``target-Q4_0-mix.gguf`` -> ``Q4_0-mix`` (a mix of types; gguf.json's table names its parts)."""
    tier, sep, quant = path.stem.partition("-")
    if not sep or not quant:
        raise KibidangoError(f"{path}: a tier's GGUF is named <tier>-<type>.gguf")
    return quant


def gguf_parameters(path: Path) -> int:
    """Weights in a GGUF file (every tensor's elements, as llama.cpp's ``llama_model_n_params``
    counts them), read from its header: no model is loaded."""
    from gguf import GGUFReader

    return int(sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors))


def quantize(
    src: Path,
    out: Path,
    qtype: str,
    threads: int = 0,
    imatrix: dict[str, np.ndarray] | None = None,
    embedding_type: str | None = None,
    tensor_types: dict[str, str] | None = None,
) -> Path:
    """``llama_model_quantize(src -> out)`` to ``qtype`` (llama.cpp's names: Q5_K_M, Q4_K_M, ...);
    llama.cpp's report goes to ``<out>.log``. ``imatrix``: importance per input column by GGUF
    tensor name (:func:`methods.compression.imatrix.compute_imatrix`); ``embedding_type``: a
    llama.cpp tensor type (``Q8_0``, ``F16``, ...) for the token embedding and output head instead of
    the type's own choice (a tied head is the embedding); ``tensor_types``: llama.cpp tensor type by
    tensor-name pattern (``llama-quantize --tensor-type PATTERN=TYPE``: a regular expression searched
    in each name, the first that matches wins; a row a type cannot store still falls back)."""
    import ctypes

    try:
        import llama_cpp
    except ImportError as e:
        raise KibidangoError(
            "stage 2D needs llama-cpp-python (the runtime's llamacpp extra); remedy: make setup"
        ) from e

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}", None) if qtype != "F32" else llama_cpp.LLAMA_FTYPE_ALL_F32
    if ftype is None or qtype not in QUANT_TYPES:
        raise KibidangoError(f"unknown llama.cpp quantization type {qtype!r}; known: {', '.join(QUANT_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    if embedding_type is not None:
        ggml_type = getattr(llama_cpp, f"GGML_TYPE_{embedding_type}", None)
        if ggml_type is None:
            raise KibidangoError(f"unknown llama.cpp tensor type {embedding_type!r} for the embedding")
        params.token_embedding_type = params.output_tensor_type = ggml_type
    keep: list = []  # the arrays llama.cpp reads, alive until it returns
    if tensor_types:
        overrides = (llama_cpp.llama_model_tensor_override * (len(tensor_types) + 1))()
        for i, (pattern, type_name) in enumerate(tensor_types.items()):
            ggml_type = getattr(llama_cpp, f"GGML_TYPE_{type_name}", None)
            if ggml_type is None or type_name not in TENSOR_TYPES:
                raise KibidangoError(f"unknown llama.cpp tensor type {type_name!r} for tensors {pattern!r}")
            keep.append(pattern.encode())
            overrides[i].pattern, overrides[i].type = keep[-1], ggml_type
        keep.append(overrides)
        params.tt_overrides = overrides  # the last entry's pattern is NULL: the end
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(sorted(imatrix.items())):
            data = np.ascontiguousarray(values, dtype=np.float32)
            if not np.isfinite(data).all():
                raise KibidangoError(f"importance matrix entry {name} has non-finite values")
            keep += [name.encode(), data]
            entries[i].name = keep[-2]
            entries[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = data.size
        keep.append(entries)
        params.imatrix = entries  # the last entry's name is NULL: the end
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    with _native_output_to(log):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    del keep
    if rc != 0 or not out.is_file():
        raise KibidangoError(
            f"llama.cpp could not quantize {src} to {qtype} (llama_model_quantize returned {rc}); see {log}"
        )
    return out


@dataclass
class Divergence:
    prompt: str
    position: int
    hf_token: str
    gguf_token: str
    hf_top2_gap: float


@dataclass
class AgreementReport:
    agreement: float
    positions: int
    identical_prompts: int
    prompts: int
    divergences: list[Divergence]
    per_prompt: list[tuple[int, int]] = field(default_factory=list)
    """(agreeing positions, positions) of each prompt, in prompt order."""

    def interval(self, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
        """A percentile bootstrap interval of the agreement, resampling prompts (a prompt's positions
        share one context, so they are not independent draws)."""
        if not self.per_prompt:
            return self.agreement, self.agreement
        counts = np.array(self.per_prompt, dtype=np.float64)
        draws = np.random.default_rng(seed).integers(0, len(counts), size=(resamples, len(counts)))
        shares = counts[draws, 0].sum(1) / np.maximum(counts[draws, 1].sum(1), 1)
        lo, hi = np.quantile(shares, [(1 - level) / 2, (1 + level) / 2])
        return float(lo), float(hi)

    def table(self, limit: int = 8) -> str:
        """Where the GGUF first differs from the HF model, worst prompts first."""
        rows = [
            "| prompt (end) | first difference at | HF token | GGUF token | HF top-2 logit gap |",
            "|---|---:|---|---|---:|",
        ]
        for d in self.divergences[:limit]:
            rows.append(f"| {d.prompt!r} | {d.position} | {d.hf_token!r} | {d.gguf_token!r} | {d.hf_top2_gap:.3f} |")
        return "\n".join(rows)


def _greedy(session, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy continuation and the logits row that chose each token."""
    row = session.feed(prompt, first=len(prompt) - 1)[-1]
    out, rows = [], []
    for _ in range(new_tokens):
        rows.append(row)
        out.append(int(np.argmax(row)))
        row = session.feed([out[-1]])[0]
    return out, np.stack(rows)


def greedy_paths(hf, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], np.ndarray]]:
    """``hf``'s greedy continuation of each prompt and the logits rows that chose it: computed once
    per source model, then compared with each of its GGUFs by :func:`token_agreement`."""
    return [_greedy(hf.new_session(), ids, new_tokens) for ids in prompts]


def token_agreement(
    hf, gguf, tokenizer, prompts: list[list[int]], new_tokens: int, paths: list | None = None
) -> AgreementReport:
    """Agreement of ``gguf`` (a runtime llamacpp model) with ``hf`` (a runtime torch model) along
    ``hf``'s greedy continuations of ``prompts`` (``paths``: those continuations, from
    :func:`greedy_paths`, when several GGUFs of one model are compared)."""
    if paths is None:
        paths = greedy_paths(hf, prompts, new_tokens)
    choices = [
        gguf.new_session().feed(ids + path[:-1], first=len(ids) - 1).argmax(-1)
        for ids, (path, _) in zip(prompts, paths, strict=True)
    ]
    return agreement_report(tokenizer, prompts, paths, choices)


def agreement_report(
    tokenizer, prompts: list[list[int]], paths: list[tuple[list[int], np.ndarray]], choices: list[np.ndarray]
) -> AgreementReport:
    """:func:`token_agreement` from a model's greedy choices along each path (``choices[i]``: the
    argmax of each row that predicts ``paths[i]``'s tokens after ``prompts[i]``, teacher-forced),
    however computed."""
    per_prompt, identical, divergences = [], 0, []
    for ids, (path, hf_rows), g_choice in zip(prompts, paths, choices, strict=True):
        g_choice = np.asarray(g_choice)
        same = g_choice == np.array(path)
        per_prompt.append((int(same.sum()), len(path)))
        if same.all():
            identical += 1
            continue
        at = int(np.argmin(same))
        top2 = np.sort(hf_rows[at])[-2:]
        divergences.append(
            Divergence(
                tokenizer.decode(ids[-12:], skip_special_tokens=True),
                at,
                tokenizer.decode([path[at]]),
                tokenizer.decode([int(g_choice[at])]),
                float(top2[1] - top2[0]),
            )
        )
    divergences.sort(key=lambda d: d.position)
    agree, total = sum(a for a, _ in per_prompt), sum(n for _, n in per_prompt)
    return AgreementReport(agree / max(total, 1), total, identical, len(prompts), divergences, per_prompt)


def gguf_response_loss(gguf, tokenizer, rows: list[dict], max_len: int) -> dict[str, float]:
    """Response-token loss and perplexity of a GGUF (runtime llamacpp model) on ``rows``, counted
    exactly as :func:`methods.measure.lm.response_loss` counts them for transformers models."""
    total, count = 0.0, 0
    for r in rows:
        ids, start = encode(tokenizer, messages(r), max_len)
        if len(ids) <= start:
            continue
        logits = gguf.new_session().feed(ids).astype(np.float64)
        pred = logits[start - 1 : len(ids) - 1]
        lse = np.log(np.exp(pred - pred.max(-1, keepdims=True)).sum(-1)) + pred.max(-1)
        total += float((lse - pred[np.arange(len(pred)), ids[start:]]).sum())
        count += len(ids) - start
    loss = total / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": float(count)}
