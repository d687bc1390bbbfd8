"""Per-request routing (6A) to domain adapters, loaded lazily into an LRU, and the calibrated
confidence (2G): through the Python API, the CLI and the server, on a real bundle (stories260K
target, two peft LoRAs, a router, a calibrator)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from kibidango import BundleError, load_bundle, write_bundle
from kibidango.addons.confidence import ANSWER_FEATURES, Calibrator, Logistic
from kibidango.addons.router import Router, features
from tests.conftest import STORIES, needs_stories

CODE = "def add(a, b): return a + b  # python function"
MATH = "What is 12 + 30? Compute the sum of the numbers."


def _router() -> Router:
    """One linear layer whose outputs are each label's similarity to an example query: routes
    CODE to code and MATH to math with high confidence."""
    w = np.zeros((128, 3), np.float32)
    w[:, 0], w[:, 1] = 40 * features(CODE), 40 * features(MATH)
    return Router(["code", "math", "base"], [(w, np.array([0, 0, 20], np.float32))])


def _adapter(dest, domain: str, seed: int) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(STORIES))
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(model, cfg).save_pretrained(str(dest / "adapter"))
    files = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        p = dest / "adapter" / name
        files.append(
            {"path": f"adapter/{name}", "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        )
    (dest / "adapter.json").write_text(
        json.dumps({"schema": 1, "domain": domain, "base_tier": "target", "formats": {"peft": files}})
    )


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    needs_stories()
    root = tmp_path_factory.mktemp("routed")
    calibrator = Calibrator(
        {"torch": 1.3},
        Logistic(list(ANSWER_FEATURES), [1.0, 0.5, -0.5, 0.0, 1.0], -1.0, [-2.0, -5.0, 3.0, 20.0, -2.0], [1.0] * 5),
    )

    def finalize(tmp):
        for domain, seed in (("code", 1), ("math", 2)):
            (tmp / "adapters" / domain).mkdir(parents=True)
            _adapter(tmp / "adapters" / domain, domain, seed)
        for key, body in (("router", _router().to_dict()), ("calibration", calibrator.to_dict())):
            (tmp / key).mkdir()
            (tmp / key / f"{key}.json").write_text(json.dumps(body))
        (tmp / "cascade").mkdir()
        (tmp / "cascade" / "cascade.json").write_text(json.dumps({"schema": 1, "router": {"threshold": 0.6}}))
        return {
            "router": "router/router.json",
            "calibration": "calibration/calibration.json",
            "cascade": "cascade/cascade.json",
        }

    tiers = {"target": {"hf": STORIES, "vocab_size": 512}}
    return write_bundle(root / "bundle", tiers, {"mode": "ar", "stop_ids": [2]}, finalize, preset="test")


def test_auto_loads_the_adapter_the_router_picks_once_across_requests(bundle):
    from kibidango import Pipeline

    pipe = Pipeline.from_bundle(bundle, adapter="auto", adapter_cache=2)
    assert pipe.adapters.loaded == {} and pipe.router_threshold == 0.6  # lazy; threshold from cascade.json
    seen = []
    for query in (CODE, CODE, MATH, CODE, "Once upon a time there was a cat"):
        m = pipe.generate(query, max_new_tokens=4).metrics
        seen.append((m.domain, m.adapter))
        assert pipe.resolve_adapter(query) == (m.adapter, m.domain, m.router_confidence)  # loads nothing
        assert m.router_confidence is not None and 0 < m.router_confidence <= 1
        assert m.confidence is not None and 0 <= m.confidence <= 1
    assert seen[:4] == [("code", "code"), ("code", "code"), ("math", "math"), ("code", "code")]
    assert seen[4][1] is None  # base: the target's own weights
    assert pipe.adapters.loads == 2 and pipe.adapters.evictions == 0  # each adapter loaded once

    small = Pipeline.from_bundle(bundle, adapter="auto", adapter_cache=1)
    for query in (CODE, MATH, CODE):
        small.generate(query, max_new_tokens=2)
    assert small.adapters.loads == 3 and small.adapters.evictions == 2  # bounded: LRU out, loaded again


def test_an_adapter_changes_the_target_and_none_restores_it_exactly(bundle):
    from kibidango import Pipeline

    pipe = Pipeline.from_bundle(bundle, adapter="none")
    target = pipe.models["target"]
    ids = pipe.encode("Once upon a time")
    base = target.new_session().feed(ids)
    pipe.adapters.use("code")
    code = target.new_session().feed(ids)
    pipe.adapters.use("math")
    math = target.new_session().feed(ids)
    pipe.adapters.use(None)
    again = target.new_session().feed(ids)
    assert not np.allclose(base, code) and not np.allclose(code, math)
    assert np.array_equal(base, again)
    m = pipe.generate(CODE, max_new_tokens=2).metrics
    assert (m.domain, m.adapter) == ("code", None)  # routed and reported, not applied: --adapter none
    assert pipe.generate(CODE, max_new_tokens=2, adapter="math").metrics.adapter == "math"
    assert Pipeline.from_bundle(bundle, adapter="math").generate(CODE, max_new_tokens=2).metrics.adapter == "math"
    with pytest.raises(BundleError, match="no such domain adapter.*code, math"):
        Pipeline.from_bundle(bundle, adapter="poetry")


@pytest.fixture(scope="module")
def recovered(tmp_path_factory, bundle):
    """The routed bundle plus a recovery adapter (2F) named as its ``default_adapter``."""
    root = tmp_path_factory.mktemp("recovered")

    def finalize(tmp):
        import shutil

        for part in ("adapters", "router", "calibration", "cascade"):
            shutil.copytree(bundle / part, tmp / part)
        (tmp / "adapters" / "recovery").mkdir()
        _adapter(tmp / "adapters" / "recovery", "recovery", 3)
        return {
            "router": "router/router.json",
            "calibration": "calibration/calibration.json",
            "cascade": "cascade/cascade.json",
            "default_adapter": "recovery",
        }

    tiers = {"target": {"hf": STORIES, "vocab_size": 512}}
    return write_bundle(root / "bundle", tiers, {"mode": "ar", "stop_ids": [2]}, finalize, preset="test")


def test_auto_runs_the_default_adapter_where_no_domain_adapter_is_routed(recovered):
    from kibidango import Pipeline
    from kibidango.pipeline import _default_adapter

    pipe = Pipeline.from_bundle(recovered, adapter="auto", adapter_cache=1)
    assert pipe.default_adapter == "recovery"
    story = "Once upon a time there was a cat"
    used = [pipe.generate(q, max_new_tokens=2).metrics.adapter for q in (story, CODE, MATH, story)]
    assert used == ["recovery", "code", "math", "recovery"]
    assert (pipe.adapters.loads, pipe.adapters.evictions) == (3, 1)  # code out for math; the default stays
    assert pipe.generate(story, max_new_tokens=2, adapter="none").metrics.adapter is None  # the control

    target, ids = pipe.models["target"], pipe.encode(story)
    pipe.adapters.use(None)
    bare = target.new_session().feed(ids)
    pipe.adapters.use("recovery")
    assert not np.allclose(bare, target.new_session().feed(ids))  # the default weights differ from the bare ones

    shipped = load_bundle(recovered)
    assert _default_adapter(shipped, shipped.adapters, "llamacpp") is None  # no gguf form: the bare weights


def test_a_default_adapter_the_bundle_does_not_ship_is_refused(bundle, tmp_path):
    from kibidango import Pipeline

    def finalize(tmp):
        import shutil

        shutil.copytree(bundle / "adapters", tmp / "adapters")
        return {"default_adapter": "recovery"}

    tiers = {"target": {"hf": STORIES, "vocab_size": 512}}
    broken = write_bundle(tmp_path / "b", tiers, {"mode": "ar", "stop_ids": [2]}, finalize, preset="test")
    with pytest.raises(BundleError, match="default_adapter 'recovery': not shipped .it ships: code, math"):
        Pipeline.from_bundle(broken)


def test_the_calibrated_confidence_follows_the_calibrator(bundle):
    from kibidango import Pipeline
    from kibidango.addons.confidence import AnswerStats, score_answer

    pipe = Pipeline.from_bundle(bundle, adapter="none")
    target = pipe.models["target"]
    sessions = []
    opened = target.new_session
    target.new_session = lambda: sessions.append(1) or opened()
    result = pipe.generate("Once upon a time", max_new_tokens=8)
    # scored from the logits that chose each token as it was decoded: no second pass over prompt and answer
    assert len(sessions) == 1 and result.metrics.answer_stats is None
    looked = pipe.generate("Once upon a time", max_new_tokens=8, mode="lookup", k=3)
    assert len(sessions) == 2  # lookup too: the rows of its verification passes, no scoring pass
    del target.new_session
    ids = pipe.encode("Once upon a time")
    for got in (result, looked):
        answer = [t for t in got.token_ids if t != 2]
        feats = score_answer(target, ids, answer, 1.3)  # one forward pass over prompt and answer
        assert got.metrics.confidence == pytest.approx(pipe.calibrator.confidence(feats), rel=1e-4)
    stats = AnswerStats(1.3)
    kept = pipe.generate("Once upon a time", max_new_tokens=8, answer_stats=stats)
    assert kept.metrics.answer_stats is stats and len(stats) == len(kept.token_ids)  # the caller's are kept
    scored = score_answer(target, ids, [t for t in kept.token_ids if t != 2], 1.3)
    assert kept.metrics.confidence == pytest.approx(pipe.calibrator.confidence(scored), rel=1e-4)
    assert pipe.generate("Once upon a time", max_new_tokens=8, score=False).metrics.confidence is None


def test_a_tampered_calibrator_is_refused(bundle, tmp_path):
    import shutil

    copy = shutil.copytree(bundle, tmp_path / "copy")
    spec = json.loads((copy / "calibration" / "calibration.json").read_text())
    spec["temperature"]["torch"] = 0.1
    (copy / "calibration" / "calibration.json").write_text(json.dumps(spec))
    with pytest.raises(BundleError, match="calibration.json does not match its sha256"):
        load_bundle(copy)


def test_cli_and_server_report_domain_adapter_and_confidence(bundle, capsys):
    from starlette.testclient import TestClient

    from kibidango import Pipeline
    from kibidango.cli import main
    from kibidango.server.app import create_app

    assert (
        main(["generate", "--bundle", str(bundle), "--adapter", "auto", "--max-new-tokens", "3", "--stats", CODE]) == 0
    )
    err = capsys.readouterr().err
    stats = json.loads(err[err.index('{\n  "mode"') :])
    assert (stats["domain"], stats["adapter"]) == ("code", "code") and 0 <= stats["confidence"] <= 1
    pipe = Pipeline.from_bundle(bundle, adapter="auto")
    with TestClient(create_app(pipe, model_name="kibidango-test")) as client:
        for content in (MATH, MATH):
            r = client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], "max_tokens": 3}
            )
            assert r.status_code == 200, r.text
            k = r.json()["kibidango"]
            assert (k["domain"], k["adapter"]) == ("math", "math") and 0 <= k["confidence"] <= 1
        r = client.post("/v1/completions", json={"prompt": CODE, "max_tokens": 2, "adapter": "none"})
        assert r.json()["kibidango"]["adapter"] is None
        assert client.post("/v1/completions", json={"prompt": CODE, "adapter": "poetry"}).status_code == 400
        metrics = client.get("/metrics").text
    assert 'kibidango_adapter_loads_total{model="kibidango-test"} 1' in metrics
    assert 'kibidango_requests_by_domain_total{model="kibidango-test",domain="math"} 2' in metrics
    assert 'kibidango_answer_confidence_count{model="kibidango-test"} 3' in metrics


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"answer": {"weights": [1e308] * 5, "std": [1e-308] * 5}}, "gives nan on a probe answer"),
        ({"temperature": {"torch": 1e-320}}, "a temperature outside"),
        ({"temperature": {"torch": 1e9}}, "a temperature outside"),
    ],
)
def test_a_calibrator_that_gives_no_finite_confidence_is_refused_at_load(bundle, tmp_path, change, message):
    from kibidango.addons.confidence import Calibrator

    spec = json.loads((bundle / "calibration" / "calibration.json").read_text())
    for key, value in change.items():
        spec[key] = {**spec[key], **value} if isinstance(spec[key], dict) else value
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(BundleError, match=message):
        Calibrator.load(path)


def test_a_non_finite_confidence_at_run_time_is_null_with_its_reason_never_a_500(bundle):
    """A calibrator that passes the load probe but overflows on a real answer (inf - inf): the
    response says confidence null and why, in strict JSON, streamed or not."""
    from starlette.testclient import TestClient

    from kibidango import Pipeline
    from kibidango.addons.confidence import Calibrator
    from kibidango.server.app import create_app

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a response"))

    pipe = Pipeline.from_bundle(bundle, adapter="none")
    pipe.calibrator = Calibrator(
        {"torch": 1.0}, Logistic(["tokens", "tokens"], [1e308, -1e308], 0.0, [0.0, 0.0], [1e-308, 1e-308])
    )
    with TestClient(create_app(pipe, model_name="kibidango-test")) as client:
        r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3})
        assert r.status_code == 200, r.text
        k = strict(r.text)["kibidango"]
        assert k["confidence"] is None and "the calibrator gave nan" in k["confidence_error"]
        with client.stream("POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 3, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        assert strict(events[-1])["kibidango"]["confidence"] is None


def test_the_cascade_decodes_its_local_answer_as_the_calibrator_was_fitted(bundle, tmp_path):
    """The bundle samples by default (here temperature 1.0, as the tiny preset's 0.8), but the
    calibrator's answers were greedy: the cascade's local answer is greedy, unless the caller asks
    for sampling, and then the result says its confidence is off the calibrated distribution."""
    from kibidango import Pipeline
    from kibidango.cascade.pipeline import CascadePipeline

    cascade = CascadePipeline.from_bundle(bundle, state_dir=tmp_path / "state", adapter="none", temperature=1.0)
    assert cascade.pipe.defaults.temperature == 1.0 and cascade.pipe.calibrator.decoding == {"temperature": 0.0}
    greedy = Pipeline.from_bundle(bundle, adapter="none").generate("Once upon a time", max_new_tokens=24)
    sampled = [cascade.pipe.generate("Once upon a time", max_new_tokens=24, seed=s).text for s in range(4)]
    assert any(text != greedy.text for text in sampled)  # the default really samples

    local = cascade.local("Once upon a time", max_new_tokens=24).result
    assert local.text == greedy.text and local.confidence == pytest.approx(greedy.metrics.confidence)
    assert "uncalibrated_decoding" not in local.flags
    chosen = cascade.local("Once upon a time", max_new_tokens=24, temperature=1.0, seed=3).result
    assert "uncalibrated_decoding" in chosen.flags


def test_a_calibrator_names_the_decoding_it_was_fitted_on(bundle, tmp_path):
    from kibidango.addons.confidence import Calibrator

    spec = json.loads((bundle / "calibration" / "calibration.json").read_text())
    assert Calibrator.load(bundle / "calibration" / "calibration.json").decoding == {"temperature": 0.0}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({**spec, "decoding": {"temperature": 0.0, "max_new_tokens": 128}}))
    assert Calibrator.load(path).decoding["max_new_tokens"] == 128
    for bad in (
        {"temperature": -1},
        {"temperature": True},
        {"max_new_tokens": 5},
        {"temperature": 0, "max_new_tokens": 0},
        [],
    ):
        path.write_text(json.dumps({**spec, "decoding": bad}))
        with pytest.raises(BundleError, match="decoding: a temperature"):
            Calibrator.load(path)
    del spec["decoding"]  # a file written before the field: its answers were greedy
    path.write_text(json.dumps(spec))
    assert Calibrator.load(path).decoding == {"temperature": 0.0}


@pytest.mark.parametrize("cache", [2, 1], ids=["one-mixed-forward", "a-forward-per-adapter"])
def test_batched_requests_each_run_with_their_own_adapter(bundle, cache, caplog):
    """Under continuous batching, requests routed to different adapters (and to none) share the
    batcher and each gets what it gets alone: in one forward with each row's own adapter where the
    adapter cache holds both (peft's mixed-adapter batch), else one forward per adapter. With room
    for one adapter, rows with it and rows with none may still share a forward (which steps do
    depends on when each thread joins): never two adapters."""
    import threading

    from kibidango import Pipeline
    from kibidango.decode.batching import Batcher

    queries = [CODE, MATH, "Once upon a time there was a cat", MATH, CODE]
    alone = Pipeline.from_bundle(bundle, adapter="auto")
    expected = [alone.generate(q, max_new_tokens=6) for q in queries]
    pipe = Pipeline.from_bundle(bundle, adapter="auto", adapter_cache=cache)
    with caplog.at_level("WARNING", logger="kibidango"):
        batcher = Batcher(pipe, slots=len(queries))
    assert ("--adapter-cache 2 keeps them all" in caplog.text) == (cache == 1)
    got: dict[int, object] = {}
    gate = threading.Barrier(len(queries))

    def run(i: int) -> None:
        gate.wait()
        with batcher.member():
            got[i] = pipe.generate(queries[i], max_new_tokens=6)

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(queries))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for i, e in enumerate(expected):
            assert got[i].metrics.adapter == e.metrics.adapter and got[i].token_ids == e.token_ids, i
            assert got[i].metrics.confidence == pytest.approx(e.metrics.confidence, abs=1e-4)
        assert batcher.stats.feeds > batcher.stats.forwards
        # cache 2: code and math in one forward; cache 1: never both (math or code beside none, maybe)
        assert batcher.stats.widest == 2 if cache == 2 else batcher.stats.widest <= 1
    finally:
        batcher.close()
    for adapter in ("none", "auto"):  # alone again: each query as it was before the batcher
        assert [pipe.generate(q, max_new_tokens=6, adapter=adapter).token_ids for q in queries] == [
            alone.generate(q, max_new_tokens=6, adapter=adapter).token_ids for q in queries
        ], adapter
