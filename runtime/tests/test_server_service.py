"""The completions service without HTTP: prepare refuses what the server's bounds refuse (with the
error a client gets), run admits and starts the real pipeline, collect and stream finish it, and a
client gone away cancels it — FastAPI is never imported here."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import stories_bundle


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from kibidango import Pipeline
    from kibidango.server.metrics import Stats
    from kibidango.server.scheduler import Scheduler
    from kibidango.server.service import CompletionService

    pipe = Pipeline.from_bundle(stories_bundle(tmp_path_factory, "service"), backend="torch")
    scheduler = Scheduler(pipe, 60.0, 2, 60.0, None)
    return CompletionService(pipe, scheduler, Stats(), "stories", max_prompt_tokens=64, max_tokens_limit=32)


def _req(**kw):
    from kibidango.server.schema import CompletionRequest

    return CompletionRequest.model_validate({"prompt": "Once upon a time", **kw})


def test_prepare_refuses_with_the_error_a_client_gets(service):
    from kibidango.server.errors import ApiError

    unknown = service.prepare(_req(model="gpt-4"), "Once", "Once")
    assert isinstance(unknown, ApiError) and unknown.status == 404 and unknown.code == "model_not_found"
    assert "this server serves 'stories'" in unknown.message
    long = service.prepare(_req(), "word " * 500, "q")
    assert isinstance(long, ApiError) and long.status == 400 and long.param == "prompt"
    too_many = service.prepare(_req(max_tokens=33), "Once", "Once")
    assert too_many.param == "max_tokens" and "limit of 32" in too_many.message
    mode = service.prepare(_req(mode="sd"), "Once", "Once")  # the bundle holds the target alone
    assert mode.param == "mode" and "needs tiers this server did not load" in mode.message
    adapter = service.prepare(_req(adapter="poetry"), "Once", "Once")
    assert adapter.param == "adapter"
    assert adapter.body() == {
        "error": {"message": adapter.message, "type": "invalid_request_error", "param": "adapter", "code": None}
    }
    ok = service.prepare(_req(max_tokens=8), "Once upon a time", "Once upon a time")
    assert ok.ids == service.pipe.encode("Once upon a time") and ok.settings["max_new_tokens"] == 8
    assert ok.model == "stories" and ok.settings["query"] == "Once upon a time"


def test_run_and_collect_answer_as_the_pipeline_does(service):
    from kibidango.server.service import Finished

    prepared = service.prepare(_req(max_tokens=8), "Once upon a time", "Once upon a time")
    expected = service.pipe.generate(prepared.ids, max_new_tokens=8).text

    async def go():
        running = service.run(prepared)

        async def connected() -> bool:
            return False

        return await service.collect(running, connected)

    end = asyncio.run(go())
    assert isinstance(end, Finished) and end.text == expected and end.cascade is None
    body = service.usage(end)
    assert body["usage"]["completion_tokens"] == end.metrics.generated_tokens > 0
    assert body["usage"]["prompt_tokens"] == len(prepared.ids) and body["kibidango"]["mode"] == "ar"


def test_stream_frames_server_sent_events_and_a_gone_client_cancels(service):
    prepared = service.prepare(_req(max_tokens=6), "Once upon a time", "Once upon a time")
    finished: list[str] = []

    async def done(text: str) -> None:
        finished.append(text)

    async def streamed() -> list[str]:
        running = service.run(prepared)
        return [e async for e in service.stream(running, lambda text, reason: {"t": text, "r": reason}, done)]

    events = asyncio.run(streamed())
    assert events[-1] == "data: [DONE]\n\n" and all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    last = json.loads(events[-2][len("data: ") :])
    assert last["r"] is not None and last["usage"]["completion_tokens"] > 0
    pieces = "".join(json.loads(e[len("data: ") :])["t"] for e in events[:-2])
    assert finished == [pieces] and pieces

    async def gone():
        running = service.run(prepared)  # waits its turn: the test holds the models

        async def disconnected() -> bool:
            return True

        end = await service.collect(running, disconnected)
        return end, running.generation.cancel.is_set()

    assert service.scheduler.lock.acquire(timeout=5)
    try:
        end, cancelled = asyncio.run(gone())
    finally:
        service.scheduler.lock.release()
    assert end is None and cancelled


def test_a_full_queue_and_a_failed_generation_answer_in_openais_shape(service):
    from kibidango.server.errors import failure

    service.scheduler.closing.set()
    try:
        refused = service.run(service.prepare(_req(), "Once", "Once"))
    finally:
        service.scheduler.closing.clear()
    assert refused.status == 503 and refused.code == "shutting_down" and not refused.counted
    assert refused.headers["Retry-After"].isdigit()
    timeout = failure("timeout", None, 2.5, 1, 4)
    assert (timeout.status, timeout.code, timeout.counted) == (504, "request_timeout", True)
    assert "2.5 s" in timeout.message
    assert failure("cancelled", None, 1, 1, 4).body() == {"error": {"message": "cancelled", "type": "cancelled"}}
    assert failure("queue_full", None, 1, 3, 4).status == 429


def test_the_service_needs_no_web_framework():
    import ast
    from pathlib import Path

    import kibidango.server.service as svc

    imported = {
        n.module.split(".")[0] if isinstance(n, ast.ImportFrom) else n.names[0].name.split(".")[0]
        for n in ast.walk(ast.parse(Path(svc.__file__).read_text()))
        if isinstance(n, ast.Import | ast.ImportFrom) and (not isinstance(n, ast.ImportFrom) or n.module)
    }
    assert not imported & {"fastapi", "starlette", "uvicorn"}
