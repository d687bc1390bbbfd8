"""A model answering instructions with the runtime (``kibidango``): greedy, target-only decoding in
the family's chat format (:mod:`methods.training.chat`), and how confident the model was of what it
wrote (the mean log-probability of the answer's tokens under the same model).

Used by failure mining (1B), critique (1C) and evaluation: they see the answers a bundle user
would get from the same weights, not a second generation loop's.

``parallel=N`` answers up to N questions at once, from as many threads (see
:func:`methods.heldout.answer_and_judge`), through the runtime's continuous batching
(:class:`kibidango.decode.batching.Batcher`): one padded forward for all of them, several times the
answers per second of one at a time on a CPU. Batched matrix products may sum in another order,
so a greedy answer can differ from the one-at-a-time answer at a near-tie.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from methods.training.chat import prompt_ids, prompt_text

if TYPE_CHECKING:
    from kibidango.addons.confidence import AnswerStats

__all__ = ["Answer", "Answerer", "ScoredAnswerer", "once"]


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


class once:  # noqa: N801 - used like a function
    """``once(factory)()``: ``factory()`` called on the first call, from whichever thread asks first,
    and its value returned to every call after (a resumed stage that has every answer loads no
    model); :meth:`close` closes the value if it was made."""

    def __init__(self, factory: Callable[[], Answerer]):
        self._factory = factory
        self._lock = threading.Lock()
        self._made: list[Answerer] = []

    def __call__(self) -> Answerer:
        with self._lock:
            if not self._made:
                self._made.append(self._factory())
            return self._made[0]

    def close(self) -> None:
        with self._lock:
            for value in self._made:
                value.close()


class Answerer:
    """``Answerer(model_dir)(instruction, input)`` -> :class:`Answer`. ``model_dir`` is a
    transformers checkpoint with its tokenizer (a stage's tier directory). Safe to call from
    several threads: up to ``parallel`` answers decode together, the others wait their turn."""

    def __init__(self, model_dir: str | Path, max_new_tokens: int = 128, stop: tuple[str, ...] = (), parallel: int = 1):
        from transformers import AutoTokenizer

        from kibidango import DecodeConfig, Pipeline
        from kibidango.backends.torch_backend import TorchModel
        from kibidango.decode.batching import Batcher

        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = TorchModel(model_dir, name="target")
        # Documents were separated by BOS in pretraining: a model emits it where it thinks a text ends.
        stop_ids = tuple(i for i in (self.tokenizer.eos_token_id, self.tokenizer.bos_token_id) if i is not None)
        self.config = DecodeConfig(mode="ar", temperature=0.0, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        self.adapters = self._adapters()
        self.pipeline = Pipeline(self.tokenizer, {"target": self.model}, self.config, adapters=self.adapters)
        self.stop = list(stop)
        self.parallel = parallel
        self._alone = threading.Lock()
        # After the adapters: the batcher takes over the pipeline's models and adapter choice.
        self.batcher = Batcher(self.pipeline, parallel) if parallel > 1 else None

    def _adapters(self):
        return None

    @property
    def target(self):
        """The target as the decoder sees it: batched when ``parallel`` > 1."""
        return self.pipeline.models["target"]

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        with self.batcher.turn() if self.batcher is not None else self._alone:
            yield

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()

    def prompt_ids(self, instruction: str, input_: str = "") -> list[int]:
        return prompt_ids(self.tokenizer, [{"role": "user", "content": prompt_text(instruction, input_)}])

    def __call__(self, instruction: str, input_: str = "") -> Answer:
        from kibidango.addons.confidence import AnswerStats, score_answer

        with self._turn():
            started = time.monotonic()
            ids = self.prompt_ids(instruction, input_)
            stats = AnswerStats()
            text, out, finish = self._decode(ids, stats=stats)
            feats = score_answer(self.target, ids, out, stats=stats)
            mean = feats["mean_logprob"] if feats else None
            return Answer(text, len(out), finish, mean, time.monotonic() - started)

    def sample(self, instruction: str, input_: str, temperature: float, seed: int) -> Answer:
        """One sampled answer (``temperature``, the runtime's sampler seeded with ``seed``: the
        same seed gives the same answer), in the family's chat format; ``mean_logprob`` is not
        scored (None)."""
        with self._turn():
            started = time.monotonic()
            ids = self.prompt_ids(instruction, input_)
            room = self.model.context_length - len(ids)
            if room < 1:
                return Answer("", 0, "context", None, time.monotonic() - started)
            result = self.pipeline.generate(
                ids,
                stop=self.stop,
                max_new_tokens=min(self.config.max_new_tokens, room),
                adapter="none",
                temperature=temperature,
                seed=seed,
            )
            out = [t for t in result.token_ids if t not in self.config.stop_ids]
            finish = result.metrics.finish_reason or ("length" if len(out) >= self.config.max_new_tokens else "stop")
            return Answer(result.text, len(out), finish, None, time.monotonic() - started)

    def _decode(
        self, ids: list[int], adapter: str | None = None, stats: AnswerStats | None = None
    ) -> tuple[str, list[int], str]:
        """Greedy text, token ids (stop tokens dropped) and finish reason after ``ids`` (with the
        target's ``adapter``, None: base weights); finish ``context`` and no text when the prompt
        alone fills the context. ``stats`` receives each token's figures from the logits that chose
        it (scoring the answer from them saves a forward pass over prompt and answer)."""
        room = self.model.context_length - len(ids)
        if room < 1:
            return "", [], "context"
        result = self.pipeline.generate(
            ids,
            stop=self.stop,
            max_new_tokens=min(self.config.max_new_tokens, room),
            adapter=adapter or "none",
            answer_stats=stats,
        )
        out = [t for t in result.token_ids if t not in self.config.stop_ids]
        finish = result.metrics.finish_reason or ("length" if len(out) >= self.config.max_new_tokens else "stop")
        return result.text, out, finish


class ScoredAnswerer(Answerer):
    """An :class:`Answerer` that can run the target with a domain adapter (the runtime's
    :class:`kibidango.addons.adapters.LoadedAdapters`) and returns, with each answer, the features the
    runtime's calibrator reads (:func:`kibidango.addons.confidence.score_answer`: one forward pass)."""

    def __init__(
        self, model_dir: str | Path, max_new_tokens: int = 128, adapter_dirs: list[Path] = (), parallel: int = 1
    ):
        self.adapter_dirs = list(adapter_dirs)
        super().__init__(model_dir, max_new_tokens, parallel=parallel)

    def _adapters(self):
        from kibidango.addons.adapters import AdapterSet, LoadedAdapters

        if not self.adapter_dirs:
            return None
        found = AdapterSet.from_dirs(self.adapter_dirs)
        return LoadedAdapters(self.model, found, size=max(1, len(found.domains)))

    def answer(
        self, instruction: str, input_: str = "", adapter: str | None = None, temperature: float = 1.0
    ) -> tuple[Answer, dict | None]:
        from kibidango.addons.confidence import AnswerStats, score_answer

        if adapter is not None and self.adapters is None:
            raise ValueError(f"adapter {adapter!r} asked for, but no adapters directory was given")
        with self._turn():
            started = time.monotonic()
            ids = self.prompt_ids(instruction, input_)
            stats = AnswerStats(temperature)
            text, out, finish = self._decode(ids, adapter, stats)
            feats = score_answer(self.target, ids, out, temperature, stats)  # with the adapter that answered
            mean = feats["mean_logprob"] if feats else None
            return Answer(text, len(out), finish, mean, time.monotonic() - started), feats
