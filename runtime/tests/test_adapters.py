"""Domain adapters: lazy loading from adapter.json, hash checks, and applying a peft LoRA."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from kibidango.addons.adapters import AdapterSet
from kibidango.bundle import BundleError
from tests.conftest import tiny_llama


def _write_adapter(root, domain: str) -> None:
    peft = pytest.importorskip("peft")
    model = tiny_llama(0)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    lora.save_pretrained(str(root / domain / "adapter"))
    files = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        p = root / domain / "adapter" / name
        files.append(
            {"path": f"adapter/{name}", "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        )
    (root / domain / "adapter.json").write_text(
        json.dumps({"schema": 1, "domain": domain, "base_tier": "target", "formats": {"peft": files}})
    )


def test_adapters_load_lazily_and_change_the_model(tmp_path):
    _write_adapter(tmp_path, "code")
    adapters = AdapterSet(tmp_path)
    assert adapters.domains == ["code"] and adapters._loaded == {}
    x = torch.tensor([[1, 2, 3]])
    base = tiny_llama(0)
    with torch.no_grad():
        before = base(input_ids=x).logits
        after = adapters.get("code").apply_peft(tiny_llama(0))(input_ids=x).logits
    assert not torch.allclose(before, after)  # init_lora_weights=False: the adapter does something
    with pytest.raises(BundleError, match="no adapter for domain 'math'.*have: code"):
        adapters.get("math")
    with pytest.raises(BundleError, match="has no gguf files"):
        adapters.get("code").gguf_path()


def test_a_tampered_adapter_file_is_refused_by_name(tmp_path):
    _write_adapter(tmp_path, "code")
    weights = tmp_path / "code" / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="adapter_model.safetensors does not match its sha256"):
        AdapterSet(tmp_path).get("code").apply_peft(tiny_llama(0))
