"""Language-model measurements the stages log: parameters, loss/perplexity on the response tokens
of held-out rows (the one implementation; ``validation_loss`` reads stage 0's validation split for
it), and how well a smaller tier predicts a larger one.

Agreement figures are measured on the *target's own greedy path* from held-out prompts (what the
target would emit, so what a draft must guess):

- ``agreement``: share of positions where the student's argmax equals the target's;
- ``expected_acceptance``: mean over positions of sum_x min(p_T(x), p_S(x)) at temperature 1,
  the per-token acceptance probability of speculative sampling (Leviathan et al. 2023, alpha);
- ``sd_acceptance`` / ``pyramid_*``: the real acceptance rates of the runtime's ``sd`` and
  ``pyramid`` decoders (greedy) on the same prompts — counts from :mod:`kibidango`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from core.contract import KibidangoError
from methods.training.chat import encode, load_split, messages

__all__ = [
    "Prompt",
    "load_causal_lm",
    "parameters",
    "response_loss",
    "row_losses",
    "held_out_prompts",
    "target_paths",
    "agreement",
    "runtime_acceptance",
    "summarise",
    "validation_loss",
    "validation_rows",
]


def load_causal_lm(path: Path | str, adapter: Path | str | None = None):
    """A transformers model in float32, eval mode; a peft adapter directory (``path`` itself, or
    ``adapter`` on top of ``path``) is loaded onto its base and merged."""
    import json

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if adapter is None and (Path(path) / "adapter_config.json").is_file():
        path, adapter = json.loads((Path(path) / "adapter_config.json").read_text())["base_model_name_or_path"], path
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16 if cuda else torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.to("cuda" if cuda else "cpu").eval()


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _keeps_logits(model) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (transformers' causal LMs since 4.50:
    the head runs on the positions asked for only)."""
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _response_nll(model, tokenizer, rows: list[dict], max_len: int, batch: int) -> list[tuple[float, int]]:
    """(summed cross-entropy, token count) over the response tokens of each row, in order.

    Rows go through the model in batches of similar length (sorted by length: a batch of random
    lengths pads most rows to its longest), the head (a 49,152 x 576 matrix for SmolLM2: a fifth
    of its forward) runs only from the batch's first response position on, and the cross-entropy
    only on response tokens. The same sums as one row at a time, up to float rounding."""
    encoded = [encode(tokenizer, messages(r), max_len) for r in rows]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    keep = _keeps_logits(model)
    out: list[tuple[float, int]] = [(0.0, 0)] * len(encoded)
    with torch.inference_mode():
        for i in range(0, len(order), batch):
            chunk = order[i : i + batch]
            width = max(len(encoded[j][0]) for j in chunk)
            x = torch.zeros(len(chunk), width, dtype=torch.long)
            labels = torch.full((len(chunk), width), -100, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, j in enumerate(chunk):
                ids, start = encoded[j]
                x[r, : len(ids)] = torch.tensor(ids)
                mask[r, : len(ids)] = 1
                if len(ids) > start:
                    labels[r, start : len(ids)] = torch.tensor(ids[start:])
            # position p's logits predict token p + 1: the first needed is the earliest response token's
            first = min((max(encoded[j][1], 1) for j in chunk), default=1) - 1
            first = max(0, min(first, width - 2)) if width > 1 else 0
            kwargs = {"logits_to_keep": torch.arange(first, width - 1)} if keep and width > 1 else {}
            logits = model(input_ids=x.to(model.device), attention_mask=mask.to(model.device), **kwargs).logits
            if not kwargs:
                logits = logits[:, first : width - 1]
            target = labels[:, first + 1 : width]
            where = target != -100
            nll = torch.zeros(target.shape, dtype=torch.float32)
            if where.any():
                nll[where] = torch.nn.functional.cross_entropy(
                    logits[where.to(logits.device)].float(), target[where].to(logits.device), reduction="none"
                ).cpu()
            for r, j in enumerate(chunk):
                out[j] = (float(nll[r].sum()), int(where[r].sum()))
    return out


def response_loss(model, tokenizer, rows: list[dict], max_len: int, batch: int = 16) -> dict[str, float]:
    """Mean cross-entropy per response token (the tokens after the prompt; every token after BOS
    for plain text) over ``rows``, and its perplexity."""
    return summarise(_response_nll(model, tokenizer, rows, max_len, batch))


def summarise(per_row: list[tuple[float, int]]) -> dict[str, float]:
    """Loss per token, perplexity and token count of (summed cross-entropy, tokens) per row."""
    count = sum(n for _, n in per_row)
    loss = sum(t for t, _ in per_row) / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": float(count)}


def row_losses(model, tokenizer, rows: list[dict], max_len: int, batch: int = 16) -> list[float]:
    """Mean cross-entropy per response token of each row (nan for a row with no response token)."""
    return [t / n if n else float("nan") for t, n in _response_nll(model, tokenizer, rows, max_len, batch)]


@dataclass
class Prompt:
    ids: list[int]
    row: int | None = None
    """The index of the held-out row it was cut from (:func:`held_out_prompts`)."""


def held_out_prompts(tokenizer, rows: list[dict], story_prefix_tokens: int = 8, max_len: int = 192) -> list[Prompt]:
    """One prompt per held-out row: the rendered instruction (up to where the reply starts) for
    instruction rows, the reply's opening + its first ``story_prefix_tokens`` tokens for plain text."""
    out = []
    for i, r in enumerate(rows):
        turns = messages(r)
        ids, start = encode(tokenizer, turns, max_len)
        cut = start if len(turns) > 1 else start + story_prefix_tokens
        if 1 < cut < len(ids):
            out.append(Prompt(ids[:cut], i))
    return out


def target_paths(target, prompts: list[Prompt], new_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy continuation, prompt length) per prompt."""
    paths = []
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p.ids], device=target.device)
            out = target.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            paths.append((out[0].tolist(), len(p.ids)))
    return paths


def agreement(target, student, paths: list[tuple[list[int], int]]) -> dict[str, float]:
    """Greedy agreement and expected acceptance of ``student`` against ``target`` at every
    position of the target's greedy paths."""
    agree, accept, n = 0.0, 0.0, 0
    with torch.inference_mode():
        for ids, start in paths:
            lt = target(input_ids=torch.tensor([ids], device=target.device)).logits[0, start - 1 : -1].float().cpu()
            ls = student(input_ids=torch.tensor([ids], device=student.device)).logits[0, start - 1 : -1].float().cpu()
            pt, ps = lt.softmax(-1), ls.softmax(-1)
            agree += float((lt.argmax(-1) == ls.argmax(-1)).sum())
            accept += float(torch.minimum(pt, ps).sum(-1).sum())
            n += lt.shape[0]
    return {"agreement": agree / max(n, 1), "expected_acceptance": accept / max(n, 1), "positions": float(n)}


def runtime_acceptance(
    models: dict,
    prompts: list[Prompt],
    new_tokens: int,
    *,
    k: int = 4,
    l_D: int = 3,
    l_Q: int = 6,
    tau_Q: float = 0.3,
    tau_T: float = 0.2,
) -> dict[str, float]:
    """Acceptance counts of the runtime's own decoders (greedy) over ``prompts``: ``sd`` with
    draft -> target, and ``pyramid`` (fuzzy) with draft -> qualifier -> target. ``models`` maps
    tier names to in-memory transformers models."""
    from kibidango.backends.torch_backend import TorchModel
    from kibidango.decode.speculative import DecodeConfig, Decoder, Metrics

    tiers = {name: TorchModel.from_hf(m, name) for name, m in models.items()}
    decoder = Decoder(tiers)
    out: dict[str, float] = {}
    for mode in ("sd", "pyramid"):
        total = Metrics(mode)
        cfg = DecodeConfig(
            mode=mode,
            variant="fuzzy",
            k=k,
            l_D=l_D,
            l_Q=l_Q,
            tau_Q=tau_Q,
            tau_T=tau_T,
            max_new_tokens=new_tokens,
            temperature=0.0,
        )
        for p in prompts:
            m = Metrics(mode)
            for _ in decoder.generate(p.ids, cfg, m):
                pass
            total.add(m)
        if mode == "sd":
            out["sd_acceptance_rate"] = total.acceptance_rate("draft") or 0.0
            out["sd_mean_acceptance_length"] = total.mean_acceptance_length
        else:
            out["pyramid_draft_acceptance_rate"] = total.acceptance_rate("draft") or 0.0
            out["pyramid_qualifier_acceptance_rate"] = total.acceptance_rate("qualifier") or 0.0
            out["pyramid_target_forwards_per_token"] = total.target_forwards_per_token
    return out


def validation_rows(
    model_dir: Path | str, data_dir: Path, rows: int, max_len: int, adapter: Path | None = None
) -> list[tuple[float, int]]:
    """(summed cross-entropy, response tokens) of ``rows`` rows of stage 0's validation split, taken
    in turn from each domain (:func:`load_split`'s ``by_domain``), under a transformers checkpoint
    (dense or compressed-tensors, optionally with a LoRA adapter); :func:`summarise` makes them a loss."""
    from transformers import AutoTokenizer

    val = load_split(data_dir, "validation", limit=rows, by_domain=True)
    if not val:
        raise KibidangoError(f"{data_dir}: stage 0's validation split is empty")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return _response_nll(load_causal_lm(model_dir, adapter=adapter), tokenizer, val, max_len, 16)


def validation_loss(
    model_dir: Path | str, data_dir: Path, rows: int, max_len: int, adapter: Path | None = None
) -> dict[str, float]:
    """Response-token loss and perplexity of a transformers checkpoint (dense or
    compressed-tensors, optionally with a LoRA adapter) on ``rows`` rows of stage 0's validation split
    drawn in turn from each domain: the same rows for every stage, so the figures line up."""
    return summarise(validation_rows(model_dir, data_dir, rows, max_len, adapter))
