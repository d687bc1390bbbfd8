"""``kibidango`` command line: generate, inspect, bench, serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kibidango.backends.base import KV_CACHE_TYPES, ContextLengthError
from kibidango.bundle import BACKENDS, BundleError, load_bundle, resolve_backend, with_profile
from kibidango.bundle.schema import describe
from kibidango.decode.speculative import MODES, REQUEST_SETTINGS, SETTINGS
from kibidango.integrity import without_credentials

BACKEND_HELP = "auto (default): the backend the bundle's profile ships for (stage 9A; a full bundle: torch)"
STATE_HELP = (
    "the cascade's budget ledger and the session memory "
    "(default $KIBIDANGO_STATE, else $XDG_STATE_HOME/kibidango or ~/.local/state/kibidango)"
)


def _decode_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding (defaults: the bundle's runtime_defaults)")
    for name in REQUEST_SETTINGS:  # one flag per setting a request may set, from DecodeConfig's declaration
        meta, default = SETTINGS[name].metadata, SETTINGS[name].default
        flag = "--" + name.lower().replace("_", "-")
        if isinstance(default, bool):
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=meta["doc"])
        elif meta["choices"]:
            g.add_argument(flag, dest=name, choices=list(meta["choices"]), help=meta["doc"])
        else:
            g.add_argument(flag, dest=name, type=type(default), help=meta["doc"])
    g.add_argument("--threads", type=int, help="CPU threads per model (default: half the CPUs; $KIBIDANGO_THREADS)")
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch: compile the draft's and qualifier's single-token steps (torch.compile, static cache); "
        "the first steps pay the compilation",
    )
    g.add_argument(
        "--kv-cache",
        dest="kv_cache",
        choices=list(KV_CACHE_TYPES),
        help="llama.cpp K/V cache type (default: the bundle's kv_cache, else f16)",
    )


def _pin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expect-sha256",
        metavar="HEX",
        default=None,
        help="refuse the bundle unless bundle.json has this sha256 (stage X prints it; default "
        "$KIBIDANGO_BUNDLE_SHA256)",
    )


def _adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter",
        default="auto",
        help="the target's adapter: auto (the router's domain, else the bundle's default adapter, 2F's recovery LoRA; "
        "default), none (the bare weights), or an adapter's name",
    )
    p.add_argument("--adapter-cache", type=int, default=2, help="domain adapters kept loaded (least recently used out)")


def _overrides(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in REQUEST_SETTINGS if getattr(args, k, None) is not None}


def _generate(args: argparse.Namespace) -> None:
    from kibidango.decode.speculative import Metrics
    from kibidango.pipeline import Pipeline

    prompt = args.prompt if args.prompt not in (None, "-") else sys.stdin.read().rstrip("\n")
    pipe = Pipeline.from_bundle(
        args.bundle,
        backend=args.backend,
        mode=args.mode,
        expect_sha256=args.expect_sha256,
        adapter=args.adapter,
        adapter_cache=args.adapter_cache,
        threads=args.threads,
        kv_cache=args.kv_cache,
        compile=args.compile,
        **_overrides(args),
    )
    if args.cascade is not None:
        return _cascade(args, pipe, prompt)
    metrics = Metrics(pipe.defaults.mode)
    kw = {"max_new_tokens": args.max_new_tokens, **({"stop_ids": args.stop_id} if args.stop_id else {})}
    if args.stream:
        for chunk in pipe.stream(prompt, stop=args.stop, metrics=metrics, **kw):
            print(chunk, end="", flush=True)
        print()
    else:
        result = pipe.generate(prompt, stop=args.stop, **kw)
        metrics = result.metrics
        print(result.text)
    if args.stats:
        print(json.dumps(metrics.to_dict(), indent=2), file=sys.stderr)


def _cascade(args: argparse.Namespace, pipe, prompt: str) -> None:
    """``generate --cascade CONFIG``: the local/cloud cascade (kibidango.cascade.pipeline) for one
    prompt; the answer on stdout, which tier answered, its confidence, cost and the budget left on
    stderr (all of it, with the local metrics, as JSON with ``--stats``)."""
    from kibidango.cascade.config import load_cascade
    from kibidango.cascade.pipeline import CascadePipeline
    from kibidango.paid.state import default_state_dir

    config = load_cascade(args.cascade, bundle=pipe.bundle)
    state = Path(args.state_dir).expanduser() if args.state_dir else default_state_dir()
    result = CascadePipeline(pipe, config, state).answer(prompt, max_new_tokens=args.max_new_tokens)
    print(result.text)
    confidence = "-" if result.confidence is None else f"{result.confidence:.3f}"
    left = "-" if result.budget_left_usd is None else f"${result.budget_left_usd:.4f}"
    flags = f" [{', '.join(result.flags)}]" if result.flags else ""
    print(
        f"(tier {result.tier}, confidence {confidence}, cost ${result.usd:.6f}, budget left {left}){flags}",
        file=sys.stderr,
    )
    if args.stats:
        print(json.dumps(result.to_dict(), indent=2), file=sys.stderr)


def _inspect(args: argparse.Namespace) -> None:
    bundle = load_bundle(args.bundle, verify=True, expect_sha256=args.expect_sha256)
    meta = bundle.manifest
    print(f"bundle {bundle.root}  schema {meta.schema_version}  preset {meta.preset or '-'}")
    pinned = (
        "matches the pinned digest"
        if args.expect_sha256
        else "compare it with the digest the pipeline printed, or pin it with --expect-sha256"
    )
    print(f"bundle.json sha256: {bundle.digest}  ({pinned})")
    print("tiers:")
    for name, tier in bundle.tiers.items():
        forms = ", ".join(f for f, p in (("hf", tier.hf), ("gguf", tier.gguf)) if p is not None)
        info = ", ".join(f"{k}={v}" for k, v in tier.info.items())
        print(f"  {name:<10} {forms:<10} {info}")
    if meta.profile is not None:
        print(f"profile: {meta.profile.name} (backends: {', '.join(meta.profile.backends)})")
        for item in meta.profile.left_out:
            print(f"  left out: {item}")
    print(f"runtime defaults: {json.dumps(bundle.defaults, sort_keys=True)}")
    for backend, tuned in meta.tuned_defaults.items():
        speed = meta.tuning.get(backend, {}).get("chosen_speed_vs_ar")
        measured = f" ({speed:.2f}x target-only decoding when tuned)" if speed is not None else ""
        print(f"  tuned for {backend} (kibidango tune / stage 1F, read over the above): {json.dumps(tuned)}{measured}")
    if meta.adapters:
        default = f"; default where no domain adapter is routed: {meta.default_adapter}" if meta.default_adapter else ""
        print("adapters: " + ", ".join(f"{a.domain} ({', '.join(a.formats)})" for a in meta.adapters) + default)
    if meta.ngrams:
        table = bundle.ngram_table()
        print(f"n-gram table: {meta.ngrams} ({len(table):,} contexts of up to {table.n_max} tokens; --ngram-table)")
    if meta.stage_cache_keys:
        print(f"built from (stage: cache key): {json.dumps(meta.stage_cache_keys, sort_keys=True)}")
    files = meta.files
    for rel in bundle.unlisted:
        print(f"WARNING: {rel} is not listed in bundle.json (not hashed, never loaded)")
    print(f"OK: {len(files)} files, {sum(f.size for f in files) / 1e6:.2f} MB, every sha256 verified")


def _profile(args: argparse.Namespace) -> None:
    dest = with_profile(args.bundle, args.out, args.profile, tuple(args.backend or ("llamacpp",)))
    meta = load_bundle(dest).manifest
    print(
        f"written: {dest} ({meta.profile.name} profile for {', '.join(meta.profile.backends)}; "
        f"{len(meta.files)} files, {sum(f.size for f in meta.files) / 1e6:.2f} MB)"
    )
    for item in meta.profile.left_out:
        print(f"  left out: {item}")


def _bench(args: argparse.Namespace) -> None:
    from kibidango.tools.bench import format_table, read_prompts, run_bench

    result = run_bench(
        args.bundle,
        read_prompts(args.prompts),
        args.modes.split(","),
        args.max_new_tokens,
        args.repeats,
        tuple(p for p in args.peers.split(",") if p),
        args.backend,
        threads=args.threads,
        kv_cache=args.kv_cache,
        compile=args.compile,
        ar_ggufs=tuple(args.ar_gguf or ()),
        progress=lambda n, total: print(f"  {n}/{total} prompt rounds", file=sys.stderr, flush=True),
        **_overrides(args),
    )
    print(format_table(result))


def _tune(args: argparse.Namespace) -> None:
    from kibidango.pipeline import Pipeline
    from kibidango.tools.bench import read_prompts
    from kibidango.tools.tune import (
        format_kv_cache,
        format_tune,
        tune,
        tune_kv_cache,
        write_tuned,
    )

    pipe = Pipeline.from_bundle(
        args.bundle,
        backend=args.backend,
        mode="pyramid",
        adapter="none",
        threads=args.threads,
        kv_cache=args.kv_cache,
        compile=args.compile,
    )
    if args.try_kv_cache and pipe.backend != "llamacpp":
        raise SystemExit("--try-kv-cache: K/V cache types are a llama.cpp option (--backend llamacpp)")

    def progress(n: int, total: int, row: dict) -> None:
        print(f"  {n}/{total} candidates", file=sys.stderr, flush=True)

    result = tune(
        pipe,
        read_prompts(args.prompts),
        args.max_new_tokens,
        args.max_ppl_increase,
        progress=progress,
        tier_gain=args.tier_gain,
    )
    print(format_tune(result))
    chosen = result.chosen or {"mode": "ar"}
    if args.try_kv_cache:
        prompts = [pipe.encode(p) for p in read_prompts(args.prompts)]
        kv = tune_kv_cache(
            pipe,
            args.bundle,
            args.try_kv_cache,
            prompts,
            chosen,
            args.max_new_tokens,
            args.max_ppl_increase,
            threads=args.threads,
        )
        print(format_kv_cache(kv))
        if kv.chosen != kv.reference:
            result.chosen = {**chosen, "kv_cache": kv.chosen}
    if args.write and result.chosen:
        report = {
            "best": result.best,
            "chosen_speed_vs_ar": result.chosen_speed,
            "max_ppl_increase": args.max_ppl_increase,
            "tier_gain": args.tier_gain,
            "prompts": args.prompts,
        }
        print(f"written: {write_tuned(args.bundle, args.write, pipe.backend, result.chosen, report)}")


def _ngram_table(args: argparse.Namespace) -> None:
    from kibidango.bundle import with_ngram_table
    from kibidango.decode.ngrams import count_outputs
    from kibidango.pipeline import Pipeline
    from kibidango.tools.bench import read_prompts

    pipe = Pipeline.from_bundle(args.bundle, backend=args.backend, mode="ar", adapter="none", threads=args.threads)
    prompts = read_prompts(args.prompts)

    def progress(n: int, total: int) -> None:
        if n % 16 == 0 or n == total:
            print(f"  {n}/{total} prompts continued", file=sys.stderr, flush=True)

    table = count_outputs(pipe, prompts, args.max_new_tokens, progress)
    print(f"n-gram table: {len(table):,} contexts from the target's continuations of {len(prompts)} prompts")
    print(f"written: {with_ngram_table(args.bundle, args.out, table)} (decode with --ngram-table)")


def _serve(args: argparse.Namespace) -> None:
    from kibidango.server.launch import serve

    serve(
        args.bundle,
        host=args.host,
        port=args.port,
        backend=args.backend,
        mode=args.mode,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes,
        stall_seconds=args.stall_seconds,
        expect_sha256=args.expect_sha256,
        adapter=args.adapter,
        adapter_cache=args.adapter_cache,
        cascade=args.cascade,
        state_dir=args.state_dir,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        shutdown_grace_s=args.shutdown_grace,
        api_key_env=args.api_key_env,
        api_keys_file=args.api_keys_file,
        insecure_no_auth=args.insecure_no_auth,
        parallel=args.parallel,
        threads=args.threads,
        kv_cache=args.kv_cache,
        compile=args.compile,
        **_overrides(args),
    )


def _budget(args: argparse.Namespace) -> None:
    from kibidango.paid.ledger import holds, reconcile, spend
    from kibidango.paid.state import default_state_dir

    state = Path(args.state_dir) if args.state_dir else default_state_dir()
    if not (state / "ledger.sqlite").is_file():
        raise FileNotFoundError(f"{state}: no budget ledger here (ledger.sqlite); pass --state-dir")
    if args.reconcile:
        print(f"lifted {reconcile(state, args.note)} hold(s); the recorded amounts stand")
    print(f"ledger: {state / 'ledger.sqlite'}")
    for period, v in spend(state).items():
        print(f"  {period}: settled ${v['settled_usd']:.6f}, reserved in flight ${v['reserved_usd']:.6f}")
    for h in holds(state):
        print(
            f"  ON HOLD: entry {h['entry']} ({h['note'] or 'no note'}) reported ${h['reported_usd']:.6f} against a "
            f"${h['reserved_usd']:.6f} reservation; check the provider's bill, then --reconcile"
        )


def _loadtest(args: argparse.Namespace) -> None:
    from kibidango.server.loadtest import format_load, run_load

    prompts = [args.prompt]
    if args.prompts:
        from kibidango.tools.bench import read_prompts

        prompts = read_prompts(args.prompts)
    bodies = [
        {
            "model": args.model,
            "messages": [{"role": "user", "content": p}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        for p in prompts
    ]
    result = run_load(
        args.url.split(","), bodies, args.requests, args.concurrency, args.timeout, retry_refused=args.retry_refused
    )
    print(format_load(result))
    if args.json:
        print(json.dumps(result.summary()))
    if result.lost:
        raise SystemExit(1)


def _generate_command(sub) -> None:
    """``kibidango generate``'s arguments."""
    gen = sub.add_parser("generate", help="generate text from a prompt (argument or stdin)")
    gen.add_argument("prompt", nargs="?", help="the prompt; '-' or absent: read stdin")
    gen.add_argument("--bundle", required=True)
    gen.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help=BACKEND_HELP)
    gen.add_argument("--mode", choices=list(MODES))
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stop-id", action="append", type=int, help="stop token id (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--stats", action="store_true", help="print the request's metrics (JSON) to stderr")
    gen.add_argument(
        "--cascade",
        metavar="CONFIG",
        help="answer through the local/cloud cascade: a named config (plan-example, local-only) or a JSON/YAML file",
    )
    gen.add_argument(
        "--state-dir",
        help=STATE_HELP,
    )
    _decode_args(gen)
    _adapter_args(gen)
    _pin_arg(gen)
    gen.set_defaults(func=_generate)


def _inspect_command(sub) -> None:
    """``kibidango inspect``'s arguments."""
    ins = sub.add_parser("inspect", help="print a bundle's manifest and verify every file's hash")
    ins.add_argument("bundle")
    _pin_arg(ins)
    ins.set_defaults(func=_inspect)


def _schema_command(sub) -> None:
    """``kibidango schema``'s arguments."""
    sch = sub.add_parser("schema", help="every field of bundle.json, with its type and description (Markdown)")
    sch.set_defaults(func=lambda args: print(describe()))


def _bench_command(sub) -> None:
    """``kibidango bench``'s arguments."""
    bench = sub.add_parser("bench", help="compare decoding modes (and peers) on the same prompts")
    bench.add_argument("--bundle", required=True)
    bench.add_argument("--prompts", required=True, help="a file: one prompt per line, or JSONL with 'prompt'")
    bench.add_argument(
        "--modes",
        default="ar,sd,pyramid",
        help="comma list of ar, sd, lookup, pyramid, pyramid-exact, pyramid-assisted; a mode may carry its own "
        "settings after '+' (adaptive, lookup, k<n>, kmax<n>, p<x>, lD<n>, lQ<n>, lk<n> (lookup_k), nm<n> "
        "(ngram_min), table (the bundle's n-gram table), tk<n> (table_k); threads t<n>, and tb<n> for llama.cpp's "
        "batches): sd,sd+adaptive+lookup,sd+lookup+lk12+nm2,sd+lookup+table,sd+k6+p0.3,ar+t2,sd+t1+tb2",
    )
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help=BACKEND_HELP)
    bench.add_argument("--peers", default="hf", help="comma list of peers to run: hf (and llamacpp with the extra)")
    bench.add_argument(
        "--ar-gguf",
        action="append",
        metavar="GGUF",
        help="llama.cpp: another GGUF of the target (another weight type: F16 beside F32, a quantization), decoded "
        "ar in the same rounds; its speed and each mode's against it (repeatable)",
    )
    _decode_args(bench)
    bench.set_defaults(func=_bench)


