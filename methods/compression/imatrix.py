"""An importance matrix for llama.cpp's quantizer, computed on calibration rows.

What ``llama-imatrix`` computes, from the transformers model instead of a GGUF: for every weight
matrix a linear layer multiplies, the mean over calibration tokens of each input column's squared
activation (``sum_t x_t[j]^2 / T``). llama.cpp's quantizer then weights each weight's rounding
error by its column's importance, so the columns the model reads most loudly round best (Q4_0,
Q4_1, Q5_0 and the k-quants all use it). The entries are keyed by the GGUF tensor names, mapped
from the transformers module names by gguf-py's own :class:`gguf.TensorNameMap` for the
architecture the GGUF file declares; every entry is checked against the file (name and row
width) before the quantizer sees it.

llama.cpp takes it through ``llama_model_quantize_params.imatrix``, a null-terminated array of
``{name, data, size}`` (:func:`methods.compression.gguf.quantize`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.contract import KibidangoError
from methods.training.chat import encode, messages

__all__ = ["compute_imatrix", "gguf_tensor_widths"]


def gguf_tensor_widths(gguf_path: Path) -> tuple[str, dict[str, int]]:
    """The architecture a GGUF declares and each tensor's row width (``ne[0]``)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    return arch, {t.name: int(t.shape[0]) for t in reader.tensors}


def compute_imatrix(model_dir: Path, gguf_path: Path, rows: list[dict], max_len: int) -> dict[str, np.ndarray]:
    """``{gguf tensor name: mean squared input activation per column}`` of every linear layer of
    the transformers model in ``model_dir`` over the tokens of ``rows`` (stage 0 rows in the
    model's chat template), named as in ``gguf_path`` (the model converted to GGUF)."""
    import torch
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoTokenizer

    from methods.measure.lm import load_causal_lm

    if not rows:
        raise KibidangoError("an importance matrix needs calibration rows; none were given")
    arch_name, widths = gguf_tensor_widths(gguf_path)
    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise KibidangoError(f"{gguf_path}: gguf-py knows no architecture {arch_name!r}")
    model = load_causal_lm(model_dir).float().cpu()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        gguf_name = names.get_name(f"{module_name}.weight", try_suffixes=(".weight",))
        if gguf_name is None:
            continue
        if gguf_name not in widths:  # a tied head: llama.cpp reads token_embd, which gets no imatrix
            continue
        if widths[gguf_name] != module.in_features:
            raise KibidangoError(
                f"{gguf_path}: tensor {gguf_name} is {widths[gguf_name]} wide, "
                f"{module_name} reads {module.in_features} inputs"
            )

        def hook(_module, args, key=gguf_name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[key] = sums.get(key, 0) + (x * x).sum(0)
            counts[key] = counts.get(key, 0) + x.shape[0]

        hooks.append(module.register_forward_pre_hook(hook))
    if not hooks:
        raise KibidangoError(f"{model_dir}: no linear layer maps to a tensor of {gguf_path}")
    try:
        with torch.inference_mode():
            for r in rows:
                ids, _ = encode(tokenizer, messages(r), max_len)
                model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return {k: (sums[k] / counts[k]).float().numpy() for k in sorted(sums)}
