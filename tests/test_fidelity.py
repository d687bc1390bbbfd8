"""The fidelity table's measurements against hand-computed values on a toy model, the rule that
chooses from it, and llama.cpp's quantizer taking an importance matrix (stories260K, ../shared)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.shared_data import SHARED
from methods.compression import fidelity as fid

STORIES = SHARED / "models" / "stories260K" / "hf"

# Two positions over a two-token vocabulary. Position 0: the reference says p = (1/2, 1/2), the row
# q = (3/4, 1/4), the true token is 0. Position 1: p = (4/5, 1/5), q = (1/2, 1/2), the true token is 1.
REFERENCE = np.log([[0.5, 0.5], [0.8, 0.2]])
ROW = np.log([[0.75, 0.25], [0.5, 0.5]]) + 7.0  # logits need not be normalised
TARGETS = [0, 1]
KL = [0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25), 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)]
# perplexity ratio = (prod_t p(x_t) / q(x_t))^(1/T) = ((0.5 / 0.75) * (0.2 / 0.5))^(1/2)
PPL_RATIO = ((0.5 / 0.75) * (0.2 / 0.5)) ** 0.5


def test_kl_and_perplexity_ratio_equal_the_hand_computed_values():
    d = fid.Divergence()
    d.add(REFERENCE, ROW, TARGETS)
    assert d.tokens == 2
    assert d.mean_kl == pytest.approx(sum(KL) / 2, abs=1e-12)
    assert d.ppl_ratio == pytest.approx(PPL_RATIO, abs=1e-12)
    assert d.ppl_reference == pytest.approx((1 / (0.5 * 0.2)) ** 0.5)  # exp(mean NLL) of p(x_t)
    assert d.ppl == pytest.approx((1 / (0.75 * 0.5)) ** 0.5)
    same = fid.Divergence()
    same.add(REFERENCE, REFERENCE + 3.0, TARGETS)  # a shifted copy is the same distribution
    assert same.mean_kl == pytest.approx(0.0, abs=1e-12) and same.ppl_ratio == pytest.approx(1.0)


def test_float32_logits_give_the_float64_figures():
    """llama.cpp's float32 logits are scored in float32 (half the bytes over a 49K vocabulary): the
    KL and perplexity ratio equal a float64 computation of the definitions."""
    rng = np.random.default_rng(3)
    reference = (rng.standard_normal((40, 5000)) * 3).astype(np.float32)
    row = reference + (rng.standard_normal((40, 5000)) * 0.3).astype(np.float32)
    targets = rng.integers(0, 5000, 40)

    def log_softmax(x):
        x = x.astype(np.float64)
        return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)

    p_log, q_log = log_softmax(reference), log_softmax(row)
    kl = (np.exp(p_log) * (p_log - q_log)).sum(-1).mean()
    at = np.arange(40), targets
    ratio = math.exp((p_log[at] - q_log[at]).mean())
    d = fid.Divergence()
    d.add(reference, row, targets)
    assert d.mean_kl == pytest.approx(kl, rel=1e-5) and d.ppl_ratio == pytest.approx(ratio, rel=1e-6)
    twice = fid.Divergence()  # the reference's side computed once serves every row
    ref = fid.ReferenceRows.of(reference, targets)
    twice.add_reference(ref, row, targets)
    twice.add_reference(ref, row, targets)
    assert twice.mean_kl == pytest.approx(d.mean_kl, rel=1e-9) and twice.tokens == 80


class _Session:
    def __init__(self, table: dict[tuple[int, ...], np.ndarray]):
        self.table = table

    def feed(self, ids: list[int], first: int = 0) -> np.ndarray:
        return self.table[tuple(ids)][first:]


class _Model:
    """A runtime model whose logits for a whole fed sequence are looked up in a table."""

    def __init__(self, table):
        self.table = table

    def new_session(self):
        return _Session(self.table)


class _Tokenizer:
    """Chat rendering stub: a row's ids are (10, 11, 12), the response starting at position 1."""


