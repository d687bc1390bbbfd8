"""Continuous batching (kibidango.decode.batching): requests decoding on their own threads share forward
passes. On torch (float64 models: batched and single forwards agree to ~1e-15) every mode gives
each request exactly the tokens it gets alone, while forwards really carry several requests; a
request joins a running batch and leaves it; llama.cpp's multi-sequence context scores several
sequences in one decode as separate sessions do, cropping included."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kibidango.decode.batching import Batcher, LlamaCppSlots, TorchSlots, _Feed
from kibidango.decode.speculative import DecodeConfig, Metrics
from kibidango.pipeline import Pipeline
from tests.conftest import PROMPTS, SHARED

GGUF = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"


def _alone(models, prompt, cfg):
    pipe = Pipeline(None, dict(models), cfg)
    return [t for new in pipe.decoder.generate(prompt, cfg) for t in new]


def _together(batcher: Batcher, pipe: Pipeline, prompts, cfgs, stagger: float = 0.0):
    """Each prompt decoded on its own thread inside the batcher; ``stagger``: seconds between starts."""
    out: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    gate = threading.Barrier(len(prompts)) if not stagger else None

    def run(i: int) -> None:
        try:
            if gate is not None:
                gate.wait()
            with batcher.member():
                out[i] = [t for new in pipe.decoder.generate(prompts[i], cfgs[i]) for t in new]
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = []
    for i in range(len(prompts)):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        if stagger:
            threads[-1].join(timeout=stagger)
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return [out[i] for i in range(len(prompts))]


def _queued(batcher: Batcher, pipe: Pipeline, prompts, cfgs, slots: int):
    """Every prompt on its own thread, started at once, at most ``slots`` of them decoding (what the
    server's scheduler does): later ones join as earlier ones leave."""
    out: dict[int, list[int]] = {}
    seats = threading.Semaphore(slots)

    def run(i: int) -> None:
        with seats, batcher.member():
            out[i] = [t for new in pipe.decoder.generate(prompts[i], cfgs[i]) for t in new]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "mode, extra",
    [("ar", {}), ("sd", {"k": 3}), ("pyramid", {"variant": "exact", "l_D": 2, "l_Q": 4}), ("lookup", {"k": 3})],
)
def test_batched_requests_get_the_tokens_they_get_alone(family, mode, extra):
    cfgs = [DecodeConfig(mode=mode, max_new_tokens=10 + 3 * i, temperature=0.0, **extra) for i in range(6)]
    alone = [_alone(family, p, c) for p, c in zip(PROMPTS, cfgs)]
    pipe = Pipeline(None, dict(family), cfgs[0])
    batcher = Batcher(pipe, slots=6)
    try:
        together = _together(batcher, pipe, PROMPTS, cfgs)
        assert together == alone
        assert batcher.stats.feeds > batcher.stats.forwards  # forwards carried several requests
        assert max(batcher.stats.rows) > 1
    finally:
        batcher.close()


def test_sampled_requests_keep_their_seeds_under_batching(family):
    cfgs = [DecodeConfig(mode="sd", k=3, max_new_tokens=12, temperature=1.0, seed=i) for i in range(4)]
    alone = [_alone(family, p, c) for p, c in zip(PROMPTS, cfgs)]
    pipe = Pipeline(None, dict(family), cfgs[0])
    batcher = Batcher(pipe, slots=4)
    try:
        assert _together(batcher, pipe, PROMPTS[:4], cfgs) == alone
    finally:
        batcher.close()


def test_requests_join_and_leave_a_running_batch(family):
    """Requests started one after another, with different lengths: later ones join while earlier
    ones decode, finished ones leave, slots are reused; each still gets its own tokens."""
    cfgs = [DecodeConfig(mode="ar", max_new_tokens=n, temperature=0.0) for n in (30, 5, 20, 8, 25, 3)]
    alone = [_alone(family, p, c) for p, c in zip(PROMPTS, cfgs)]
    pipe = Pipeline(None, dict(family), cfgs[0])
    batcher = Batcher(pipe, slots=3)
    try:
        assert _queued(batcher, pipe, PROMPTS, cfgs, 3) == alone
        assert batcher.free and sorted(batcher.free) == [0, 1, 2] and batcher.running == 0
        assert max(batcher.stats.rows) > 1
    finally:
        batcher.close()


