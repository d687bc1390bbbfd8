"""``kibidango bench``: every decoding mode on the same bundle and prompts, in one process,
interleaved (prompt by prompt, mode by mode, so that machine noise hits all modes alike), plus
peers on the same models: Hugging Face ``generate(assistant_model=draft)`` and, with the
llamacpp extra, llama.cpp's own speculative loop.

Reports ratios to ``ar`` and counts, not absolute speeds: on shared machines only those compare.
With ``--repeats N`` every ratio has a 95% bootstrap interval over the prompts x rounds (each
resample takes the same cells for both modes, so what the machine did to a cell falls on both),
and the best pyramid against the best sd (or lookup) is stated with its own interval.
Also prints Leviathan et al.'s predicted speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)) from the
measured a (per-token acceptance) and c (draft/target cost of one forward step), and ``ar``'s
tokens/s as a share of the memory-bandwidth bound: a token of target-only decoding reads every
weight of the target once, so it cannot run faster than (read bandwidth) / (target weight bytes),
with the read bandwidth measured here (:func:`read_bandwidth`; on a GPU, the GPU's). (Weights that fit in the CPU's
caches can beat it; the table says so.)"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kibidango.decode.speculative import MODES, SETTINGS, Decoder, Metrics
from kibidango.pipeline import Pipeline

__all__ = [
    "BenchResult",
    "bootstrap_ratio",
    "leviathan_speedup",
    "parse_mode",
    "read_prompts",
    "run_bench",
    "step_costs",
]

_OPTIONS = {  # a mode's own setting after "+": its name -> (DecodeConfig field, number type or None for a flag)
    **{
        f.metadata["bench"]: (name, None if isinstance(f.default, bool) else type(f.default))
        for name, f in SETTINGS.items()
        if f.metadata["bench"]
    },  # the short names DecodeConfig declares (speculative.setting)
    "tb": ("threads_batch", int),  # llama.cpp's threads for batches (a verification); not a DecodeConfig field
    "t": ("threads", int),  # threads for one-token steps (torch: all of its work); not a DecodeConfig field
}
_THREADS = ("threads", "threads_batch")


def parse_mode(spec: str) -> tuple[str, str | None, dict]:
    """A benchmarked mode: ``ar``, ``sd``, ``lookup``, ``pyramid`` or ``pyramid-<variant>``, then
    settings of its own after ``+``, so that one run compares several settings of a mode side by
    side: ``adaptive``, ``lookup`` (the n-gram tier under the draft), ``k<n>``, ``kmax<n>``,
    ``p<x>`` (p_min), ``lD<n>``, ``lQ<n>``, ``lk<n>`` (lookup_k), ``nm<n>`` (ngram_min), ``table``
    (the bundle's n-gram table), ``tk<n>`` (table_k) — e.g.
    ``sd+adaptive+lookup``, ``sd+lookup+lk12+nm2``, ``sd+k6+p0.3`` — and the
    threads it decodes with, ``t<n>`` (one-token steps) and ``tb<n>`` (llama.cpp's batches), so that
    each mode runs at its own best thread count: ``ar+t2,sd+t1+tb2``.
    Returns (mode, variant or None, the settings: DecodeConfig fields, and ``threads``/``threads_batch``)."""
    head, *options = spec.split("+")
    mode, variant = head.split("-", 1) if head.startswith("pyramid-") else (head, None)
    if mode not in MODES:
        raise ValueError(f"--modes {spec!r}: unknown mode {mode!r} (one of {', '.join(MODES)})")
    settings: dict = {}
    for option in options:
        name = option.rstrip("0123456789.")
        if name not in _OPTIONS or (_OPTIONS[name][1] is None) != (name == option):
            raise ValueError(
                f"--modes {spec!r}: unknown setting {option!r} ("
                + ", ".join(
                    n if kind is None else f"{n}<{'x' if kind is float else 'n'}>" for n, (_, kind) in _OPTIONS.items()
                )
                + ")"
            )
        field_name, kind = _OPTIONS[name]
        try:
            settings[field_name] = True if kind is None else kind(option[len(name) :])
        except ValueError as e:
            raise ValueError(f"--modes {spec!r}: {option!r} needs a number after {name!r}") from e
        if field_name in _THREADS and settings[field_name] < 1:
            raise ValueError(f"--modes {spec!r}: {option!r}: at least 1 thread")
    return mode, variant, settings


class _Threads:
    """Each mode's thread counts, set before it decodes (llama.cpp: the contexts' step and batch
    counts; torch: ``torch.set_num_threads``); a mode without its own runs at the models' own."""

    def __init__(self, models: dict, backend: str):
        self.backend = backend
        self.models = models
        if backend == "llamacpp":
            self.default = {n: (m.threads, m.threads_batch) for n, m in models.items()}
        else:
            import torch

            self.default = torch.get_num_threads()

    def check(self, spec: str, settings: dict) -> None:
        if self.backend != "llamacpp" and "threads_batch" in settings:
            raise ValueError(f"--modes {spec!r}: tb<n> (threads for batches) is llama.cpp's; torch takes t<n>")

    def apply(self, settings: dict) -> None:
        if self.backend == "llamacpp":
            for name, model in self.models.items():
                steps, batches = self.default[name]
                steps = settings.get("threads", steps)
                model.set_threads(steps, settings.get("threads_batch", steps if "threads" in settings else batches))
        else:
            import torch

            torch.set_num_threads(settings.get("threads", self.default))


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line, or JSONL with a "prompt" field."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' string ({e})") from e
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def leviathan_speedup(a: float, k: int, c: float) -> float:
    """Expected walltime improvement of SD with k drafted tokens, per-token acceptance a and
    draft/target cost ratio c (Leviathan et al., 2023, Theorem 3.8)."""
    if a >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def bootstrap_ratio(
    a: list[tuple[int, float]], b: list[tuple[int, float]], resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Tokens/s of ``a`` over tokens/s of ``b`` (each a list of (tokens, seconds) cells, paired by
    position: the same prompt and round) and its 95% percentile-bootstrap interval over cells."""
    ta, sa = np.array([c[0] for c in a], float), np.array([c[1] for c in a], float)
    tb, sb = np.array([c[0] for c in b], float), np.array([c[1] for c in b], float)
    point = (ta.sum() / sa.sum()) / (tb.sum() / sb.sum())
    idx = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    ratios = (ta[idx].sum(1) / sa[idx].sum(1)) / (tb[idx].sum(1) / sb[idx].sum(1))
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(point), float(lo), float(hi)


@dataclass
class BenchResult:
    rows: list[dict] = field(default_factory=list)
    cost_ratio: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    verify_cost: float | None = None
    """Seconds of one (k + 1)-token forward of the target / seconds of a one-token step."""
    bandwidth: dict[str, float] = field(default_factory=dict)
    """``ar_tokens_per_s``, ``target_weight_bytes``, ``read_bytes_per_s``, ``bound_tokens_per_s``, ``share``."""


def read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes read per second from memory: a dot product of two float32 arrays of ``nbytes`` in all
    (numpy's BLAS, all its threads; two loads and one multiply-add per 8 bytes, so memory-bound),
    best of ``repeats``."""
    a = np.ones(nbytes // 8, dtype=np.float32)
    b = np.ones(nbytes // 8, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.dot(b)
        best = min(best, time.perf_counter() - t)
    return (a.nbytes + b.nbytes) / best


def _device_read_bandwidth(model, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """:func:`read_bandwidth` of the memory ``model``'s weights live in: a CUDA GPU's (a sum over
    ``nbytes`` of float32 on it, best of ``repeats``), else the CPU's."""
    hf = getattr(model, "hf", None)
    if hf is None or hf.device.type != "cuda":
        return read_bandwidth()
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32, device=hf.device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms the kernel up
        torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def _weight_bytes(model) -> int:
    """Bytes of weights one forward step of ``model`` reads: its GGUF file, or its tensors."""
    if hasattr(model, "hf"):
        return sum(p.numel() * p.element_size() for p in model.hf.parameters())
    return Path(model.llm.model_path).stat().st_size


def step_costs(
    models: dict, tokens: list[int], rounds: int = 7, steps: int = 16, batch: int | None = None
) -> tuple[dict[str, float], float | None]:
    """Seconds per one-token forward step with a warm KV cache (a draft's inner loop), for each
    model: rounds interleaved across the models, median per model, so that noise from the rest
    of the machine falls on all of them alike. With ``batch``, also the seconds of one
    ``batch``-token forward of the target (an sd verification), as the same median."""
    sessions = {name: m.new_session() for name, m in models.items()}
    for s in sessions.values():
        s.feed(tokens)
    samples: dict[str, list[float]] = {name: [] for name in models}
    batched: list[float] = []
    for _ in range(rounds):
        for name, s in sessions.items():
            s.crop(len(tokens))
            t = time.perf_counter()
            for i in range(steps):
                s.feed([tokens[i % len(tokens)]])
            samples[name].append((time.perf_counter() - t) / steps)
        if batch and "target" in sessions:
            s = sessions["target"]
            t = time.perf_counter()
            for i in range(steps):
                s.crop(len(tokens))
                s.feed([tokens[(i + j) % len(tokens)] for j in range(batch)])
            batched.append((time.perf_counter() - t) / steps)
    median = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    return median, (sorted(batched)[len(batched) // 2] if batched else None)


def run_bench(
    bundle: str | Path,
    prompts: list[str],
    modes: list[str],
    max_new_tokens: int = 64,
    repeats: int = 1,
    peers: tuple[str, ...] = ("hf",),
    backend: str = "torch",
    threads: int | None = None,
    kv_cache: str | None = None,
    compile: bool = False,
    ar_ggufs: tuple[str | Path, ...] = (),
    progress: Callable[[int, int], None] | None = None,
    **decode,
) -> BenchResult:
    """``ar_ggufs`` (llama.cpp): other GGUF files of the target (another weight type of the same
    model: F16 beside F32, a quantization), each decoded ``ar`` in the same rounds, so that every
    mode's speed compares with target-only decoding over other weights side by side. ``progress``
    is called with (prompts done, prompts x rounds) after each prompt of each round."""
    specs = {m: parse_mode(m) for m in modes}
    if ar_ggufs and backend != "llamacpp":
        raise ValueError("--ar-gguf is llama.cpp's: use it with --backend llamacpp")
    if ar_ggufs and "ar" not in specs:
        raise ValueError("--ar-gguf compares with this bundle's ar: put ar among --modes")
    needs = {mode for mode, _, _ in specs.values()}
    base = Pipeline.from_bundle(
        bundle,
        backend=backend,
        mode="pyramid" if "pyramid" in needs else "sd" if "sd" in needs else "ar",
        threads=threads,
        kv_cache=kv_cache,
        compile=compile,
    )
    ids = [base.encode(p) for p in prompts]
    threads_of = _Threads(base.models, backend)
    mode_threads = {m: {k: v for k, v in own.items() if k in _THREADS} for m, (_, _, own) in specs.items()}
    for m, t in mode_threads.items():
        threads_of.check(m, t)
    # No stop ids: every mode generates the full budget, so token counts match across modes.
    cfgs = {
        m: base.config(
            mode=mode,
            variant=variant,
            max_new_tokens=max_new_tokens,
            stop_ids=(),
            **{**decode, **{k: v for k, v in own.items() if k not in _THREADS}},
        )
        for m, (mode, variant, own) in specs.items()
    }
    rounds = _Rounds(base, ids, cfgs, threads_of, mode_threads, peers, backend)
    rounds.other_ar = _other_targets(ar_ggufs, base.models["target"], threads, kv_cache)
    if "llamacpp" in peers:
        rounds.llama_peer = _LlamaCppPeer(base.bundle, cfgs.get("sd", next(iter(cfgs.values()))).k, threads)
    rounds.warm_up()
    rounds.run(repeats, max_new_tokens, progress)
    result = BenchResult()
    ar_tps = rounds.totals["ar"].tokens_per_second if "ar" in rounds.totals else None
    _mode_rows(result, rounds, ar_tps)
    result.notes += _pyramid_vs_sd(result.rows, rounds.cells, len(prompts), repeats)
    result.notes += _table_vs_without(rounds.cells, len(prompts), repeats)
    _peer_rows(result, rounds, ar_tps, len(prompts), repeats)
    _costs(result, rounds, ar_tps)
    return result


@dataclass
class _Rounds:
    """The timed decoding of a bench: every mode (and the other targets and peers) on every prompt
    in every round, side by side; what each produced, per mode and per prompt x round."""

    base: Pipeline
    ids: list[list[int]]
    cfgs: dict
    threads_of: _Threads
    mode_threads: dict[str, dict]
    peers: tuple[str, ...]
    backend: str
    other_ar: dict = field(default_factory=dict)
    llama_peer: _LlamaCppPeer | None = None
    totals: dict[str, Metrics] = field(default_factory=dict)
    cells: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # (tokens, seconds) per prompt x round
    other_cells: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    hf_time: float = 0.0
    hf_plain_time: float = 0.0
    hf_tokens: int = 0

    @property
    def hf_peer(self) -> bool:
        return "hf" in self.peers and "draft" in self.base.models and self.backend == "torch"

    def warm_up(self) -> None:
        """Untimed: first-call costs (allocations; with --compile, the compilation)."""
        decoder = self.base.decoder
        for m in self.cfgs:
            self.threads_of.apply(self.mode_threads[m])
            short = dataclasses.replace(self.cfgs[m], max_new_tokens=8)
            for _chunk in decoder.generate(self.ids[0], short, Metrics(m)):
                pass
        for other in self.other_ar.values():
            short = dataclasses.replace(self.cfgs["ar"], max_new_tokens=8)
            for _chunk in other.generate(self.ids[0], short, Metrics("ar")):
                pass

    def run(self, repeats: int, max_new_tokens: int, progress: Callable[[int, int], None] | None) -> None:
        decoder, modes = self.base.decoder, list(self.cfgs)
        self.totals = {m: Metrics(m) for m in modes}
        self.cells = {m: [] for m in modes}
        self.other_cells = {name: [] for name in self.other_ar}
        for round_ in range(repeats):
            for i, prompt_ids in enumerate(self.ids):
                for m in modes:
                    self.threads_of.apply(self.mode_threads[m])
                    metrics = Metrics(m)
                    for _chunk in decoder.generate(prompt_ids, self.cfgs[m], metrics):
                        pass
                    self.totals[m].add(metrics)
                    self.cells[m].append((metrics.generated_tokens, metrics.seconds))
                self.threads_of.apply({})  # the peers and the step costs below run at the models' own counts
                for name, other in self.other_ar.items():  # at the thread counts it was loaded with
                    metrics = Metrics("ar")
                    for _chunk in other.generate(prompt_ids, self.cfgs["ar"], metrics):
                        pass
                    self.other_cells[name].append((metrics.generated_tokens, metrics.seconds))
                if self.hf_peer:
                    dt, n = _hf_generate(self.base, prompt_ids, max_new_tokens, assistant=True)
                    self.hf_time += dt
                    self.hf_tokens += n
                    self.hf_plain_time += _hf_generate(self.base, prompt_ids, max_new_tokens, assistant=False)[0]
                if self.llama_peer:
                    self.llama_peer.run(prompt_ids, max_new_tokens)
                if progress is not None:
                    progress(round_ * len(self.ids) + i + 1, repeats * len(self.ids))


def _mode_rows(result: BenchResult, rounds: _Rounds, ar_tps: float | None) -> None:
    """One row per mode: its speed against ``ar`` (with a bootstrap interval over prompt x round
    cells), acceptance per tier, target forwards per token and mean acceptance length."""
    cfgs, cells = rounds.cfgs, rounds.cells
    for m in cfgs:
        t = rounds.totals[m]
        row = {
            "mode": m if m.split("+")[0] != "pyramid" else f"pyramid-{cfgs[m].variant}{m[len('pyramid') :]}",
            "tau": (cfgs[m].tau_Q, cfgs[m].tau_T) if cfgs[m].mode == "pyramid" else None,
            "tokens": t.generated_tokens,
            "speed_vs_ar": t.tokens_per_second / ar_tps if ar_tps else None,
            "speed_interval": bootstrap_ratio(cells[m], cells["ar"])[1:] if ar_tps and len(cells[m]) > 1 else None,
            "acceptance": {s: t.acceptance_rate(s) for s in t.num_draft_tokens},
            "target_forwards_per_token": t.target_forwards_per_token,
            "mean_acceptance_length": t.mean_acceptance_length,
        }
        result.rows.append(row)


def _peer_rows(result: BenchResult, rounds: _Rounds, ar_tps: float | None, n_prompts: int, repeats: int) -> None:
    """Rows of ``ar`` on the other targets (and the best mode against each), HF's assisted
    generation and llama-cpp-python's own speculative loop."""
    modes = list(rounds.cfgs)
    best = max(
        (m for m in modes if m != "ar" and result.rows[modes.index(m)]["speed_vs_ar"] is not None),
        key=lambda m: result.rows[modes.index(m)]["speed_vs_ar"],
        default=None,
    )
    for name, c in rounds.other_cells.items():
        point, lo, hi = bootstrap_ratio(c, rounds.cells["ar"])
        result.rows.append(
            {
                "mode": f"ar on {name}",
                "tokens": sum(n for n, _ in c),
                "speed_vs_ar": point,
                "speed_interval": (lo, hi) if len(c) > 1 else None,
                "note": f"{point * ar_tps:.1f} tokens/s; ar on this bundle's target {ar_tps:.1f}",
            }
        )
        if best is not None and len(c) > 1:
            point, lo, hi = bootstrap_ratio(rounds.cells[best], c)
            result.notes.append(
                f"best mode ({best}) / ar on {name}: {point:.2f}x [{lo:.2f}, {hi:.2f}] "
                f"(95% bootstrap over {n_prompts} prompts x {repeats} rounds)"
            )
    if rounds.hf_peer:
        result.rows.append(
            {
                "mode": "HF generate(assistant_model=draft)",
                "tokens": rounds.hf_tokens,
                "speed_vs_ar": (rounds.hf_plain_time / rounds.hf_time) if rounds.hf_time else None,
                "note": "ratio to HF generate() without assistant",
            }
        )
    if rounds.llama_peer:
        result.rows.append(rounds.llama_peer.row())


def _costs(result: BenchResult, rounds: _Rounds, ar_tps: float | None) -> None:
    """Each tier's step cost against the target's, the share of the memory-bandwidth bound ``ar``
    reaches, and Leviathan's model of ``sd``'s speed-up against the measured one."""
    base, cfgs, totals = rounds.base, rounds.cfgs, rounds.totals
    k_sd = cfgs["sd"].k if "sd" in cfgs else None
    costs, verify_s = step_costs(base.models, rounds.ids[0], batch=k_sd + 1 if k_sd else None)
    result.cost_ratio = {name: costs[name] / costs["target"] for name in costs}
    verify = verify_s / costs["target"] if verify_s else None
    if ar_tps:
        weights = _weight_bytes(base.models["target"])
        bw = _device_read_bandwidth(base.models["target"])
        result.bandwidth = {
            "ar_tokens_per_s": ar_tps,
            "target_weight_bytes": float(weights),
            "read_bytes_per_s": bw,
            "bound_tokens_per_s": bw / weights,
            "share": ar_tps / (bw / weights),
        }
    if "sd" in totals and totals["sd"].token_acceptance_probability("draft") is not None:
        a = totals["sd"].token_acceptance_probability("draft")
        k = cfgs["sd"].k
        c = result.cost_ratio["draft"]
        predicted = leviathan_speedup(a, k, c)
        measured = next(r["speed_vs_ar"] for r in result.rows if r["mode"] == "sd")
        result.notes.append(
            f"sd: Leviathan model predicts {predicted:.2f}x from a={a:.3f}, k={k}, c={c:.3f}; measured {measured:.2f}x"
        )
        if verify is not None:
            # Leviathan et al. take a verification of k + 1 tokens to cost one target step; on a
            # CPU it costs more (matmuls, not memory, bound it): the same model with the cost measured.
            tokens_per_round = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
            result.verify_cost = verify
            result.notes.append(
                f"sd: one {k + 1}-token verification costs {verify:.2f} target steps (Leviathan's model takes 1); "
                f"with it the model predicts {tokens_per_round / (k * c + verify):.2f}x"
            )


def _other_targets(paths, target, threads: int | None, kv_cache: str | None) -> dict:
    """A :class:`Decoder` over each other GGUF of the target, named by its file name; its
    vocabulary must be the target's (the same tokenizer decodes both)."""
    if not paths:
        return {}
    from kibidango.backends.llamacpp_backend import LlamaCppModel

    out = {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--ar-gguf {path}: no such file")
        model = LlamaCppModel(path, name=path.name, threads=threads, kv_cache=kv_cache or target.kv_cache)
        if model.vocab_size != target.vocab_size:
            raise ValueError(
                f"--ar-gguf {path}: a vocabulary of {model.vocab_size} tokens, the bundle's target has "
                f"{target.vocab_size}: not another GGUF of the same model"
            )
        out[path.name if path.name not in out else str(path)] = Decoder({"target": model})
    return out


def _pyramid_vs_sd(rows: list[dict], cells: dict, n_prompts: int, repeats: int) -> list[str]:
    """The fastest pyramid mode against the fastest two-level one (sd, lookup, with any settings),
    with an interval."""
    by_name = dict(zip(cells, rows))  # rows are in the modes' order
    measured = [m for m in cells if by_name[m]["speed_vs_ar"] is not None]
    pyramid = [m for m in measured if parse_mode(m)[0] == "pyramid"]
    flat = [m for m in measured if parse_mode(m)[0] in ("sd", "lookup")]
    if not pyramid or not flat or len(cells[pyramid[0]]) < 2:
        return []
    best_p = max(pyramid, key=lambda m: by_name[m]["speed_vs_ar"])
    best_f = max(flat, key=lambda m: by_name[m]["speed_vs_ar"])
    point, lo, hi = bootstrap_ratio(cells[best_p], cells[best_f])
    verdict = "faster" if lo > 1 else "slower" if hi < 1 else "not distinguishable from it"
    return [
        f"best pyramid ({by_name[best_p]['mode']}) / best sd ({best_f}): {point:.2f}x [{lo:.2f}, {hi:.2f}] "
        f"(95% bootstrap over {n_prompts} prompts x {repeats} rounds): {verdict}"
    ]


def _table_vs_without(cells: dict, n_prompts: int, repeats: int) -> list[str]:
    """Each mode that reads the n-gram table (``+table``) against the same mode without it
    (``+table`` and ``+tk<n>`` dropped), where both ran: the table's contribution, with an interval."""
    notes = []
    for m in cells:
        options = m.split("+")
        if "table" not in options[1:]:
            continue
        control = "+".join(o for o in options if o != "table" and not (o.startswith("tk") and o[2:].isdigit()))
        if control in cells and len(cells[m]) > 1:
            point, lo, hi = bootstrap_ratio(cells[m], cells[control])
            notes.append(
                f"{m} / {control} (the n-gram table's contribution): {point:.2f}x [{lo:.2f}, {hi:.2f}] "
                f"(95% bootstrap over {n_prompts} prompts x {repeats} rounds)"
            )
    return notes


def _hf_generate(pipe: Pipeline, prompt_ids: list[int], max_new_tokens: int, assistant: bool) -> tuple[float, int]:
    import torch
    from transformers import GenerationConfig

    target = pipe.models["target"].hf
    kwargs = {"assistant_model": pipe.models["draft"].hf} if assistant else {}
    # min_new_tokens = max_new_tokens: generate the full budget, like the modes above.
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        eos_token_id=target.config.eos_token_id,
    )
    ids = torch.tensor([prompt_ids], device=target.device)  # a GPU's model takes its inputs there
    t = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(ids, generation_config=config, **kwargs)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out.shape[1] - len(prompt_ids)


class _LlamaCppPeer:
    """llama-cpp-python's own speculative loop (``Llama(draft_model=...)``, greedy) with the
    bundle's draft GGUF proposing k tokens, timed against the same target GGUF without a draft."""

    def __init__(self, bundle, k: int, threads: int | None = None):
        from llama_cpp import Llama

        from kibidango.backends.llamacpp_backend import DraftModelHook, LlamaCppModel, thread_counts

        target, draft = bundle.tier("target", "llamacpp"), bundle.tier("draft", "llamacpp")
        self.k = k
        n, n_batch = thread_counts(threads)  # the same threads as our llama.cpp models
        kw = {"n_ctx": 0, "logits_all": True, "verbose": False, "seed": 0, "n_threads": n, "n_threads_batch": n_batch}
        self.plain = Llama(model_path=str(target.gguf), **kw)
        self.spec = Llama(
            model_path=str(target.gguf),
            draft_model=DraftModelHook(LlamaCppModel(draft.gguf, "draft", threads=threads), k),
            **kw,
        )
        self.spec_time = self.plain_time = 0.0
        self.tokens = 0

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        for llm, attr in ((self.plain, "plain_time"), (self.spec, "spec_time")):
            llm.reset()
            t = time.perf_counter()
            out = llm.create_completion(prompt_ids, max_tokens=max_new_tokens, temperature=0.0)
            setattr(self, attr, getattr(self, attr) + time.perf_counter() - t)
            if llm is self.spec:
                self.tokens += out["usage"]["completion_tokens"]

    def row(self) -> dict:
        return {
            "mode": f"llama-cpp-python Llama(draft_model=draft, k={self.k})",
            "tokens": self.tokens,
            "speed_vs_ar": self.plain_time / self.spec_time if self.spec_time else None,
            "note": "ratio to the same Llama without a draft",
        }


def format_table(result: BenchResult) -> str:
    header = [
        "mode",
        "tokens",
        "tokens/s vs ar",
        "acceptance (by proposer)",
        "target fwd/token",
        "mean accepted len",
    ]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in result.rows:
        acc = r.get("acceptance") or {}
        acc_s = ", ".join(f"{s} {a:.3f}" for s, a in acc.items() if a is not None) or "-"
        speed = f"{r['speed_vs_ar']:.2f}x" if r.get("speed_vs_ar") is not None else "-"
        if r.get("speed_interval"):
            speed += " [{:.2f}, {:.2f}]".format(*r["speed_interval"])
        fwd = f"{r['target_forwards_per_token']:.3f}" if "target_forwards_per_token" in r else "-"
        mal = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
        lines.append(
            " | ".join(
                [r["mode"], str(r["tokens"]), speed + (f" ({r['note']})" if r.get("note") else ""), acc_s, fwd, mal]
            )
        )
    lines.append("")
    lines.append(
        "cost of one forward step relative to the target: "
        + ", ".join(f"{k} {v:.3f}" for k, v in result.cost_ratio.items())
    )
    lines += result.notes
    b = result.bandwidth
    if b:
        lines.append(
            f"ar: {b['ar_tokens_per_s']:.1f} tokens/s = {b['share']:.0%} of the memory-bandwidth bound "
            f"({b['target_weight_bytes'] / 1e6:.1f} MB of target weights per token at "
            f"{b['read_bytes_per_s'] / 1e9:.1f} GB/s "
            f"measured read bandwidth: {b['bound_tokens_per_s']:.0f} tokens/s)"
            + ("; the weights fit in the CPU's caches, so the bound does not hold" if b["share"] > 1 else "")
        )
    return "\n".join(lines)