def test_divergence_scores_response_tokens_against_the_reference(monkeypatch):
    # ids (10, 0, 1): position 0 predicts token 0, position 1 predicts token 1; the last row of
    # logits (after the final token) predicts nothing.
    monkeypatch.setattr(fid, "encode", lambda tokenizer, turns, max_len: ([10, 0, 1], 1))
    monkeypatch.setattr(fid, "messages", lambda row: [])
    pad = np.zeros((1, 2))
    reference = _Model({(10, 0, 1): np.vstack([REFERENCE, pad])})
    row = _Model({(10, 0, 1): np.vstack([ROW, pad + 100.0])})
    out = fid.divergence(reference, {"q": row, "same": reference}, _Tokenizer(), [{}, {}], 64)
    assert out["q"].tokens == 4  # two rows, two response tokens each
    assert out["q"].mean_kl == pytest.approx(sum(KL) / 2)
    assert out["q"].ppl_ratio == pytest.approx(PPL_RATIO)
    assert out["same"].mean_kl == pytest.approx(0.0) and out["same"].ppl_ratio == pytest.approx(1.0)


def _row(name, size, ratio, passed, agreement=0.99, reference=False):
    return fid.FidelityRow(
        name, "src", name, False, None, size, 8.0, 5.0 * ratio, ratio, 0.01, passed, 48, agreement, 50.0, 100, reference
    )


def test_the_rule_takes_the_smallest_row_within_every_bound_and_says_why_not_for_the_others():
    rows = [
        _row("F16", 270, 1.0, 20, None, reference=True),
        _row("Q8_0", 145, 1.001, 20),
        _row("Q4_K_M", 100, 1.03, 19),
        _row("Q4_0", 80, 1.08, 19),  # perplexity
        _row("Q4_0 +imatrix", 80, 1.04, 17),  # ladder
        _row("Q3", 60, 1.02, 20, agreement=0.8),  # agreement
    ]
    chosen = fid.Rule(max_ppl_ratio=1.05, min_agreement=0.9, max_ladder_drop=1).choose(rows)
    assert chosen.name == "Q4_K_M" and chosen.chosen
    why = {r.name: r.why_not for r in rows}
    assert why["Q4_0"] == ["perplexity ratio 1.080 > 1.05"]
    assert why["Q4_0 +imatrix"] == ["ladder 17 < 20 - 1"]
    assert why["Q3"] == ["agreement 80.0% < 90%"]
    assert why["Q8_0"] == []
    text = fid.table(rows)
    assert "| Q4_K_M |" in text and "**chosen**" in text and "fits, larger" in text and "reference" in text
    assert fid.Rule(1.05, 0.9, 1).choose(rows[:1] + rows[3:5]) is None
    # a size cap (the input model's file) and the fastest row within it
    mb = [("F16", 270, 1.0, 50.0), ("Q8_0", 145, 1.001, 90.0), ("Q4_K_M", 100, 1.03, 70.0), ("Q5_0", 96, 1.04, 80.0)]
    rows = [_row(n, size * 1_000_000, ratio, 20, None if n == "F16" else 0.99, n == "F16") for n, size, ratio, _ in mb]
    for r, (*_, speed) in zip(rows, mb, strict=True):
        r.tokens_per_s = speed
    chosen = fid.Rule(1.05, 0.9, 1, max_bytes=98_000_000, prefer="fastest").choose(rows)
    assert chosen.name == "Q5_0" and [r.name for r in rows if r.chosen] == ["Q5_0"]
    assert rows[1].why_not == ["145.0 MB > 98.0 MB"] and rows[2].why_not == ["100.0 MB > 98.0 MB"]
    rows[2].bytes = 95_000_000
    assert fid.Rule(1.05, 0.9, 1, max_bytes=98_000_000, prefer="fastest").choose(rows).name == "Q5_0"
    assert "fits, slower" in fid.table(rows)
    assert fid.Rule(1.05, 0.9, 1, max_bytes=98_000_000).choose(rows).name == "Q4_K_M"  # the smallest
    with pytest.raises(ValueError, match="no reference row"):
        fid.Rule(1.05, 0.9, 1).choose(rows[1:])
    with pytest.raises(ValueError, match="prefer must be"):
        fid.Rule(1.05, 0.9, prefer="cheapest")
    with pytest.raises(ValueError, match="over_size must be"):
        fid.Rule(1.05, 0.9, over_size="largest")
    # the card's sentence names every bound the rule checks, from the same fields
    assert str(fid.Rule(1.05, 0.9, None, ladder_alpha=0.05, max_bytes=98_362_432, prefer="fastest")) == (
        "the most tokens/s with perplexity ratio <= 1.05, a ladder not worse than the reference's, in all and "
        "in each domain (one-sided exact McNemar, p < 0.05), agreement not below 90% (its 95% interval's upper "
        "end), at most 98.4 MB"
    )
    # agreement is refused on its interval: 89.96% [88.0%, 91.8%] is not shown below 90%, [85%, 89%] is
    edge = _row("Q4_0-mix", 96, 1.04, 26, agreement=0.8996)
    edge.agreement_interval = (0.880, 0.918)
    below = _row("Q4_1", 90, 1.04, 26, agreement=0.87)
    below.agreement_interval = (0.85, 0.89)
    ref = _row("F16", 270, 1.0, 26, None, reference=True)
    assert fid.Rule(1.05, 0.9, 1).why_not(ref, edge) == []
    assert fid.Rule(1.05, 0.9, 1).why_not(ref, below) == ["agreement 87.0% [85.0%, 89.0%] < 90%"]


