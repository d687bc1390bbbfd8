from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kibidango.backends.torch_backend import TorchModel

SHARED = Path(os.environ.get("KIBIDANGO_SHARED", Path(__file__).resolve().parents[3] / "shared"))
STORIES = SHARED / "models" / "stories260K" / "hf"


def needs_stories() -> None:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES} (absent on this machine)")


def stories_bundle(tmp_path_factory, name: str) -> Path:
    """A bundle of stories260K alone (ar, preset ``tiny``) for a test module; skips without it."""
    from kibidango import write_bundle

    needs_stories()
    root = tmp_path_factory.mktemp(name)
    return write_bundle(
        root / "bundle", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]}, preset="tiny"
    )


def tiny_llama(seed: int, hidden: int = 32, layers: int = 2, vocab: int = 64, scale: float = 1.0, kv_heads: int = 2):
    """A random Llama in float64 (so batched and one-token forwards agree to ~1e-15 and greedy
    ties cannot flip between them); 4 query heads on ``kv_heads`` key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).double()
    with torch.no_grad():  # sharper distributions than the default init, like a trained model
        model.lm_head.weight.mul_(scale)
    return model


def _perturbed(rel: float, seed: int):
    """The target's weights plus Gaussian noise of ``rel`` times each tensor's spread."""
    model = tiny_llama(0, hidden=48, layers=3, scale=20.0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rel * p.std() * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def family():
    """Three different random models sharing a 64-token vocabulary: the target, a qualifier (the
    target with 5% noise) and a draft (15% noise), so that agreement falls from qualifier to draft."""
    models = {
        "draft": _perturbed(0.15, 1),
        "qualifier": _perturbed(0.05, 2),
        "target": tiny_llama(0, hidden=48, layers=3, scale=20.0),
    }
    return {name: TorchModel.from_hf(m, name) for name, m in models.items()}


PROMPTS = [[1, 5, 9], [1, 17, 3, 40, 2], [1, 60], [1, 33, 33, 33], [1, 2, 3, 4, 5, 6, 7], [1, 44, 12, 9, 9, 50]]