def _tune_command(sub) -> None:
    """``kibidango tune``'s arguments."""
    tun = sub.add_parser("tune", help="search the speculative-decoding settings for the best speed (1F)")
    tun.add_argument("--bundle", required=True)
    tun.add_argument("--prompts", required=True, help="held-out prompts: one per line, or JSONL with 'prompt'")
    tun.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help=BACKEND_HELP)
    tun.add_argument("--max-new-tokens", type=int, default=48)
    tun.add_argument(
        "--max-ppl-increase", type=float, default=0.02, help="lossy variants: largest rise of the target's perplexity"
    )
    tun.add_argument(
        "--tier-gain",
        type=float,
        default=0.0,
        help="share by which a mode on more tiers (sd: a draft; pyramid: and a qualifier) must beat those on fewer",
    )
    tun.add_argument("--threads", type=int)
    tun.add_argument("--kv-cache", dest="kv_cache", choices=list(KV_CACHE_TYPES))
    tun.add_argument(
        "--try-kv-cache",
        action="append",
        default=[],
        choices=list(KV_CACHE_TYPES),
        help="llama.cpp: after the search, time this K/V cache type against the loaded one in the chosen mode; the "
        "smallest within --max-ppl-increase and 5%% of the speed is chosen (repeatable)",
    )
    tun.add_argument("--compile", action="store_true", help="torch: compiled draft and qualifier steps")
    tun.add_argument(
        "--write", metavar="DIR", help="write a copy of the bundle with the chosen settings as its defaults"
    )
    tun.set_defaults(func=_tune)