def test_over_the_size_cap_the_rule_takes_the_smallest_row_that_keeps_the_other_bounds():
    """No row within ``max_bytes`` keeps the quality bounds: ``over_size="smallest"`` ships the smallest row
    that does (not a fixed fallback type 40 MB larger), and its verdict says how far over it is; a row that
    misses a quality bound is never taken, and ``"fallback"`` (the default) takes none."""
    rows = [
        _row("F16", 270_000_000, 1.0, 20, None, reference=True),
        _row("Q8_0", 145_000_000, 1.002, 20),
        _row("Q5_0", 105_000_000, 1.035, 20),
        _row("Q4_K_M", 106_000_000, 1.03, 20),
        _row("mix", 96_000_000, 1.04, 15),  # within the cap, misses the ladder
        _row("Q4_0", 92_000_000, 1.09, 20),  # within the cap, misses perplexity
    ]
    for r, speed in zip(rows, (50.0, 77.0, 70.0, 80.0, 100.0, 95.0), strict=True):
        r.tokens_per_s = speed
    capped = dict(max_ppl_ratio=1.05, min_agreement=0.9, max_ladder_drop=2, max_bytes=98_000_000, prefer="fastest")
    assert fid.Rule(**capped).choose(rows) is None  # the default: the recipe's fallback ships
    assert not any(r.chosen for r in rows)
    rule = fid.Rule(**capped, over_size="smallest")
    chosen = rule.choose(rows)
    assert chosen.name == "Q5_0" and [r.name for r in rows if r.chosen] == ["Q5_0"]
    assert chosen.why_not == ["105.0 MB > 98.0 MB"]  # chosen over the cap: its note stays
    assert rows[4].why_not == ["ladder 15 < 20 - 2"] and rows[5].why_not == ["perplexity ratio 1.090 > 1.05"]
    text = fid.table(rows)
    assert "| **chosen** (105.0 MB > 98.0 MB) |" in text and "| 145.0 MB > 98.0 MB |" in text
    assert str(rule).endswith(
        "at most 98.0 MB; if no row within that size keeps the other bounds, the smallest row that does"
    )
    rows[4].ladder_passed = 19  # a row within the cap keeps every bound: it ships, the larger ones do not
    assert rule.choose(rows).name == "mix" and rows[2].why_not == ["105.0 MB > 98.0 MB"] and not rows[2].chosen


