"""``--compile`` (torch): the draft's and qualifier's single-token steps compiled on a static cache
give the eager model's logits through feeds, steps and crops, and the lossless modes still output
exactly what target-only decoding does (the target is never compiled). No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from kibidango.backends.torch_backend import TorchModel
from kibidango.decode.speculative import DecodeConfig, Decoder, Metrics
from tests.conftest import PROMPTS, _perturbed, tiny_llama


@pytest.fixture(scope="module")
def compiled_family():
    draft = TorchModel.from_hf(_perturbed(0.15, 1), "draft")
    qualifier = TorchModel.from_hf(_perturbed(0.05, 2), "qualifier")
    draft.compile_steps()
    qualifier.compile_steps()
    return {
        "draft": draft,
        "qualifier": qualifier,
        "target": TorchModel.from_hf(tiny_llama(0, hidden=48, layers=3, scale=20.0), "target"),
    }


def test_compiled_steps_match_eager_through_steps_and_crops(compiled_family):
    compiled = compiled_family["draft"]
    eager = TorchModel.from_hf(_perturbed(0.15, 1), "draft")
    a, b = compiled.new_session(), eager.new_session()
    script = [
        ("feed", [1, 5, 9, 12]),
        ("feed", [3]),
        ("feed", [7]),
        ("crop", 5),
        ("feed", [8]),
        ("feed", [2, 4, 6]),
        ("crop", 4),
        ("feed", [11]),
        ("feed", [13]),
    ]
    for op, arg in script:
        if op == "crop":
            a.crop(arg)
            b.crop(arg)
            continue
        np.testing.assert_allclose(a.feed(arg), b.feed(arg), rtol=1e-5, atol=1e-5)  # float32 logits
        assert a.tokens == b.tokens
    assert a.forward_calls == b.forward_calls


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_lossless_modes_stay_exact_with_compiled_steps(compiled_family, prompt):
    def run(**kw):
        m = Metrics(kw["mode"])
        cfg = DecodeConfig(max_new_tokens=30, **kw)
        return [t for chunk in Decoder(compiled_family).generate(prompt, cfg, m) for t in chunk]

    ar = run(mode="ar")
    assert run(mode="sd", k=4) == ar
    assert run(mode="pyramid", variant="exact", l_D=2, l_Q=6) == ar