def test_torch_ar_steps_run_on_the_slots_cache_in_place(family):
    """ar steps of a running batch run on the preallocated cache as it is (a prefix of the slots,
    nothing gathered or copied); only a prefill beside running sequences gathers its row."""
    cfgs = [DecodeConfig(mode="ar", max_new_tokens=24, temperature=0.0) for _ in range(4)]
    alone = [_alone(family, p, c) for p, c in zip(PROMPTS, cfgs)]
    pipe = Pipeline(None, dict(family), cfgs[0])
    batcher = Batcher(pipe, slots=4)
    try:
        assert _together(batcher, pipe, PROMPTS[:4], cfgs) == alone
        steps, gathered = batcher.stats.forwards, batcher.tiers["target"].gathered
        capacity = batcher.tiers["target"].cache.capacity
    finally:
        batcher.close()
    assert steps >= 24 and gathered < steps / 4, (gathered, steps)
    assert capacity < 2 * (max(len(p) for p in PROMPTS[:4]) + 24) + 64  # grown by doubling, not per step


def test_a_slot_cropped_back_and_placeholders_never_touch_a_sequences_tokens(family):
    """Unequal prompts and lengths, sd's rejections (crops) and slots joining at different times:
    each request keeps exactly its own tokens, and the slots are given back empty."""
    cfgs = [DecodeConfig(mode="sd", k=3, max_new_tokens=n, temperature=0.0) for n in (30, 4, 17, 9, 25, 2)]
    alone = [_alone(family, p, c) for p, c in zip(PROMPTS, cfgs)]
    pipe = Pipeline(None, dict(family), cfgs[0])
    batcher = Batcher(pipe, slots=4)
    try:
        assert _queued(batcher, pipe, PROMPTS, cfgs, 4) == alone
        assert batcher.tiers["target"].length == [0, 0, 0, 0]
    finally:
        batcher.close()


def test_a_prompt_reuses_what_a_slots_cache_holds_of_it(family):
    """Prefix caching: prompts sharing a start (a chat template's system prompt) and one prompt
    sampled again and again, one after another as a self-teaching tier draws them: each request
    gets exactly the tokens it gets alone, while the shared starts were copied from a slot's cache
    (after the request that computed them ended too), not computed again."""
    system = [1, 7, 7, 30, 31, 32, 33, 34, 35, 36]
    prompts = [system + p[1:] for p in PROMPTS[:4]]
    greedy = [DecodeConfig(mode="ar", max_new_tokens=8 + 2 * i, temperature=0.0) for i in range(4)]
    again = [DecodeConfig(mode="sd", k=3, max_new_tokens=10, temperature=1.0, seed=i) for i in range(5)]
    alone = [_alone(family, p, c) for p, c in zip(prompts, greedy)]
    sampled = [_alone(family, prompts[1], c) for c in again]
    pipe = Pipeline(None, dict(family), greedy[0])
    batcher = Batcher(pipe, slots=3)
    try:
        assert _queued(batcher, pipe, prompts[:1], greedy[:1], 1) == alone[:1]
        target = batcher.tiers["target"]
        assert target.reused == 0  # nothing held yet
        assert _together(batcher, pipe, prompts[1:3], greedy[1:3]) == alone[1:3]
        first = target.reused
        assert first >= 2 * len(system)  # both found the system prompt (and its first token after) held
        assert _queued(batcher, pipe, prompts[3:], greedy[3:], 3) == alone[3:]
        for i, cfg in enumerate(again):  # one after another: the prompt's slot was given back each time
            assert _queued(batcher, pipe, [prompts[1]], [cfg], 1) == [sampled[i]]
        assert target.reused >= first + len(system) + len(again) * (len(prompts[1]) - 1)
        assert batcher.tiers["draft"].reused > 0  # the draft's own slots, without the target's adapters
        assert target.prompts >= sum(map(len, prompts)) + len(again) * len(prompts[1])  # sd: a draft block after some
    finally:
        batcher.close()