def test_the_ladder_bound_is_a_paired_test_against_the_reference_not_a_count():
    """48 tasks cannot tell a drop of 4 from noise (one file passed 30 and 31 of them on two runs):
    with ``ladder_alpha`` a row is refused only when it passes fewer than the reference by a one-sided
    exact McNemar test, computed here by hand; a collapse still fails."""
    ref = [True] * 34 + [False] * 14
    rows = [_row("F16", 270, 1.0, 34, None, reference=True), _row("drift", 96, 1.04, 30)]
    rows.append(_row("collapse", 98, 1.04, 16))
    rows[0].ladder = ref
    rows[1].ladder = [False] * 6 + [True] * 28 + [True] * 2 + [False] * 12  # lost 6, won 2
    rows[2].ladder = [False] * 20 + [True] * 14 + [True] * 2 + [False] * 12  # lost 20, won 2
    assert fid.ladder_versus(rows[0], rows[1]) == (6, 2, pytest.approx(sum(math.comb(8, k) for k in (6, 7, 8)) / 2**8))
    lost, won, p = fid.ladder_versus(rows[0], rows[2])
    assert (lost, won) == (20, 2) and p == pytest.approx(sum(math.comb(22, k) for k in range(20, 23)) / 2**22)
    chosen = fid.Rule(1.05, 0.9, ladder_alpha=0.05).choose(rows)
    assert chosen.name == "drift"  # p = 0.145: not worse by the test, though 4 fewer than the reference
    assert rows[2].why_not == [f"ladder worse: -20 +2, one-sided McNemar p = {p:.3f} < 0.05"]
    assert fid.Rule(1.05, 0.9, 3, ladder_alpha=0.05).choose(rows) is None  # both bounds when both are set
    assert "| 30/48 (-6 +2) |" in fid.table(rows)
    rows[1].ladder = rows[1].ladder[:40]
    with pytest.raises(ValueError, match="drift: 40 ladder verdicts, the reference has 48"):
        fid.ladder_versus(rows[0], rows[1])


def test_a_loss_in_one_domain_is_not_hidden_by_a_gain_in_another():
    """The 186cd37 small demo's chosen 4-bit mix passed 48 of 84 mining tasks against the reference's 49
    (-6 +5): math -5 +1, code -1 +4. Each domain is tested apart as well as in all: a math collapse under
    a code gain is refused, and the table's ladder cell shows each domain."""
    domains = ["math"] * 24 + ["code"] * 24
    ref = [True] * 12 + [False] * 12 + [True] * 12 + [False] * 12
    lost_math = [False] * 9 + [True] * 3 + [False] * 12  # math: lost 9 of the reference's 12, won none
    won_code = [True] * 12 + [True] * 8 + [False] * 4  # code: kept 12, won 8
    rows = [_row("F16", 270, 1.0, 24, None, reference=True), _row("mix", 96, 1.04, 23)]
    rows[0].ladder, rows[1].ladder = ref, lost_math + won_code
    for r in rows:
        r.ladder_domains = domains
    assert fid.ladder_versus(rows[0], rows[1])[:2] == (9, 8)  # in all: no loss to see
    p_math = 1 / 2**9
    assert fid.ladder_by_domain(rows[0], rows[1]) == [
        ("math", 3, 24, 9, 0, pytest.approx(p_math)),
        ("code", 20, 24, 0, 8, 1.0),
    ]
    assert fid.Rule(1.05, 0.9, ladder_alpha=0.05).choose(rows) is None
    assert rows[1].why_not == [f"math ladder worse: -9 +0, one-sided McNemar p = {p_math:.3f} < 0.05"]
    text = fid.table(rows)
    assert "| 24/48: math 12/24, code 12/24 |" in text  # the reference's row
    assert "| 23/48 (-9 +8): math 3/24 (-9 +0), code 20/24 (-0 +8) |" in text
    rows[0].ladder_domains = rows[1].ladder_domains = []  # one domain (or a table from before): no split
    assert fid.ladder_by_domain(rows[0], rows[1]) == [] and fid.Rule(1.05, 0.9, ladder_alpha=0.05).choose(rows)
    with pytest.raises(ValueError, match="mix: 2 ladder verdicts but 1 domains"):
        fid.FidelityRow.measured("mix", "r", "Q4_0", 1, 1, None, [True, False], 1.0, ladder_domains=["math"])