def _ngram_table_command(sub) -> None:
    """``kibidango ngram-table``'s arguments."""
    ngr = sub.add_parser(
        "ngram-table",
        help="write a copy of a bundle with a static n-gram table of the target's own continuations of prompts",
    )
    ngr.add_argument("--bundle", required=True)
    ngr.add_argument(
        "--prompts",
        required=True,
        help="prompts like the workload's, not the ones you measure on (one per line, or JSONL)",
    )
    ngr.add_argument("--out", required=True, metavar="DIR", help="the copy of the bundle with the table")
    ngr.add_argument("--max-new-tokens", type=int, default=64, help="tokens the target continues each prompt with")
    ngr.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help=BACKEND_HELP)
    ngr.add_argument("--threads", type=int)
    ngr.set_defaults(func=_ngram_table)


def _serve_command(sub) -> None:
    """``kibidango serve``'s arguments."""
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("--bundle", required=True)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help=BACKEND_HELP)
    srv.add_argument("--mode", choices=list(MODES))
    srv.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's context")
    srv.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask for")
    srv.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger request bodies are refused (413)")
    srv.add_argument(
        "--stall-seconds",
        type=float,
        default=120.0,
        help="/health answers 503 when a generation made no progress for this long",
    )
    srv.add_argument(
        "--cascade",
        metavar="CONFIG",
        help="also serve <model>-cascade: the local/cloud cascade (plan-example, local-only, a JSON/YAML file, "
        "or 'bundle' for the bundle's own thresholds)",
    )
    srv.add_argument("--state-dir", help=STATE_HELP)
    srv.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 429 + Retry-After")
    srv.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="requests decoded together, their forward passes batched (continuous batching); 1: one at a time",
    )
    srv.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cancelled (504)")
    srv.add_argument(
        "--shutdown-grace", type=float, default=10.0, help="seconds running requests get to finish after SIGTERM"
    )
    srv.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="require 'Authorization: Bearer <key>' on /v1/, the key(s) read from this environment variable "
        "(comma-separated); session memory is kept per key",
    )
    srv.add_argument("--api-keys-file", metavar="PATH", help="API keys, one per line (# comments), as --api-key-env")
    srv.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-loopback --host without API keys (any client that reaches it is served)",
    )
    _decode_args(srv)
    _adapter_args(srv)
    _pin_arg(srv)
    srv.set_defaults(func=_serve)


