"""What 2B/2C, the bundle card and bundle.json say a compressed-tensors checkpoint holds is read
from its config, not assumed: the small preset's target is W8A16 while tiny's is W4A16."""

from methods.compression.card import scheme_label, size_table, weight_bits


def _config(bits: int, symmetric: bool = False, group_size: int | None = 64) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False}
    weights.update({"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"})
    group = {"format": "pack-quantized", "input_activations": None, "targets": ["Linear"], "weights": weights}
    return {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}}


def test_the_scheme_is_read_from_the_checkpoint_config():
    assert scheme_label(_config(8)) == "W8A16 asymmetric, groups of 64"
    assert scheme_label(_config(4, symmetric=True, group_size=None)) == "W4A16 symmetric, per channel"
    assert weight_bits(_config(8)) == 8 and weight_bits(_config(4)) == 4
    assert scheme_label({}) == "?" and weight_bits({"quantization_config": {}}) is None


def test_the_card_shows_the_bits_each_awq_stage_recorded():
    stages = {
        "2D": {"metrics": {"target_gguf_bytes": 2e8, "target_hf_bytes": 5e8}},
        "2B": {"metrics": {"target_bytes_after": 2.2e8, "target_weight_bits": 8.0}},
        "2C": {"metrics": {"draft_bytes_after": 1e8}},
    }
    stages["2D"]["metrics"]["draft_gguf_bytes"] = 1e8
    table = size_table(stages)
    assert "| target | 500.000 MB | - | 220.000 MB (8-bit) |" in table
    assert "| draft | - | - | 100.000 MB |" in table  # a stage that recorded no bits (runs before it did)