def test_placeholders_overwrite_what_a_free_slot_held(family):
    """A free slot's held tokens are cut where a running batch's placeholder wrote into its cache;
    a later prompt equal to what it held reuses only the positions still intact, and its rows are
    those of a cache that never held anything."""
    long = [1] + list(range(10, 40))

    def prompt(slot: int, tokens: list[int]) -> _Feed:
        return _Feed("target", slot, 0, list(tokens), None, first=len(tokens) - 1)

    slots = TorchSlots(family["target"], 3)
    slots.forward([prompt(1, long)])
    slots.release(1)
    assert slots.held[1] == (None, long)
    slots.forward([prompt(0, [1, 5, 9]), prompt(2, [1, 60, 2])])  # slots [0, 3) in place: a placeholder in 1
    assert slots.held[1] == (None, long[:3])  # written from position 3 on
    again, before = prompt(1, long), slots.reused
    slots.forward([again])
    assert slots.reused - before == 3 and again.cached == 3

    fresh = TorchSlots(family["target"], 1)
    alone = prompt(0, long)
    fresh.forward([alone])
    assert fresh.reused == 0
    np.testing.assert_allclose(again.rows, alone.rows, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    "mode, extra, temperature",
    [
        ("ar", {}, 0.0),
        ("lookup", {"k": 3, "adaptive": True, "k_max": 8}, 0.0),
        ("sd", {"k": 3}, 0.0),
        ("sd", {"k": 3, "seed": 5}, 0.9),  # sampled: rejections drawn from the residual, bonus tokens
        ("pyramid", {"variant": "fuzzy", "l_D": 2, "l_Q": 4, "tau_Q": 0.3, "tau_T": 0.3}, 0.0),
    ],
)
def test_answer_features_from_the_decoding_equal_a_scoring_pass(family, mode, extra, temperature):
    """Metrics.answer_stats: each committed token's figures, reduced from the target's logits that
    chose it as it was decoded (a verification pass's rows in lookup, sd and pyramid), give an
    answer the features a second forward over prompt and answer gives."""
    from kibidango.addons.confidence import AnswerStats, score_answer

    cfg = DecodeConfig(mode=mode, max_new_tokens=24, temperature=temperature, **extra)
    pipe = Pipeline(None, dict(family), cfg)
    verified = 0
    for prompt in (PROMPTS[0], PROMPTS[3], [1, 7, 8, 9, 7, 8, 9, 7, 8]):  # repeats: lookup finds drafts
        metrics = Metrics(mode)
        metrics.answer_stats = AnswerStats(1.3)
        answer = [t for new in pipe.decoder.generate(list(prompt), cfg, metrics) for t in new]
        verified += sum(metrics.num_draft_tokens.values())
        stats = metrics.answer_stats
        assert len(stats) >= len(answer) > 0
        scored = score_answer(pipe.models["target"], list(prompt), answer, 1.3)
        reused = score_answer(pipe.models["target"], list(prompt), answer, 1.3, stats)
        assert reused.keys() == scored.keys()
        for key in scored:
            assert reused[key] == pytest.approx(scored[key], rel=1e-5, abs=1e-6), (prompt, key)
    assert verified > 0 or mode == "ar"  # the rows came from verification passes, not ar steps only
    with pytest.raises(ValueError, match="temperature 1.3, not 1.0"):
        score_answer(pipe.models["target"], list(prompt), answer, 1.0, stats)


def test_answer_stats_token_by_token_equal_the_whole_answers():
    """AnswerStats reduces one row at a time what answer_features computes over the answer's rows:
    the same values (each figure is a per-row one), three floats a token kept."""
    from kibidango.addons import confidence

    rng = np.random.default_rng(1)
    logits, answer = rng.normal(size=(21, 300)).astype(np.float32), rng.integers(0, 300, 21)
    stats = confidence.AnswerStats(0.7)
    for row, token in zip(logits, answer, strict=True):
        stats.add(row, int(token))
    assert len(stats) == 21 and stats.features(0) is None
    assert stats.features(21) == confidence.answer_features(logits, list(answer), 0.7)
    assert stats.features(9) == confidence.answer_features(logits[:9], list(answer[:9]), 0.7)
    with pytest.raises(ValueError, match="22 tokens asked for, 21 decoded"):
        stats.features(22)