def test_llama_cpp_quantizes_with_an_importance_matrix_named_for_the_gguf(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES} (absent on this machine)")
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from core.contract import KibidangoError
    from methods.compression.gguf import quantize
    from methods.compression.imatrix import compute_imatrix, gguf_tensor_widths
    from methods.llama_cpp_tools import convert_hf_to_gguf

    f16 = convert_hf_to_gguf(STORIES, tmp_path / "m-F16.gguf")
    rows = [{"instruction": "", "input": "", "output": "Once upon a time there was a little dog. He liked to run."}] * 3
    imatrix = compute_imatrix(STORIES, f16, rows, 64)
    _, widths = gguf_tensor_widths(f16)
    assert len(imatrix) == 7 * 5  # q, k, v, output, gate, up, down in each of 5 blocks; the tied head none
    assert all(name in widths and len(v) == widths[name] for name, v in imatrix.items())
    assert all(np.isfinite(v).all() and (v >= 0).all() for v in imatrix.values())
    # the first block's q projection reads the first attention norm of the embeddings: recompute it
    model = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32).eval()
    from transformers import AutoTokenizer

    from methods.training.chat import encode, messages

    ids, _ = encode(AutoTokenizer.from_pretrained(str(STORIES)), messages(rows[0]), 64)
    with torch.inference_mode():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([ids])))[0]
    np.testing.assert_allclose(imatrix["blk.0.attn_q.weight"], (x.double() ** 2).mean(0).numpy(), rtol=1e-5)

    plain = quantize(f16, tmp_path / "p-Q4_0.gguf", "Q4_0")
    weighted = quantize(f16, tmp_path / "w-Q4_0.gguf", "Q4_0", imatrix=imatrix)
    assert plain.stat().st_size == weighted.stat().st_size and plain.read_bytes() != weighted.read_bytes()
    embedding = quantize(f16, tmp_path / "e-Q4_0.gguf", "Q4_0", embedding_type="F16")
    assert embedding.stat().st_size > plain.stat().st_size  # the tied embedding kept at 16 bits
    # llama-quantize's --tensor-type: a pattern searched in each name; the rest keep the type's choice
    mixed = quantize(f16, tmp_path / "m-Q4_0.gguf", "Q4_0", tensor_types={r"ffn_(gate|up)": "Q8_0", "attn_v": "F16"})
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(mixed)).tensors}
    for block in range(5):
        assert types[f"blk.{block}.ffn_gate.weight"] == types[f"blk.{block}.ffn_up.weight"] == "Q8_0"
        assert types[f"blk.{block}.attn_v.weight"] == "F16"
        assert types[f"blk.{block}.attn_q.weight"] == types[f"blk.{block}.attn_k.weight"] == "Q4_0"
    with pytest.raises(KibidangoError, match="unknown llama.cpp tensor type 'Q7' for tensors 'attn_v'"):
        quantize(f16, tmp_path / "x-Q4_0.gguf", "Q4_0", tensor_types={"attn_v": "Q7"})
    with pytest.raises(KibidangoError, match="non-finite"):
        quantize(f16, tmp_path / "n-Q4_0.gguf", "Q4_0", imatrix={"blk.0.attn_q.weight": np.full(64, np.nan)})


def test_gguf_parameters_read_from_the_header_match_llama_cpp() -> None:
    """2D's bits per weight divide by the weights its header lists: llama.cpp's own count, no model loaded."""
    path = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"
    if not path.is_file():
        pytest.skip(f"needs {path} (../shared)")
    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from methods.compression.gguf import gguf_parameters

    assert gguf_parameters(path) == LlamaCppModel(path, name="t").parameters() == 292_800


