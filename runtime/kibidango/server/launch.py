""":func:`serve`: a bundle (and optionally its cascade) behind the app, with API keys, on uvicorn
with the draining shutdown of :mod:`kibidango.server.drain`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kibidango.cascade.memory import SessionMemory
from kibidango.cascade.pipeline import CascadePipeline
from kibidango.pipeline import Pipeline
from kibidango.server.app import create_app
from kibidango.server.auth import is_loopback, key_sources, load_api_keys
from kibidango.server.drain import uvicorn_server
from kibidango.server.scheduler import HEALTH_STALL_S

log = logging.getLogger("kibidango.server")


def serve(
    bundle: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    backend: str = "auto",
    mode: str | None = None,
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int = 1024,
    max_request_bytes: int = 4 << 20,
    stall_seconds: float = HEALTH_STALL_S,
    expect_sha256: str | None = None,
    adapter: str = "auto",
    adapter_cache: int = 2,
    cascade: str | None = None,
    state_dir: str | None = None,
    max_queue: int = 64,
    request_timeout_s: float = 600.0,
    shutdown_grace_s: float = 10.0,
    api_key_env: str | None = None,
    api_keys_file: str | None = None,
    insecure_no_auth: bool = False,
    parallel: int = 1,
    **overrides: Any,
) -> None:
    """Serve a bundle. ``cascade``: a cascade config (a name, a file, or ``bundle`` for the
    bundle's own 6C choice) served as ``<model>-cascade``, its budget ledger and the session
    memory in ``state_dir``. ``parallel``: requests decoded together (continuous batching,
    :mod:`kibidango.decode.batching`); 1 decodes one at a time. On SIGTERM/SIGINT the server stops
    taking requests, refuses the queued ones (503), gives running ones ``shutdown_grace_s`` to
    finish, then answers them 503.

    API keys (``Authorization: Bearer``) come from the environment variable ``api_key_env`` (one key,
    or several separated by commas) and/or ``api_keys_file`` (one per line, ``#`` comments). Without
    any, the server binds only a loopback address (every local client is trusted, and it says so);
    another address without keys needs ``insecure_no_auth``."""
    import uvicorn

    from kibidango.paid.state import default_state_dir

    keys = load_api_keys(api_key_env, api_keys_file)
    if not keys and not is_loopback(host) and not insecure_no_auth:
        raise ValueError(
            f"refusing to serve {host} without API keys: set --api-key-env NAME (or --api-keys-file), or pass "
            "--insecure-no-auth to accept any client that can reach it"
        )
    if keys:
        log.warning(f"API keys required on /v1/: {len(keys)} key(s) from {key_sources(api_key_env, api_keys_file)}")
    elif is_loopback(host):
        log.warning(f"no API keys: serving {host} (loopback) only; every local client is trusted")
    else:
        log.warning(f"no API keys and --insecure-no-auth: ANY client that reaches {host}:{port} is served")

    # Loads the tiers of the default mode; a request may choose any mode those tiers serve
    # (a pyramid server also serves sd and ar).
    pipe = Pipeline.from_bundle(
        bundle,
        backend=backend,
        mode=mode,
        expect_sha256=expect_sha256,
        adapter=adapter,
        adapter_cache=adapter_cache,
        **overrides,
    )
    state = Path(state_dir).expanduser() if state_dir else default_state_dir()
    casc = None
    if cascade is not None:
        from kibidango.cascade.config import load_cascade

        config = load_cascade(None if cascade == "bundle" else cascade, bundle=pipe.bundle)
        casc = CascadePipeline(pipe, config, state)
        left = casc.ledger.state().left_usd if casc.ledger is not None else None
        log.warning(
            f"cascade {config.source}: cloud {config.cloud.model if config.cloud else 'none'}"
            + (f", ${left:.4f} of the budget left" if left is not None else "")
        )
    memory = SessionMemory(state)
    name = (pipe.bundle.manifest.preset or "kibidango") if pipe.bundle else "kibidango"
    app = create_app(
        pipe,
        model_name=f"kibidango-{name}",
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        max_request_bytes=max_request_bytes,
        stall_seconds=stall_seconds,
        cascade=casc,
        memory=memory,
        max_queue=max_queue,
        request_timeout_s=request_timeout_s,
        api_keys=keys,
        parallel=parallel,
    )
    # Open requests get shutdown_grace_s to finish after SIGTERM; then they are cancelled, which
    # cancels their generations (uvicorn's default waits for them however long they take).
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_grace_s)
    uvicorn_server(config).run()