def test_answer_features_a_few_rows_at_a_time_equal_the_whole_answers():
    """answer_features bounds its float64 temporaries by computing a few rows at a time; every
    figure is a per-row one, so the values are the whole-array formulas' exactly."""
    from kibidango.addons import confidence

    rng = np.random.default_rng(0)
    logits, answer, t = rng.normal(size=(37, 500)).astype(np.float32), rng.integers(0, 500, 37), 1.3
    whole = confidence._log_softmax(logits)
    token = whole[np.arange(37), answer]
    calibrated = confidence._log_softmax(logits / t)[np.arange(37), answer]
    got = confidence.answer_features(logits, list(answer), t)
    assert 37 % confidence._ROWS and got == {
        "mean_logprob": float(token.mean()),
        "min_logprob": float(token.min()),
        "mean_entropy": float((-(np.exp(whole) * whole).sum(axis=-1)).mean()),
        "tokens": 37.0,
        "calibrated_mean_logprob": float(calibrated.mean()),
    }


@pytest.mark.parametrize("backend", ["torch", "llamacpp"])
def test_the_scoring_pass_reads_the_answer_a_few_rows_at_a_time(family, backend):
    """score_answer (a `lookup` or `sd` answer's confidence: no logits kept as it was decoded) feeds the
    prompt, then the answer ``_ROWS`` tokens at a time, and never asks the backend for more rows at
    once; its features are those of one pass over prompt and answer (the form it had, which held a
    row of the vocabulary per answer token twice: +28 MB of SmolLM2's peak RSS)."""
    from kibidango.addons import confidence

    if backend == "torch":
        target, answer = family["target"], [7, 3, 60, 12, 5, 5, 9, 40, 33, 2, 17, 1, 44, 8, 8, 30, 21, 6, 11]
    else:
        if not GGUF.is_file():
            pytest.skip(f"needs stories260K's GGUF at {GGUF}")
        pytest.importorskip("llama_cpp")
        from kibidango.backends.llamacpp_backend import LlamaCppModel

        target, answer = LlamaCppModel(GGUF, threads=1), [403, 407, 261, 378, 9, 300, 66, 67, 68, 69, 70, 71, 5, 6, 7]
    prompt = list(PROMPTS[1])
    assert len(answer) - 1 > confidence._ROWS and (len(answer) - 1) % confidence._ROWS
    whole = confidence.answer_features(
        target.new_session().feed(prompt + answer, first=len(prompt) - 1)[:-1], answer, 1.3
    )
    asked, opened = [], target.new_session

    def session():
        s = opened()
        feed = s.feed
        s.feed = lambda tokens, first=0: asked.append(len(tokens) - first) or feed(tokens, first)
        return s

    target.new_session = session
    try:
        got = confidence.score_answer(target, prompt, answer, 1.3)
    finally:
        del target.new_session
    full, rest = divmod(len(answer) - 1, confidence._ROWS)
    assert asked == [1, *[confidence._ROWS] * full, rest]  # the prompt's last row, then the answer's
    assert got.keys() == whole.keys()
    for key in whole:
        assert got[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-4), key


def test_a_model_outside_a_member_is_refused(family):
    pipe = Pipeline(None, dict(family), DecodeConfig(mode="ar", max_new_tokens=2))
    batcher = Batcher(pipe, slots=2)
    try:
        with pytest.raises(RuntimeError, match="outside Batcher.member"):
            list(pipe.decoder.generate([1, 2], pipe.defaults))
    finally:
        batcher.close()


def test_llama_cpp_scores_several_sequences_in_one_decode_as_separate_sessions_do():
    if not GGUF.is_file():
        pytest.skip(f"needs stories260K's GGUF at {GGUF}")
    pytest.importorskip("llama_cpp")
    from kibidango.backends.llamacpp_backend import LlamaCppModel

    model = LlamaCppModel(GGUF, threads=1)
    slots = LlamaCppSlots(model, 3)
    seqs = [[1, 403, 407, 261, 378], [1, 9, 300], [1, 66, 67, 68, 69, 70, 71]]
    try:
        first = [_Feed("target", i, 0, s, None) for i, s in enumerate(seqs)]
        slots.forward(first)
        # Then: sequence 0 rolls back two tokens and goes on, 1 takes one token, 2 takes three.
        then = [_Feed("target", 0, 3, [500, 17], None), _Feed("target", 1, 3, [42], None)]
        then.append(_Feed("target", 2, 7, [5, 6, 7], None))
        slots.forward(then)
        for i, s in enumerate(seqs):
            alone = model.new_session()
            rows = alone.feed(s)
            assert np.allclose(rows, first[i].rows, atol=1e-3), i
            keep = then[i].cached
            alone.crop(keep)
            assert np.allclose(alone.feed(then[i].tokens), then[i].rows, atol=1e-3), i
        # a feed that reads only its last rows (a prompt's) gets exactly those, alone and in a batch
        tail = [_Feed("target", i, 0, s, None, first=len(s) - 2) for i, s in enumerate(seqs)]
        slots.forward(tail)
        for i, s in enumerate(seqs):
            whole = model.new_session().feed(s)
            assert tail[i].rows.shape == (2, whole.shape[1]) and np.allclose(tail[i].rows, whole[-2:], atol=1e-3), i
            assert np.allclose(model.new_session().feed(s, first=len(s) - 1), whole[-1:], atol=1e-3), i
    finally:
        slots.close()


