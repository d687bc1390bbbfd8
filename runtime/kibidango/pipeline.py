"""The Python API: ``Pipeline.from_bundle(path, backend=..., mode=...)``, then ``generate`` (text
and metrics) or ``stream`` (text chunks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibidango.backends import load_model
from kibidango.backends.base import Model
from kibidango.bundle import Bundle, load_bundle
from kibidango.speculative import TIERS, DecodeConfig, Decoder, Metrics

__all__ = ["GenerationResult", "Pipeline"]


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
    ):
        self.tokenizer = tokenizer
        self.models = models
        self.defaults = defaults
        self.bundle = bundle
        self.backend = backend
        self.decoder = Decoder(models)

    @classmethod
    def from_bundle(
        cls,
        path: str | Path,
        backend: str = "torch",
        mode: str | None = None,
        verify: bool = True,
        expect_sha256: str | None = None,
        **overrides: Any,
    ) -> Pipeline:
        """Load a bundle's tokenizer and the tiers ``mode`` needs (default: the bundle's runtime
        defaults), after checking every file's hash. ``overrides`` set decoding defaults
        (``variant``, ``k``, ``l_D``, ``l_Q``, ``tau_Q``, ``tau_T``, ``divergence``, ...);
        ``expect_sha256`` pins bundle.json's digest (see :func:`kibidango.bundle.load_bundle`)."""
        from transformers import AutoTokenizer

        bundle = load_bundle(path, verify=verify, expect_sha256=expect_sha256)
        defaults = {k: v for k, v in bundle.defaults.items() if k in {f.name for f in dataclasses.fields(DecodeConfig)}}
        defaults.update(overrides)
        if mode is not None:
            defaults["mode"] = mode
        if "stop_ids" in defaults:  # JSON gives a list
            defaults["stop_ids"] = tuple(defaults["stop_ids"])
        cfg = DecodeConfig(**defaults)
        tokenizer = AutoTokenizer.from_pretrained(str(bundle.tokenizer_dir))
        models = {name: load_model(backend, bundle.tier(name, backend)) for name in TIERS[cfg.mode]}
        return cls(tokenizer, models, cfg, bundle, backend)

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def config(self, **kw: Any) -> DecodeConfig:
        kw = {k: v for k, v in kw.items() if v is not None}
        if "stop_ids" in kw:
            kw["stop_ids"] = tuple(kw["stop_ids"])
        return dataclasses.replace(self.defaults, **kw)

    def stream(
        self,
        prompt: str | list[int],
        stop: list[str] | None = None,
        metrics: Metrics | None = None,
        should_stop: Callable[[], bool] | None = None,
        **kw: Any,
    ) -> Iterator[str]:
        """Yield text as it is committed; a stop string ends the stream before it.
        ``should_stop`` is asked after every decoding round (the server's cancellation: a client
        that went away); when it answers True the stream ends with finish reason "cancelled"."""
        cfg = self.config(**kw)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        metrics = metrics if metrics is not None else Metrics(cfg.mode)
        yield from self._text(ids, cfg, stop or [], metrics, [], should_stop)

    def generate(self, prompt: str | list[int], stop: list[str] | None = None, **kw: Any) -> GenerationResult:
        cfg = self.config(**kw)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        metrics = Metrics(cfg.mode)
        out: list[int] = []
        text = "".join(self._text(ids, cfg, stop or [], metrics, out))
        return GenerationResult(text, out, metrics)

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
