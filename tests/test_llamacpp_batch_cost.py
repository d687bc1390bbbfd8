"""``python -m eval.llamacpp_batch_cost``: a multi-token forward's cost in one-token steps, on a
real GGUF (stories260K) through the runtime's llama.cpp backend. No timing is asserted: only that
every size is measured, as a positive multiple of the step, and that bad arguments are refused."""

from __future__ import annotations

import math

import pytest

from eval.llamacpp_batch_cost import batch_costs, main
from eval.shared_data import SHARED
from tests.conftest import needs_shared

GGUF = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"


def test_every_size_is_measured_in_steps(capsys):
    needs_shared()
    pytest.importorskip("llama_cpp")
    one, costs = batch_costs(GGUF, [1, 3], threads=1, repeats=3)
    assert one > 0 and sorted(costs) == [1, 3]
    assert all(math.isfinite(c) and c > 0 for c in costs.values())
    assert main(["--gguf", str(GGUF), "--sizes", "2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 2 |" in out and "one-token step" in out


def test_a_missing_file_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--gguf", str(tmp_path / "nope.gguf")])
    assert "no such file" in capsys.readouterr().err