def test_llama_cpp_a_forward_that_fails_midway_leaves_no_cells_behind():
    """A forward of more tokens than one decode takes whose second decode fails (a token outside the
    vocabulary): the first decode's cells go, so each slot fed again from 0 gets a fresh session's rows."""
    if not GGUF.is_file():
        pytest.skip(f"needs stories260K's GGUF at {GGUF}")
    pytest.importorskip("llama_cpp")
    from kibidango.backends.llamacpp_backend import LlamaCppModel

    model = LlamaCppModel(GGUF, threads=1)
    n = 4096 // model.context_length + 1  # enough slots that their contexts exceed one decode
    slots = LlamaCppSlots(model, n)
    try:
        assert slots.capacity < n * model.context_length
        length = slots.capacity // n + 8  # each slot's prompt: all of them together need two decodes
        seqs = [[1] + [(7 * i + 3 * j) % 400 + 10 for j in range(length - 1)] for i in range(n)]
        bad = [_Feed("target", i, 0, s, None, first=len(s) - 1) for i, s in enumerate(seqs)]
        bad[-1].tokens[-1] = model.vocab_size + 5
        with pytest.raises(RuntimeError, match="llama_decode returned"):
            slots.forward(bad)
        again = [_Feed("target", i, 0, s[:40], None, first=39) for i, s in enumerate(seqs)]
        slots.forward(again)
        for i, s in enumerate(seqs):
            assert np.allclose(model.new_session().feed(s[:40], first=39), again[i].rows, atol=1e-3), i
    finally:
        slots.close()


def test_llama_cpp_prompts_share_the_cells_of_a_start_another_sequence_holds():
    """A prompt whose start a sequence holds takes its cells (llama_memory_seq_cp) and decodes the
    rest; its rows are those of a fresh session's, and the holder's later crop leaves them alone."""
    if not GGUF.is_file():
        pytest.skip(f"needs stories260K's GGUF at {GGUF}")
    pytest.importorskip("llama_cpp")
    from kibidango.backends.llamacpp_backend import LlamaCppModel

    model = LlamaCppModel(GGUF, threads=1)
    slots = LlamaCppSlots(model, 2)
    start = [1, 403, 407, 261, 378, 66, 67]
    try:
        slots.forward([_Feed("target", 0, 0, start + [9, 300], None, first=8)])
        other = _Feed("target", 1, 0, start + [42, 43], None, first=8)
        slots.forward([other])
        assert slots.reused == len(start) and other.cached == len(start)
        slots.forward([_Feed("target", 0, 2, [5, 6], None)])  # the holder crops back to 2 and goes on
        on = _Feed("target", 1, len(start) + 2, [44], None)
        slots.forward([on])
        alone = model.new_session()
        assert np.allclose(alone.feed(start + [42, 43], first=8), other.rows, atol=1e-3)
        assert np.allclose(alone.feed([44]), on.rows, atol=1e-3)
        # two prompts in one decode share nothing the other has not decoded yet
        fresh = LlamaCppSlots(model, 2)
        try:
            both = [_Feed("target", i, 0, start + [9 + i, 300], None, first=8) for i in range(2)]
            fresh.forward(both)
            assert fresh.reused == 0
            for i, f in enumerate(both):
                assert np.allclose(model.new_session().feed(start + [9 + i, 300], first=8), f.rows, atol=1e-3)
        finally:
            fresh.close()
    finally:
        slots.close()
