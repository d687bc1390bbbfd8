"""Stage 2F — recovery LoRA: win back what compression cost, on what the loop taught.

1. The compressed target (stage 2B's AWQ checkpoint) is decompressed once into a dense
   transformers checkpoint (its weights stay on 2B's grid: 4-bit for tiny, 8-bit for small): the
   base the LoRA trains on, in a form axolotl loads without compressed-tensors.
2. The training rows (``rows``):
   - ``loop``: what 1R learned — 1D's corrected pairs (the ``pairs`` input) and the replay rows of
     1R's own mix, rebuilt from 1R's recipe (``replay_share``, ``pair_repeats``, ``seed``, read
     from the ``reference`` input's manifest) by the function 1R draws them with. A LoRA trained on
     other rows taught the base something else: on the small preset the ``hardest`` LoRA below
     recovered 60% of the perplexity compression cost and halved the ladder's math in stage 9
     (41.7% -> 16.7% of 48), teaching back long worked answers in place of the ladder's ``#### N``.
   - ``hardest``: the ``hardest_rows`` of stage 0's train split with the highest response-token loss
     under the compressed model (the plan: the hardest 5K examples), or with ``selection:
     loss_increase`` the loss compression *added* (compressed minus reference). ``candidate_rows``
     bounds the rows scored; ``candidates: by_domain`` draws them in turn from each domain.
3. axolotl trains a LoRA on them (``train``: a TrainRecipe, unmerged LoRA). With ``kd``, the
   uncompressed 1R (the ``reference`` input) is the teacher: its top-k log-probabilities at every
   position of every row that fits in ``train.sequence_len`` are the KD target of axolotl's KD
   plugin (:mod:`methods.training.kd`, 1E's engine), beside the data's cross-entropy: the LoRA
   learns back the reference's distribution, not only its greedy tokens.
4. Validation perplexity of the reference model (before compression), the compressed model, and
   the compressed model with the LoRA; recovered = the share of the perplexity lost to compression
   that the LoRA wins back.
5. ``check``: perplexity is not the tasks. The compressed target answers held-out math-ladder
   tasks of the **mining** part (a draw of its own; stage 9 judges on the evaluation part) with and
   without the LoRA, greedy, judged by the math judge; the adapter is fit to be the bundle's default
   weights (``default_weights`` in ``adapter.json``, which stage 2G reads) only if it passes more
   tasks than the bare weights, by a paired exact McNemar test at ``check.max_p`` where the recipe
   asks for one: a tie, or a gain within noise, keeps the bare weights, which decode without the
   LoRA's extra matmuls.

``base`` says which compressed weights the LoRA recovers. ``awq``: the compressed target as
transformers loads it (2B, the torch backend's weights). ``gguf``: the GGUF the bundle ships for
llama.cpp (2D's fidelity-table choice, quantized from its own source, not from 2B's grid), its
weights dequantized by transformers' GGUF loader into the base the LoRA trains on; the LoRA is
converted by llama.cpp's ``convert_lora_to_gguf`` and ships in that form only (it was trained on the
GGUF's weights, not 2B's), and the check runs on llama.cpp: the reference's F16 GGUF, the shipped GGUF
bare and the shipped GGUF with the LoRA, as rows of 2D's fidelity table (bytes with the LoRA's file,
perplexity ratio and KL against the reference on the validation rows, the check's ladder tasks,
tokens/s side by side).

Outputs: ``adapter/`` (peft), ``adapter.gguf`` (``base: gguf``), ``adapter.json`` (the runtime's
manifest), ``rows.jsonl`` (the training rows: id, domain, and their loss and rank for ``hardest`` or
their source for ``loop``), ``recovery.json``, ``axolotl.yaml``, ``logs/train.log``.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult
from core.progress import Progress
from methods.compression.fidelity import table as fid_table
from methods.compression.gguf import gguf_type, tier_gguf
from methods.compression.llmc import decompress
from methods.failures import loop_mix, read_jsonl
from methods.llama_cpp_tools import convert_lora_to_gguf
from methods.measure import lm
from methods.measure.lm import summarise, validation_loss, validation_rows
from methods.training import axolotl
from methods.training.adapter_manifest import write_adapter_manifest
from methods.training.chat import axolotl_dataset, axolotl_template, load_split, messages, write_jsonl
from methods.training.kd import KDLoss, check_alignment, fitting_examples, kd_dataset, teacher_logprobs
from methods.training.models import dense_from_gguf, resolve_base, right_padded_tokenizer, tokenizer_type
from methods.training.recipe import TrainRecipe


class TaskCheck(BaseModel):
    """Held-out math-ladder tasks (mining part) answered with and without the adapter."""

    levels: list[int] = Field([1, 2, 3, 4], min_length=1, description="Math ladder levels.")
    per_level: int = Field(8, gt=0, description="Tasks a level.")
    seed: int = Field(2, description="The draw of mining tasks (1B mines seed 0's).")
    max_new_tokens: int = Field(96, gt=0, description="Most tokens of an answer in the check.")
    parallel: int = Field(32, gt=0, description="Answers decoded together.")
    threads: int = Field(2, gt=0, description="`base: gguf`: llama.cpp threads for the check's rows.")
    speed_prompts: int = Field(
        6, gt=0, description="`base: gguf`: held-out prompts timed per row (48 tokens, 2 rounds)."
    )
    max_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="The adapter becomes the default weights only if it passes more tasks AND the exact McNemar "
        "test of the two (two-sided) gives p <= max_p: a LoRA set by default costs decoding speed and memory "
        "on every request, so a gain within noise keeps the bare weights (1.0: passing more is enough).",
    )

    def default_weights(self, adapter_passed: int, bare_passed: int, p: float) -> bool:
        """Whether the adapter is fit to be the default weights: more tasks passed, at ``p <= max_p``."""
        return adapter_passed > bare_passed and p <= self.max_p


RESUMABLE = True
LIBRARIES = ("transformers", "torch", "peft", "compressed-tensors")

log = logging.getLogger("kibidango.stage.recovery")

CHECK_ROWS = 8  # validation rows on which the decompressed base must score as the compressed model


class Config(StageConfig):
    tier: str = Field("target", description="Tier of the `compressed` (and `reference`) input to recover.")
    base: Literal["awq", "gguf"] = Field(
        "awq",
        description="The compressed weights the LoRA recovers: `awq`, the `compressed` input (2B's checkpoint, the "
        "torch backend's weights); `gguf`, the `gguf` input's GGUF of the tier (2D's choice, llama.cpp's weights, "
        "dequantized to train on), the LoRA shipped as a GGUF adapter and checked on llama.cpp.",
    )
    rows: Literal["hardest", "loop"] = Field(
        "hardest",
        description="Train on the `hardest_rows` of stage 0's train split (by `selection`), or on what 1R "
        "learned: 1D's corrected pairs (the `pairs` input) and the replay rows of 1R's own mix.",
    )
    kd: KDLoss | None = Field(
        None,
        description="Distil the `reference` model (uncompressed 1R) into the LoRA: its top-k distribution at every "
        "position of the training rows that fit in train.sequence_len (longer rows left out). None: "
        "cross-entropy on the rows only.",
    )
    hardest_rows: int = Field(5000, gt=0, description="`rows: hardest`: this many highest-loss rows (the plan: 5K).")
    selection: Literal["loss", "loss_increase"] = Field(
        "loss", description="Rank rows by loss under the compressed model, or by how much compression raised it."
    )
    candidate_rows: int | None = Field(None, gt=0, description="Score only N train rows (None: all).")
    candidates: Literal["first", "by_domain"] = Field(
        "first",
        description="Which N rows: the split's first N, or N drawn in turn from each domain (each domain's "
        "rows in stored order): the split's first rows may all be one domain's.",
    )
    train: TrainRecipe = Field(description="The LoRA fine-tune (axolotl): steps, learning rate, warm-up, batch.")
    eval_rows: int = Field(200, gt=0, description="Stage-0 validation rows (the rows 2A-2D use).")
    eval_max_len: int = Field(
        256, gt=8, description="Tokens per validation row in the perplexity passes (longer rows cut)."
    )
    check: TaskCheck | None = Field(
        None,
        description="Answer held-out ladder tasks with and without the adapter; it becomes the default weights "
        "only if it passes more, at check.max_p (a tie keeps the bare weights; None: no check, the adapter is fit "
        "to be the default).",
    )

    @model_validator(mode="after")
    def _lora(self) -> Config:
        if self.train.adapter != "lora" or self.train.merge_lora:
            raise ValueError(
                "a recovery adapter is an unmerged LoRA: set train.adapter: lora and train.merge_lora: false"
            )
        return self


def axolotl_configs(cfg: Config, cuda: bool) -> dict[str, dict]:
    data = "<work>/data/logprobs.jsonl" if cfg.kd else "<work>/data/rows.jsonl"
    return {
        "recovery": axolotl.render(
            cfg.train,
            f"<work>/base (stage {'2D' if cfg.base == 'gguf' else '2B'}'s target, dequantized)",
            [kd_dataset(data) if cfg.kd else axolotl_dataset(data)],
            "<work>/lora",
            extra={**cfg.kd.axolotl_keys(), "tokenizer_config": "<work>/tokenizer"} if cfg.kd else None,
            cuda=cuda,
        )
    }


def _score(model_dir: Path, tokenizer, rows: list[dict], max_len: int, label: str) -> list[float]:
    """Per-row response loss under ``model_dir``; a row with no response token scores -1 (never hard)."""
    model = lm.load_causal_lm(model_dir)
    progress = Progress(f"2F: scoring rows under the {label} model", len(rows), log)
    losses: list[float] = []
    for i in range(0, len(rows), 256):
        losses += lm.row_losses(model, tokenizer, rows[i : i + 256], max_len)
        progress.update(len(losses))
    progress.finish(len(rows))
    return [x if x == x else -1.0 for x in losses]


def _candidates(data: Path, cfg: Config) -> list[dict]:
    """The train rows 2F scores: all, the first ``candidate_rows``, or ``candidate_rows`` taken in
    turn from each domain (round robin over the domains in order of first appearance)."""
    return load_split(data, "train", limit=cfg.candidate_rows, by_domain=cfg.candidates == "by_domain")


def task_check(check: TaskCheck, compressed: Path, adapter_dir: Path, work_dir: Path) -> dict:
    """Pass counts of the compressed target on ``check``'s ladder tasks without and with the adapter
    in ``adapter_dir`` (its ``adapter.json``), the paired McNemar test, and whether the adapter is
    fit to be the default weights (:meth:`TaskCheck.default_weights`). Each pass is resumable in its own
    directory under ``work_dir`` (:func:`methods.heldout.answer_and_judge`)."""
    from methods.evaluation import mcnemar
    from methods.failures import verdict_record
    from methods.heldout import answer_and_judge
    from methods.judges.math import MathJudge
    from methods.ladder import ladder_rows
    from methods.measure.generate import ScoredAnswerer

    tasks = ladder_rows("math", check.levels, "mining", check.per_level * len(check.levels), seed=check.seed)
    rows = [{**r, "domain": "math"} for r in tasks]
    domain = json.loads((adapter_dir / "adapter.json").read_text())["domain"]
    answerer = ScoredAnswerer(compressed, check.max_new_tokens, [adapter_dir], parallel=check.parallel)
    judges = {"math": MathJudge()}
    passed: dict[str, dict[str, bool]] = {}
    try:
        for label, adapter in (("bare", None), ("adapter", domain)):  # one pass per weights: one forward a step

            def answer(row: dict, prior: dict | None, judge, adapter=adapter) -> dict:
                a, _ = answerer.answer(row["instruction"], row["input"], adapter)
                return {"id": row["id"], "answer": a.text, **verdict_record(judge(row["task"], a.text), "math")}

            records, _ = answer_and_judge(
                judges, rows, work_dir / label, f"2F ladder check ({label})", answer, check.parallel
            )
            passed[label] = {r["id"]: r["passed"] for r in records}
    finally:
        answerer.close()
    bare, adapted = sum(passed["bare"].values()), sum(passed["adapter"].values())
    test = mcnemar(passed["adapter"], passed["bare"])
    return {
        "tasks": len(rows),
        "bare_passed": bare,
        "adapter_passed": adapted,
        "adapter_only": test["a_only"],
        "bare_only": test["b_only"],
        "p": test["p"],
        "default_weights": check.default_weights(adapted, bare, test["p"]),
    }


def _hardest_rows(cfg: Config, base: Path, reference: Path, tokenizer, data: Path, out_dir: Path):
    """``rows: hardest``: the train rows ranked by loss under the compressed model (or by the loss
    compression added), written to ``rows.jsonl`` with their losses. Returns (rows, metrics)."""
    rows = _candidates(data, cfg)
    if not rows:
        raise KibidangoError(f"stage 0's train split ({data}) is empty")
    losses = _score(base, tokenizer, rows, cfg.train.sequence_len, "compressed")
    rank = losses
    if cfg.selection == "loss_increase":
        reference_losses = _score(reference, tokenizer, rows, cfg.train.sequence_len, "reference")
        rank = [a - b for a, b in zip(losses, reference_losses)]
    hardest = sorted(range(len(rows)), key=lambda i: -rank[i])[: cfg.hardest_rows]
    write_jsonl(
        out_dir / "rows.jsonl",
        (
            {"row": i, "id": rows[i]["id"], "domain": rows[i]["domain"], "loss": losses[i], "rank_score": rank[i]}
            for i in hardest
        ),
    )
    picked = Counter(rows[i]["domain"] for i in hardest)
    log.info(
        f"2F: {len(hardest):,} hardest of {len(rows):,} rows ({dict(picked.most_common())}; "
        f"loss {losses[hardest[-1]]:.3f} .. {losses[hardest[0]]:.3f})"
    )
    return [rows[i] for i in hardest], {
        "hardest_rows": float(len(hardest)),
        "candidate_rows": float(len(rows)),
        "hardest_mean_loss": sum(losses[i] for i in hardest) / len(hardest),
        "all_mean_loss": sum(losses) / len(losses),
    }


def _loop_rows(inputs: dict[str, Path], data: Path, out_dir: Path):
    """``rows: loop``: 1D's corrected pairs and the replay rows of 1R's own mix (1R's recipe, from the
    ``reference`` input's manifest), written to ``rows.jsonl`` with their source. Returns (rows, metrics)."""
    if "pairs" not in inputs:
        raise KibidangoError(
            "2F `rows: loop` needs the `pairs` input (stage 1D's corrected pairs); the graph gives none"
        )
    manifest = inputs["reference"] / "manifest.json"
    recipe = json.loads(manifest.read_text())["config"] if manifest.is_file() else {}
    missing = [k for k in ("replay_share", "pair_repeats", "seed") if k not in recipe]
    if missing:
        raise KibidangoError(
            f"2F `rows: loop`: the reference input is not a retraining round's artifact ({manifest} has no "
            f"config.{missing[0]}): wire `reference` to stage 1R"
        )
    pairs = read_jsonl(inputs["pairs"] / "pairs.jsonl", "the pairs input (stage 1D)")
    if not pairs:
        raise KibidangoError(f"no corrected pairs in {inputs['pairs']} (stage 1D answered none): nothing to recover on")
    pair_rows, replay = loop_mix(
        pairs, load_split(data, "train"), recipe["replay_share"], recipe["pair_repeats"], recipe["seed"]
    )
    write_jsonl(
        out_dir / "rows.jsonl",
        (
            *({"id": r["id"], "domain": r["domain"], "source": "pair"} for r in pair_rows),
            *({"id": r["id"], "domain": r["domain"], "source": "replay"} for r in replay),
        ),
    )
    log.info(f"2F: 1R's mix, {len(pair_rows):,} corrected pair rows + {len(replay):,} replay rows")
    return [*pair_rows, *replay], {"loop_pair_rows": float(len(pair_rows)), "loop_replay_rows": float(len(replay))}


def _train(cfg: Config, rows: list[dict], base: Path, reference: Path, tokenizer, out_dir: Path, work_dir: Path):
    """The LoRA on ``rows`` (axolotl): cross-entropy, or with ``kd`` the reference's top-k beside it
    (the rows that fit in train.sequence_len; axolotl's prepared ids checked against the teacher's
    before training). Writes axolotl.yaml and logs/train.log; returns the last logged metrics and
    ``kd_rows``, the rows the KD trained on."""
    run_dir = work_dir / "lora"
    extra, template_from, examples = None, base, []
    if cfg.kd is None:
        data_file = work_dir / "data" / "rows.jsonl"
        write_jsonl(data_file, ({"messages": messages(r)} for r in rows))
        dataset = axolotl_dataset(str(data_file))
    else:
        examples = fitting_examples(tokenizer, rows, cfg.train.sequence_len)
        if not examples:
            raise KibidangoError(f"2F: no training row fits in train.sequence_len {cfg.train.sequence_len}")
        log.info(
            f"2F: KD on {len(examples):,} of {len(rows):,} rows (those that fit in {cfg.train.sequence_len} tokens)"
        )
        data_file = work_dir / "data" / "logprobs.jsonl"
        teacher_logprobs(lm.load_causal_lm(reference), examples, cfg.kd.top_k, data_file, "2F")
        dataset = kd_dataset(str(data_file))
        template_from = right_padded_tokenizer(base, work_dir / "tokenizer")
        extra = {**cfg.kd.axolotl_keys(), "tokenizer_config": str(template_from)}
    spec = axolotl.render(
        cfg.train,
        str(base),
        [dataset],
        str(run_dir),
        extra=extra,
        tokenizer_type=tokenizer_type(template_from),
        chat_template=axolotl_template(template_from),
    )
    (out_dir / "axolotl.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    if cfg.kd is not None:  # fail before training: a launch of its own that only tokenizes
        axolotl.train(spec, run_dir, "2F/recovery", preprocess_only=True)
        check_alignment(run_dir / "prepared", [ids for _, ids in examples], "2F/recovery")
    last = axolotl.train(spec, run_dir, "2F/recovery", gpus=cfg.train.gpus)
    (out_dir / "logs").mkdir()
    shutil.copy2(run_dir / "axolotl.log", out_dir / "logs" / "train.log")
    return {**last, "kd_rows": float(len(examples))}


def _rows_said(cfg: Config, metrics: dict) -> str:
    kd = f", KD from the uncompressed model's top-{cfg.kd.top_k} on {metrics['kd_rows']:,.0f} rows" if cfg.kd else ""
    if cfg.rows == "loop":
        return f"1R's mix: {metrics['loop_pair_rows']:,.0f} pair + {metrics['loop_replay_rows']:,.0f} replay rows{kd}"
    return f"{metrics['hardest_rows']:,.0f} rows by {cfg.selection}{kd}"


def _shipped_gguf(inputs: dict[str, Path], tier: str) -> Path:
    """``base: gguf``: the one GGUF of ``tier`` in the ``gguf`` input (stage 2D's choice)."""
    if "gguf" not in inputs:
        raise KibidangoError("2F `base: gguf` needs the `gguf` input (stage 2D's GGUF files); the graph gives none")
    return tier_gguf(inputs["gguf"], tier, "2F `base: gguf`, the gguf input")


def _check_base(
    cfg: Config, base: Path, compressed: Path | None, gguf: Path | None, data: Path, comp_rows, tokenizer
) -> None:
    """The LoRA's base must be the compressed model: the dense copy scores the first validation rows
    as the compressed model does (a handful suffices: a broken copy, e.g. random weights, is off by
    whole nats). ``comp_rows`` are the validation rows scored under the compressed model as
    transformers reads it: a compressed-tensors checkpoint (``compressed``), or for a GGUF the dense
    copy itself, then compared with llama.cpp on the GGUF, whose quantized dot products round
    activations too: a 3% tolerance, against 0.1% for a compressed-tensors checkpoint."""
    n = min(CHECK_ROWS, cfg.eval_rows)
    if gguf is None:
        dense = summarise(validation_rows(base, data, n, cfg.eval_max_len))["loss"]
        theirs, tolerance, what = summarise(comp_rows[:n])["loss"], 1e-3, compressed
    else:
        from kibidango.backends.llamacpp_backend import LlamaCppModel
        from methods.compression.gguf import gguf_response_loss

        dense = summarise(comp_rows[:n])["loss"]
        rows = load_split(data, "validation", limit=n, by_domain=True)
        model = LlamaCppModel(gguf, name="shipped", n_ctx=cfg.eval_max_len)
        theirs = gguf_response_loss(model, tokenizer, rows, cfg.eval_max_len)["loss"]
        tolerance, what = 0.03, gguf
    if abs(dense - theirs) > tolerance * max(theirs, 1e-9):
        raise KibidangoError(
            f"the dense base {base} does not reproduce {what} "
            f"(validation loss on the first {n} rows {dense:.4f} vs {theirs:.4f})"
        )


def gguf_check(
    cfg: Config, reference: Path, gguf: Path, adapter_dir: Path, tokenizer, data: Path, work_dir: Path
) -> tuple[dict, list]:
    """``base: gguf``: the shipped GGUF without and with the LoRA (``adapter.gguf``) on llama.cpp, as
    rows of 2D's fidelity table against the reference's F16 GGUF (the same validation rows, the
    check's mining-part ladder tasks, tokens/s in the same rounds), and the check's verdict as
    :func:`task_check` gives it."""
    from kibidango.addons.adapters import Adapter
    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from methods.compression import fidelity as fid
    from methods.compression.gguf import gguf_parameters
    from methods.evaluation import mcnemar
    from methods.ladder import ladder_rows
    from methods.llama_cpp_tools import convert_hf_to_gguf
    from methods.measure.speed import decode_cells, tokens_per_s

    check = cfg.check
    f16 = work_dir / "reference-F16.gguf"
    if not f16.is_file():
        convert_hf_to_gguf(reference, f16, "f16")
    trained = json.loads((reference / "config.json").read_text()).get("max_position_embeddings", 1024)
    n_ctx = min(max(cfg.eval_max_len, 1024), trained)  # room for a ladder answer, within the trained context
    load = lambda path, name: LlamaCppModel(path, name=name, n_ctx=n_ctx, threads=check.threads)  # noqa: E731
    ref, bare, adapted = load(f16, "reference F16"), load(gguf, "bare"), load(gguf, "with the LoRA")
    adapted.load_lora("recovery", Adapter.from_dir(adapter_dir))
    adapted.set_lora("recovery")
    models = {"bare": bare, "with the LoRA": adapted}
    rows = load_split(data, "validation", limit=cfg.eval_rows, by_domain=True)
    log.info(f"2F: the shipped GGUF with and without the LoRA on llama.cpp ({len(rows)} validation rows)")
    div = fid.divergence(ref, models, tokenizer, rows, cfg.eval_max_len)
    tasks = ladder_rows("math", check.levels, "mining", check.per_level * len(check.levels), seed=check.seed)
    ladder = {}
    for label, model in {"reference F16": ref, **models}.items():
        log.info(f"2F: {len(tasks)} mining-part ladder tasks on llama.cpp, {label}")
        ladder[label] = fid.ladder_pass(model, tokenizer, tasks, check.max_new_tokens)
    prompts = [p.ids for p in lm.held_out_prompts(tokenizer, rows)[: check.speed_prompts]]
    speed = {k: tokens_per_s(c) for k, c in decode_cells({"reference F16": ref, **models}, prompts, 48, 2).items()}
    weights = gguf_parameters(gguf)
    quant = gguf_type(gguf)
    lora_bytes = (adapter_dir / "adapter.gguf").stat().st_size
    ref = "reference F16"
    table = [
        fid.FidelityRow.reference_of(
            ref, "reference", f16.stat().st_size, weights, div["bare"], ladder[ref], speed[ref]
        )
    ]
    for label, extra in (("bare", 0), ("with the LoRA", lora_bytes)):
        name = f"shipped {quant}" + (" + recovery LoRA" if extra else "")
        size = gguf.stat().st_size + extra
        table.append(
            fid.FidelityRow.measured(name, "2D", quant, size, weights, div[label], ladder[label], speed[label])
        )
    by_id = {label: {t["id"]: p for t, p in zip(tasks, ladder[label])} for label in models}
    test = mcnemar(by_id["with the LoRA"], by_id["bare"])
    bare_n, adapted_n = sum(ladder["bare"]), sum(ladder["with the LoRA"])
    verdict = {
        "tasks": len(tasks),
        "bare_passed": bare_n,
        "adapter_passed": adapted_n,
        "adapter_only": test["a_only"],
        "bare_only": test["b_only"],
        "p": test["p"],
        "default_weights": check.default_weights(adapted_n, bare_n, test["p"]),
    }
    return verdict, table


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    from transformers import AutoTokenizer

    reference = Path(resolve_base(None, inputs.get("reference"), cfg.tier, "reference model"))
    compressed = gguf = None
    if cfg.base == "gguf":
        gguf = _shipped_gguf(inputs, cfg.tier)
        base = dense_from_gguf(gguf, reference, work_dir / "base")
    else:
        compressed = Path(resolve_base(None, inputs.get("compressed"), cfg.tier, "compressed model"))
        base = decompress(compressed, work_dir / "base")
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    data = inputs["data"] / "dataset"

    if cfg.rows == "loop":
        rows, picked = _loop_rows(inputs, data, out_dir)
    else:
        rows, picked = _hardest_rows(cfg, base, reference, tokenizer, data, out_dir)
    last = _train(cfg, rows, base, reference, tokenizer, out_dir, work_dir)
    adapter = axolotl.trained_files(work_dir / "lora", out_dir / "adapter")
    if not (adapter / "adapter_config.json").is_file():
        raise KibidangoError(f"axolotl wrote no adapter_config.json; see {out_dir / 'logs' / 'train.log'}")

    ref = validation_loss(reference, data, cfg.eval_rows, cfg.eval_max_len)
    comp_rows = validation_rows(compressed or base, data, cfg.eval_rows, cfg.eval_max_len)
    comp = summarise(comp_rows)
    _check_base(cfg, base, compressed, gguf, data, comp_rows, tokenizer)
    rec = validation_loss(base, data, cfg.eval_rows, cfg.eval_max_len, adapter=adapter)
    lost = comp["perplexity"] - ref["perplexity"]
    metrics = {
        "val_perplexity_reference": ref["perplexity"],
        "val_perplexity_compressed": comp["perplexity"],
        "val_perplexity_recovered": rec["perplexity"],
        # share of the compression cost won back; only defined where compression cost > 1% perplexity
        "recovered_share": (comp["perplexity"] - rec["perplexity"]) / lost
        if lost > 0.01 * ref["perplexity"]
        else float("nan"),
        **picked,
        "train_rows": float(len(rows)),
        "train_loss_final": last.get("loss", float("nan")),
        "kd_rows": last["kd_rows"],  # the rows that fit in train.sequence_len (0: no KD)
    }
    if gguf is None:
        files = {"peft": ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]}
        base_model = f"stage 2B {cfg.tier} (AWQ, compressed-tensors)"
    else:  # trained on the GGUF's weights: it ships for them alone, as llama.cpp applies it
        convert_lora_to_gguf(adapter, base, out_dir / "adapter.gguf", "f16")  # half the bytes of f32
        files = {"gguf": ["adapter.gguf"]}
        base_model = f"stage 2D {cfg.tier} GGUF {gguf.name}"
    manifest = {
        "domain": "recovery",
        "base_tier": cfg.tier,
        "base_model": base_model,
        "lora": cfg.train.lora.model_dump(),
        "rows": cfg.rows,
        "kd": cfg.kd is not None,
        "metrics": metrics,
    }
    write_adapter_manifest(out_dir, files, **manifest)
    check, table = None, None
    if cfg.check is not None:
        if gguf is None:
            check = task_check(cfg.check, compressed, out_dir, work_dir / "check")
        else:
            check, table = gguf_check(cfg, reference, gguf, out_dir, tokenizer, data, work_dir / "check")
            metrics |= _table_metrics(table)
        metrics.update({f"check_{k}": float(v) for k, v in check.items()})
        write_adapter_manifest(out_dir, files, **manifest, default_weights=check["default_weights"])
    rows_out = [r.as_dict() for r in table] if table else None
    (out_dir / "recovery.json").write_text(json.dumps({**metrics, "check": check, "gguf_table": rows_out}, indent=2))
    if table:
        (out_dir / "gguf_table.md").write_text(fid_table(table) + "\n")
    return StageResult(metrics, ["recovery.json", "adapter.json", "axolotl.yaml"], _summary(cfg, metrics, check))


def _table_metrics(table: list) -> dict[str, float]:
    """The GGUF rows' figures, bare and with the LoRA, as metrics."""
    out = {}
    for row, key in zip(table[1:], ("gguf_bare", "gguf_lora")):
        out |= {
            f"{key}_ppl_ratio": row.ppl_ratio,
            f"{key}_kl": row.kl,
            f"{key}_ladder_passed": float(row.ladder_passed),
            f"{key}_bytes": float(row.bytes),
            f"{key}_tokens_per_s_ratio": row.tokens_per_s / max(table[0].tokens_per_s, 1e-9),
        }
    return out


def _summary(cfg: Config, metrics: dict, check: dict | None) -> str:
    share = metrics["recovered_share"]
    summary = (
        f"validation perplexity reference {metrics['val_perplexity_reference']:.2f}, compressed "
        f"{metrics['val_perplexity_compressed']:.2f}, compressed + recovery LoRA "
        f"{metrics['val_perplexity_recovered']:.2f} ("
        + (
            f"{share:.0%} of the compression cost recovered"
            if share == share
            else "compression cost under 1%: nothing to recover"
        )
        + f"; {_rows_said(cfg, metrics)})"
    )
    if "gguf_lora_ppl_ratio" in metrics:
        summary += (
            f"; on llama.cpp the shipped GGUF's perplexity ratio {metrics['gguf_bare_ppl_ratio']:.3f} bare, "
            f"{metrics['gguf_lora_ppl_ratio']:.3f} with the LoRA (KL {metrics['gguf_bare_kl']:.4f} -> "
            f"{metrics['gguf_lora_kl']:.4f})"
        )
    if check is not None:
        summary += (
            f"; held-out math ladder (mining part) {check['bare_passed']}/{check['tasks']} bare, "
            f"{check['adapter_passed']}/{check['tasks']} with the LoRA (p={check['p']:.2f}): "
            + ("the default weights" if check["default_weights"] else "not the default weights")
            + (f" (the rule: passes more at p <= {cfg.check.max_p})" if cfg.check.max_p < 1 else "")
        )
    return summary
