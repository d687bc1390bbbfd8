"""A model answering instructions with the runtime (``kibidango``): greedy, target-only decoding in
the family's chat format (:mod:`methods.training.chat`), and how confident the model was of what it
wrote (the mean log-probability of the answer's tokens under the same model).

Used by failure mining (1B), critique (1C) and evaluation: they see the answers a bundle user
would get from the same weights, not a second generation loop's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from methods.training.chat import prompt_ids, prompt_text

__all__ = ["Answer", "Answerer"]


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: int
    """Generated tokens (the stop token excluded)."""
    finish_reason: str
    """``stop`` (an end-of-text token or a stop string), ``length`` (max_new_tokens), ``context``."""
    mean_logprob: float | None
    """Mean log-probability of the answer's tokens under the model (None for an empty answer)."""
    seconds: float

    @property
    def confidence(self) -> float:
        """exp(mean log-probability): the model's per-token confidence in what it wrote, in (0, 1];
        0 for an empty answer (no confidence in anything)."""
        return 0.0 if self.mean_logprob is None else math.exp(self.mean_logprob)


class Answerer:
    """``Answerer(model_dir)(instruction, input)`` -> :class:`Answer`. ``model_dir`` is a
    transformers checkpoint with its tokenizer (a stage's tier directory)."""

    def __init__(self, model_dir: str | Path, max_new_tokens: int = 128, stop: tuple[str, ...] = ()):
        from transformers import AutoTokenizer

        from kibidango import DecodeConfig, Pipeline
        from kibidango.backends.torch_backend import TorchModel

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = TorchModel(model_dir, name="target")
        # Documents were separated by BOS in pretraining: a model emits it where it thinks a text ends.
        stop_ids = tuple(i for i in (self.tokenizer.eos_token_id, self.tokenizer.bos_token_id) if i is not None)
        self.config = DecodeConfig(mode="ar", temperature=0.0, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        self.pipeline = Pipeline(self.tokenizer, {"target": self.model}, self.config)
        self.stop = list(stop)

    def prompt_ids(self, instruction: str, input_: str = "") -> list[int]:
        return prompt_ids(self.tokenizer, [{"role": "user", "content": prompt_text(instruction, input_)}])

    def __call__(self, instruction: str, input_: str = "") -> Answer:
        started = time.monotonic()
        ids = self.prompt_ids(instruction, input_)
        text, out, finish = self._decode(ids)
        return Answer(text, len(out), finish, self.mean_logprob(ids, out), time.monotonic() - started)

    def _decode(self, ids: list[int]) -> tuple[str, list[int], str]:
        """Greedy text, token ids (stop tokens dropped) and finish reason after ``ids``; finish
        ``context`` and no text when the prompt alone fills the context."""
        room = self.model.context_length - len(ids)
        if room < 1:
            return "", [], "context"
        result = self.pipeline.generate(ids, stop=self.stop, max_new_tokens=min(self.config.max_new_tokens, room))
        out = [t for t in result.token_ids if t not in self.config.stop_ids]
        finish = result.metrics.finish_reason or ("length" if len(out) >= self.config.max_new_tokens else "stop")
        return result.text, out, finish

    def mean_logprob(self, prompt_ids: list[int], answer_ids: list[int]) -> float | None:
        """Mean log-probability of ``answer_ids`` after ``prompt_ids``: one forward pass (None
        for an empty answer)."""
        ids = (prompt_ids + answer_ids)[: self.model.context_length]
        n = len(ids) - len(prompt_ids)
        if n < 1:
            return None
        logits = self.model.new_session().feed(ids)[len(prompt_ids) - 1 : -1]
        logits = logits - logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        return float(logp[np.arange(n), ids[len(prompt_ids) :]].mean())


class ScoredAnswerer(Answerer):
    """An :class:`Answerer` that can run the target with a domain adapter (the runtime's
    :class:`kibidango.adapters.LoadedAdapters`) and returns, with each answer, the features the
    runtime's calibrator reads (:func:`kibidango.confidence.score_answer`: one forward pass)."""

    def __init__(self, model_dir: str | Path, max_new_tokens: int = 128, adapter_dirs: list[Path] = ()):
        super().__init__(model_dir, max_new_tokens)
        from kibidango.adapters import AdapterSet, LoadedAdapters

        found = AdapterSet.from_dirs(list(adapter_dirs))
        self.adapters = LoadedAdapters(self.model, found, size=max(1, len(found.domains))) if adapter_dirs else None

    def answer(
        self, instruction: str, input_: str = "", adapter: str | None = None, temperature: float = 1.0
    ) -> tuple[Answer, dict | None]:
        from kibidango.confidence import score_answer

        if self.adapters is not None:
            self.adapters.use(adapter)
        elif adapter is not None:
            raise ValueError(f"adapter {adapter!r} asked for, but no adapters directory was given")
        started = time.monotonic()
        ids = self.prompt_ids(instruction, input_)
        text, out, finish = self._decode(ids)
        feats = score_answer(self.model, ids, out, temperature)
        mean = feats["mean_logprob"] if feats else None
        return Answer(text, len(out), finish, mean, time.monotonic() - started), feats
