"""The Python API: ``Pipeline.from_bundle(path, backend=..., mode=..., adapter=...)``, then
``generate`` (text and metrics) or ``stream`` (text chunks).

Per request, where the bundle ships them: the domain router (6A) picks a domain from the query and
the target runs with that domain's adapter (``adapter="auto"``; loaded on first use, an LRU of
``adapter_cache`` adapters) or, where the router picks none, with the bundle's default adapter (2F's
recovery LoRA: ``default_adapter`` in bundle.json); or with the adapter named, or with the bare
weights (``adapter="none"``); after
decoding, the calibrator (2G) turns one forward pass of the target over the answer into a
calibrated confidence. ``Metrics`` carries ``domain``, ``router_confidence``, ``adapter`` and
``confidence``."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibidango.addons.adapters import LoadedAdapters
from kibidango.addons.confidence import AnswerStats, Calibrator, score_answer
from kibidango.addons.router import Router
from kibidango.backends import load_model
from kibidango.backends.base import Model
from kibidango.bundle import Bundle, BundleError, load_bundle, resolve_backend
from kibidango.bundle.tokenizer import load_tokenizer
from kibidango.decode.ngrams import NgramTable
from kibidango.decode.speculative import TIERS, DecodeConfig, Decoder, Metrics

__all__ = ["GenerationResult", "Pipeline"]

log = logging.getLogger("kibidango.pipeline")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    metrics: Metrics


class Pipeline:
    def __init__(
        self,
        tokenizer,
        models: dict[str, Model],
        defaults: DecodeConfig,
        bundle: Bundle | None = None,
        backend: str = "torch",
        adapter: str = "none",
        adapters: LoadedAdapters | None = None,
        router: Router | None = None,
        router_threshold: float = 0.0,
        calibrator: Calibrator | None = None,
        default_adapter: str | None = None,
        ngram_table: NgramTable | None = None,
    ):
        self.tokenizer = tokenizer
        self.models = models
        self.defaults = defaults
        self.bundle = bundle
        self.backend = backend
        self.decoder = Decoder(models, ngram_table)
        if adapter not in ("auto", "none") and (adapters is None or adapter not in adapters.adapters.domains):
            have = ", ".join(adapters.adapters.domains) if adapters is not None else "none"
            raise BundleError(f"--adapter {adapter!r}: no such domain adapter (the bundle has: {have})")
        if default_adapter is not None and (adapters is None or default_adapter not in adapters.adapters.domains):
            raise BundleError(f"default adapter {default_adapter!r}: not among the loaded adapters")
        self.adapter = adapter
        self.default_adapter = default_adapter
        self.adapters = adapters
        self.router = router
        self.router_threshold = router_threshold
        self.calibrator = calibrator

    @classmethod
    def from_bundle(
        cls,
        path: str | Path,
        backend: str = "auto",
        mode: str | None = None,
        verify: bool = True,
        expect_sha256: str | None = None,
        adapter: str = "auto",
        adapter_cache: int = 2,
        threads: int | None = None,
        kv_cache: str | None = None,
        compile: bool = False,
        **overrides: Any,
    ) -> Pipeline:
        """Load a bundle's tokenizer and the tiers ``mode`` needs (default: the bundle's runtime
        defaults), after checking every file's hash. ``backend``: ``torch``, ``llamacpp`` or ``auto`` (the
        one the bundle's profile ships for, else torch). ``overrides`` set decoding defaults
        (``variant``, ``k``, ``l_D``, ``l_Q``, ``tau_Q``, ``tau_T``, ``divergence``, ...);
        ``expect_sha256`` pins bundle.json's digest (see :func:`kibidango.bundle.load_bundle`).
        ``adapter``: ``auto`` (the router's domain, when its confidence reaches the bundle's
        cascade threshold, else the bundle's ``default_adapter`` where it has a form for
        ``backend``), ``none`` (the bare weights), or an adapter's name; ``adapter_cache``: adapters
        kept loaded besides the default one (which stays loaded);
        ``threads``: CPU threads per model (llama.cpp; torch's process-wide pool), default
        :func:`kibidango.backends.llamacpp_backend.thread_counts` / torch's own; ``kv_cache``: the
        llama.cpp K/V cache type (``f16``, ``q8_0``, ``q4_0``; default: the bundle's own,
        :meth:`kibidango.bundle.Bundle.kv_cache`); ``compile`` (torch): the draft's and qualifier's
        single-token steps compiled with ``torch.compile`` on a static cache (the target stays
        eager, so lossless modes output what they did; the first steps pay the compilation)."""
        bundle = load_bundle(path, verify=verify, expect_sha256=expect_sha256)
        backend = resolve_backend(bundle, backend)
        cfg = bundle.decode_config(backend)  # the bundle's own settings, before any caller's
        cfg = dataclasses.replace(cfg, **{**overrides, **({"mode": mode} if mode is not None else {})})
        tokenizer = load_tokenizer(bundle.tokenizer_dir)
        if kv_cache is None:
            kv_cache = bundle.kv_cache(backend)
        steps = compile and backend == "torch"
        models = {
            name: load_model(
                backend,
                bundle.tier(name, backend),
                threads=threads,
                kv_cache=kv_cache,
                compile_steps=steps and name != "target",
            )
            for name in TIERS[cfg.mode]
        }
        router = bundle.router()
        shipped = bundle.adapters
        routable = [d for d in shipped.domains if router is not None and d in router.labels]
        default = _default_adapter(bundle, shipped, backend)
        loaded = LoadedAdapters(models["target"], shipped, adapter_cache, keep=default) if shipped.domains else None
        if adapter == "auto" and not routable and default is None:
            adapter = "none"  # nothing to route to
        if adapter == "auto" and backend == "torch" and importlib.util.find_spec("peft") is None:
            log.warning("the bundle's adapters need peft (pip install 'kibidango[adapters]'): bare weights only")
            adapter, default = "none", None
        cascade = bundle.cascade() or {}
        threshold = float((cascade.get("router") or {}).get("threshold", 0.0))
        pipe = cls(
            tokenizer,
            models,
            cfg,
            bundle,
            backend,
            adapter,
            loaded,
            router,
            threshold,
            bundle.calibrator(),
            default,
            bundle.ngram_table(models["target"].vocab_size),
        )
        if why := pipe.decoder.table_missing(cfg):
            raise BundleError(f"{bundle.root}: {why}")
        return pipe

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def config(self, **kw: Any) -> DecodeConfig:
        return dataclasses.replace(self.defaults, **{k: v for k, v in kw.items() if v is not None})

    def stream(
        self,
        prompt: str | list[int],
        stop: list[str] | None = None,
        metrics: Metrics | None = None,
        should_stop: Callable[[], bool] | None = None,
        query: str | None = None,
        adapter: str | None = None,
        score: bool | None = None,
        **kw: Any,
    ) -> Iterator[str]:
        """Yield text as it is committed; a stop string ends the stream before it.
        ``should_stop`` is asked after every decoding round (the server's cancellation: a client
        that went away); when it answers True the stream ends with finish reason "cancelled".
        ``query``: the text the router reads (default: the prompt); ``adapter`` overrides the
        pipeline's adapter policy for this request; ``score``: compute the calibrated confidence
        (default: when the bundle ships a calibrator)."""
        cfg = self.config(**kw)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        metrics = metrics if metrics is not None else Metrics(cfg.mode)
        given = metrics.answer_stats
        metrics.answer_stats = self._answer_stats(score, given)
        query = query if query is not None else (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
        out: list[int] = []
        self._route(query, adapter, metrics)
        yield from self._text(ids, cfg, stop or [], metrics, out, should_stop)
        self._score(ids, out, metrics, score)
        if given is None:
            metrics.answer_stats = None  # the pipeline's own, scored: not kept with the metrics

    def generate(
        self,
        prompt: str | list[int],
        stop: list[str] | None = None,
        query: str | None = None,
        adapter: str | None = None,
        score: bool | None = None,
        should_stop: Callable[[], bool] | None = None,
        answer_stats: AnswerStats | None = None,
        **kw: Any,
    ) -> GenerationResult:
        """``answer_stats``: an :class:`kibidango.addons.confidence.AnswerStats` that receives each
        token's figures from the target's logits that chose it (:attr:`Metrics.answer_stats`)."""
        cfg = self.config(**kw)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        metrics = Metrics(cfg.mode)
        metrics.answer_stats = self._answer_stats(score, answer_stats)
        query = query if query is not None else (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
        out: list[int] = []
        self._route(query, adapter, metrics)
        text = "".join(self._text(ids, cfg, stop or [], metrics, out, should_stop))
        self._score(ids, out, metrics, score)
        if answer_stats is None:
            metrics.answer_stats = None  # the pipeline's own, scored: not kept with the result
        return GenerationResult(text, out, metrics)

    def resolve_adapter(self, query: str, adapter: str | None = None) -> tuple[str | None, str | None, float | None]:
        """The adapter a request with this ``query`` and policy (``adapter``, default the
        pipeline's) would run with, without loading it: ``(adapter or None for the bare weights,
        the router's domain, its confidence)``."""
        policy = adapter or self.adapter
        chosen, domain, confidence = None, None, None
        if self.router is not None:
            domain, confidence = self.router.route(query)
        if policy == "auto":
            routable = self.router is not None and self.adapters is not None
            if routable and domain in self.adapters.adapters.domains and confidence >= self.router_threshold:
                chosen = domain
            else:
                chosen = self.default_adapter
        elif policy != "none":
            chosen = policy
        return chosen, domain, confidence

    def _route(self, query: str, adapter: str | None, metrics: Metrics) -> None:
        """Pick and activate the target's adapter for one request (see ``from_bundle``)."""
        chosen, domain, confidence = self.resolve_adapter(query, adapter)
        if self.router is not None:
            metrics.domain, metrics.router_confidence = domain, confidence
        if self.adapters is not None:
            self.adapters.use(chosen)
        elif chosen is not None:
            raise BundleError(f"adapter {chosen!r}: the bundle ships no domain adapters")
        metrics.adapter = chosen

    def _answer_stats(self, score: bool | None, given: AnswerStats | None) -> AnswerStats | None:
        """What receives each token's figures from the target's logits that chose it (every mode:
        the target scores each token it commits): the caller's, else the pipeline's own where it
        will score the answer at the calibrator's temperature, so that the calibrator's features
        need no second forward pass over prompt and answer (which doubled a request's prefill and,
        after a `lookup` answer, held its rows) and no logits are kept."""
        if given is not None:
            return given
        if self.calibrator is None or score is False:
            return None
        return AnswerStats(self.calibrator.temperature_for(self.backend))

    def _score(self, ids: list[int], out: list[int], metrics: Metrics, score: bool | None) -> None:
        if self.calibrator is None or score is False or metrics.finish_reason == "cancelled":
            return
        answer = [t for t in out if t not in self.defaults.stop_ids]
        temperature = self.calibrator.temperature_for(self.backend)
        stats = metrics.answer_stats  # a caller's, taken at another temperature: a scoring pass instead
        stats = stats if stats is not None and stats.temperature == float(temperature) else None
        feats = score_answer(self.models["target"], ids, answer, temperature, stats)
        confidence = self.calibrator.confidence(feats)
        if math.isfinite(confidence) and 0.0 <= confidence <= 1.0:
            metrics.confidence = confidence
        else:  # reported as null with the reason, never a NaN in a response
            metrics.confidence, metrics.confidence_error = None, f"the calibrator gave {confidence!r}"

    def _text(
        self,
        ids: list[int],
        cfg: DecodeConfig,
        stop: list[str],
        metrics: Metrics,
        out: list[int],
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[str]:
        """Decode incrementally over the whole output, so that multi-token characters and
        sentencepiece word boundaries come out right; ``out`` receives the generated ids."""
        sent = ""
        for new in self.decoder.generate(ids, cfg, metrics):
            if should_stop is not None and should_stop():
                metrics.finish_reason = "cancelled"
                return
            out += new
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            cut = min((i for s in stop if (i := text.find(s)) >= 0), default=None)
            if cut is not None:
                text = text[:cut]
            elif text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
                continue
            if len(text) > len(sent):
                yield text[len(sent) :]
                sent = text
            if cut is not None:
                metrics.finish_reason = "stop"
                return


def _default_adapter(bundle: Bundle, shipped, backend: str) -> str | None:
    """The bundle's ``default_adapter`` where it has a form for ``backend`` (peft for torch, gguf
    for llama.cpp), else None: the bare weights. A default the bundle does not ship is an error."""
    name = bundle.manifest.default_adapter
    if name is None:
        return None
    if name not in shipped.domains:
        have = ", ".join(shipped.domains) or "none"
        raise BundleError(f"{bundle.root / 'bundle.json'}: default_adapter {name!r}: not shipped (it ships: {have})")
    form = "peft" if backend == "torch" else "gguf"
    if form not in shipped.get(name).formats:
        log.info(f"default adapter {name!r} has no {form} form: the {backend} backend runs the bare weights")
        return None
    return name