def test_a_row_reads_its_figures_off_the_divergence_and_ladder():
    d = fid.Divergence(nll_reference=2.0 * 10, nll=2.1 * 10, kl=0.5, tokens=10)
    row = fid.FidelityRow.measured("Q4_0", "reference", "Q4_0", 500, 1000, d, [True, False, True], 42.0, agreement=0.9)
    assert (row.bits_per_weight, row.ladder_passed, row.ladder_tasks, row.tokens) == (4.0, 2, 3, 10)
    assert row.ppl == pytest.approx(np.exp(2.1)) and row.ppl_ratio == pytest.approx(np.exp(0.1))
    assert row.kl == pytest.approx(0.05) and row.agreement == 0.9 and not row.reference
    ref = fid.FidelityRow.reference_of("F16", "reference", 2000, 1000, d, [True] * 3, 40.0)
    assert ref.reference and ref.ppl == pytest.approx(np.exp(2.0)) and (ref.ppl_ratio, ref.kl) == (1.0, 0.0)
    assert (ref.bits_per_weight, ref.agreement, ref.quant) == (16.0, None, "F16")


class _StepSession:
    """Logits over 8 tokens: the next token is the last one + 1, except after ``flip``."""

    def __init__(self, flip: int | None) -> None:
        self.flip, self.last = flip, None

    def feed(self, ids: list[int], first: int = 0) -> np.ndarray:
        rows = []
        for t in ids:
            nxt = 0 if t == self.flip else (t + 1) % 8
            rows.append(np.eye(8)[nxt] * 5.0)
        return np.stack(rows)[first:]


class _StepModel:
    def __init__(self, flip: int | None = None) -> None:
        self.flip = flip

    def new_session(self) -> _StepSession:
        return _StepSession(self.flip)


class _DecodeTokenizer:
    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def test_token_agreement_along_shared_greedy_paths_with_an_interval_over_prompts():
    from methods.compression.gguf import greedy_paths, token_agreement

    hf, gguf = _StepModel(), _StepModel(flip=5)  # the GGUF differs wherever the path reaches token 5
    prompts = [[0], [4], [6], [1, 2]]
    paths = greedy_paths(hf, prompts, 4)
    assert [p for p, _ in paths] == [[1, 2, 3, 4], [5, 6, 7, 0], [7, 0, 1, 2], [3, 4, 5, 6]]
    report = token_agreement(hf, gguf, _DecodeTokenizer(), prompts, 4, paths)
    # teacher-forced: only the position after a 5 differs (prompt 2 at 1, prompt 4 at 3)
    assert report.per_prompt == [(4, 4), (3, 4), (4, 4), (3, 4)]
    assert (report.agreement, report.positions, report.identical_prompts) == (14 / 16, 16, 2)
    assert [d.position for d in report.divergences] == [1, 3]
    assert token_agreement(hf, gguf, _DecodeTokenizer(), prompts, 4) == report  # the paths are hf's own
    lo, hi = report.interval()
    assert 0.75 <= lo <= report.agreement <= hi == 1.0  # the resampled shares lie between 3/4 and 1
    same = token_agreement(hf, hf, _DecodeTokenizer(), prompts, 4, paths)
    assert same.agreement == 1.0 and same.interval() == (1.0, 1.0)


def test_the_table_shows_agreement_with_its_interval():
    d = fid.Divergence(nll_reference=20.0, nll=21.0, kl=0.5, tokens=10)
    row = fid.FidelityRow.measured(
        "Q5_0", "reference", "Q5_0", 500, 1000, d, [True], 42.0, agreement=0.893, agreement_interval=(0.871, 0.912)
    )
    ref = fid.FidelityRow.reference_of("F16", "reference", 2000, 1000, d, [True], 40.0, 0.995, (0.99, 1.0))
    assert (ref.agreement, ref.agreement_interval) == (0.995, (0.99, 1.0))
    text = fid.table([ref, row])
    assert "89.3% [87.1%, 91.2%]" in text and "99.5% [99.0%, 100.0%]" in text