def _budget_command(sub) -> None:
    """``kibidango budget``'s arguments."""
    bud = sub.add_parser(
        "budget", help="the cloud budget ledger: spend per period, and holds (a reply that cost more than reserved)"
    )
    bud.add_argument("--state-dir", help=STATE_HELP)
    bud.add_argument(
        "--reconcile", action="store_true", help="lift every hold, once the provider's bill has been checked"
    )
    bud.add_argument("--note", default="", help="why the holds were lifted (kept in the ledger)")
    bud.set_defaults(func=_budget)


def _loadtest_command(sub) -> None:
    """``kibidango loadtest``'s arguments."""
    load = sub.add_parser("loadtest", help="a bounded load test of running servers: latency, throughput, none lost")
    load.add_argument(
        "--url", required=True, help="the server's root, e.g. http://127.0.0.1:8000 (comma list: round-robin)"
    )
    load.add_argument("--model", default=None, help="the model to ask for (e.g. kibidango-tiny-cascade)")
    load.add_argument("--requests", type=int, default=64)
    load.add_argument("--concurrency", type=int, default=8)
    load.add_argument("--max-tokens", type=int, default=32)
    load.add_argument("--prompt", default="Once upon a time")
    load.add_argument("--prompts", help="a file of prompts (one per line, or JSONL with 'prompt'), round-robin")
    load.add_argument("--timeout", type=float, default=120.0, help="a request with no answer by then counts as lost")
    load.add_argument("--retry-refused", action="store_true", help="send a 429/503 again after its Retry-After")
    load.add_argument("--json", action="store_true", help="also print the summary as JSON")
    load.set_defaults(func=_loadtest)


def _profile_command(sub) -> None:
    """``kibidango profile``'s arguments."""
    prof = sub.add_parser(
        "profile",
        help="a copy of a bundle holding one profile: default (what its decoding defaults use on --backend) or full",
    )
    prof.add_argument("--bundle", required=True, help="the bundle (a full one: stage 1F's, or 9A's with profile full)")
    prof.add_argument("--out", required=True, help="where the copy is written (replaced if it exists)")
    prof.add_argument("--profile", default="default", choices=["default", "full"])
    prof.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        help="a backend whose weight forms it keeps (repeat for several; the first is --backend auto's); "
        "default: llamacpp",
    )
    prof.set_defaults(func=_profile)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kibidango", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _generate_command,
        _inspect_command,
        _schema_command,
        _bench_command,
        _tune_command,
        _ngram_table_command,
        _serve_command,
        _budget_command,
        _loadtest_command,
        _profile_command,
    ):
        add(sub)

    args = parser.parse_args(argv)
    try:
        if getattr(args, "backend", None) == "auto":
            args.backend = resolve_backend(load_bundle(args.bundle, verify=False), "auto")
        args.func(args)
    except (BundleError, ContextLengthError, ValueError, FileNotFoundError) as e:
        print(f"error: {without_credentials(str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