def test_ladder_answers_decoded_together_are_the_answers_one_at_a_time():
    """The table's ladder answers through the runtime's batching (llama.cpp, several sequences per
    decode) are the ones the model gives one at a time."""
    gguf = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"
    if not (gguf.is_file() and STORIES.is_dir()):
        pytest.skip(f"needs stories260K at {STORIES} and {gguf} (absent on this machine)")
    pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from methods.ladder import ladder_rows

    tokenizer = AutoTokenizer.from_pretrained(str(STORIES))
    model = LlamaCppModel(gguf, threads=1)
    rows = ladder_rows("math", [1, 2], "mining", 6)
    alone = fid.ladder_answers(model, tokenizer, rows, 24)
    together = fid.ladder_answers(model, tokenizer, rows, 24, parallel=4)
    assert together == alone and len(set(alone)) > 1  # different prompts, different answers
    assert fid.ladder_pass(model, tokenizer, rows, 24, parallel=4) == [False] * len(rows)  # a story model


def test_one_pass_gives_the_divergence_and_the_agreement_the_separate_measurements_give():
    """2D's shared pass (each path continues its row's session after a crop to the prompt) gives
    each model the divergence and the token agreement that scoring each alone gives."""
    gguf = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"
    if not (gguf.is_file() and STORIES.is_dir()):
        pytest.skip(f"needs stories260K at {STORIES} and {gguf} (absent on this machine)")
    pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from kibidango.backends.torch_backend import TorchModel
    from methods.compression.gguf import agreement_report, greedy_paths, token_agreement
    from methods.measure import lm

    tokenizer = AutoTokenizer.from_pretrained(str(STORIES))
    reference, hf = LlamaCppModel(gguf, threads=1), TorchModel(STORIES)
    models = {"gguf": LlamaCppModel(gguf, threads=1, name="again"), "hf": hf}
    stories = ["Once upon a time there was a little cat. She liked milk.", "Tom had a red ball. He threw it far."]
    rows = [{"instruction": "", "input": "", "output": s} for s in stories]
    rows.append({"instruction": "", "input": "", "output": "Hi"})  # too short for a prompt
    rows.append({"instruction": "", "input": "", "output": "The sun was hot and the dog was sleepy and slow."})
    prompts = lm.held_out_prompts(tokenizer, rows)
    assert [p.row for p in prompts] == [0, 1, 3]
    paths = greedy_paths(hf, [p.ids for p in prompts], 6)
    along = {p.row: (len(p.ids), path) for p, (path, _) in zip(prompts, paths)}
    scored = fid.fidelity_pass(reference, models, tokenizer, rows, 64, along)
    alone = fid.divergence(reference, models, tokenizer, rows, 64)
    for name in models:
        assert scored.divergence[name].tokens == alone[name].tokens > 0
        assert scored.divergence[name].mean_kl == pytest.approx(alone[name].mean_kl, abs=1e-4)
    for key, model in [(None, reference), *models.items()]:
        choices = [scored.along[key][p.row] for p in prompts]
        shared = agreement_report(tokenizer, [p.ids for p in prompts], paths, choices)
        separate = token_agreement(hf, model, tokenizer, [p.ids for p in prompts], 6, paths)
        assert shared.per_prompt == separate.per_prompt, key
    assert scored.along["hf"] and all(len(c) == 6 for c in scored.along["hf"].values())
    assert (
        agreement_report(
            tokenizer, [p.ids for p in prompts], paths, [scored.along["hf"][p.row] for p in prompts]
        ).agreement
        == 1.0
    )


def test_the_ladder_judges_each_task_by_its_domain(monkeypatch):
    """2D's ladder may hold code tasks beside the math ones (the loop's largest gain is in code): each
    answer is judged by its own domain's judge, a program in the code judge's sandbox."""
    from methods.ladder import ladder_rows

    rows = [{**r, "domain": d} for d in ("math", "code") for r in ladder_rows(d, [2], "mining", 2)]
    assert all(r["task"].reference for r in rows)
    answers = [rows[0]["task"].reference, "#### -1", rows[2]["task"].reference, "def nothing():\n    return None\n"]
    monkeypatch.setattr(fid, "ladder_answers", lambda model, tokenizer, rs, n, parallel=1: answers[: len(rs)])
    assert fid.ladder_pass(None, None, rows, 96) == [True, False, True, False]
    plain = [{k: v for k, v in r.items() if k != "domain"} for r in rows[:2]]  # no domain: math
    assert fid.ladder_pass(None, None, plain, 96) == [True, False]
