"""GGUF models through llama-cpp-python (the ``llamacpp`` extra).

A verification is one ``llama_decode`` of all the drafted tokens (one batch) that asks for the
logits of the positions the decoder reads (a prompt's last, every drafted token's); a rollback drops the rejected
positions from the KV cache with llama.cpp's sequence-removal call (``llama_memory_seq_rm``)
and moves ``n_tokens`` back, so the kept prefix is never evaluated again.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kibidango.backends.base import KV_BYTES_PER_ELEMENT, KV_CACHE_TYPES, check_feed, sync_and_feed

__all__ = ["KV_CACHE_TYPES", "LlamaCppModel", "LlamaCppSession", "DraftModelHook", "thread_counts"]
# KV_CACHE_TYPES (backends/base.py): the K/V cache types the runtime offers (plan row 1H): f16 (2
# bytes per element), q8_0 (34 bytes per 32), q4_0 (18 bytes per 32). A quantized V cache needs flash
# attention, which is then switched on.


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:  # the extra is optional: say how to get it
        raise ImportError("the llamacpp backend needs llama-cpp-python: pip install 'kibidango[llamacpp]'") from e
    return llama_cpp


_PARAMS_LOCK = threading.Lock()


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_int8" in line for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def _model_params(extra_bufts: bool) -> Iterator[None]:
    """llama-cpp-python's ``Llama`` takes its model parameters from
    ``llama_cpp.llama_cpp.llama_model_default_params()`` and has no argument for
    ``use_extra_bufts``; for the duration of one load, that function returns defaults with
    ``use_extra_bufts`` set as asked."""
    if extra_bufts:
        yield
        return
    import llama_cpp.llama_cpp as llama_cpp  # the module llama_cpp.Llama reads it from

    with _PARAMS_LOCK:
        original = llama_cpp.llama_model_default_params

        def defaults():
            params = original()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = defaults
        try:
            yield
        finally:
            llama_cpp.llama_model_default_params = original


def model_params(extra_bufts: bool | None = None) -> contextlib.AbstractContextManager[None]:
    """While inside: every ``llama_cpp.Llama`` loaded in this process gets llama.cpp's CPU extra
    buffer types on or off as :func:`_extra_bufts_default` decides (``extra_bufts`` overrides).
    For a process that loads models through llama-cpp-python itself (its OpenAI-compatible server:
    ``methods/llama_server_main.py``)."""
    return _model_params(_extra_bufts_default() if extra_bufts is None else extra_bufts)


def _extra_bufts_default() -> bool:
    """llama.cpp's CPU "extra buffer types" repack quantized weights for special kernels. On CPUs
    with AMX, llama-cpp-python 0.3.36 (built natively) crashes with SIGSEGV in
    ``ggml_backend_amx_mul_mat`` on the first decode of any quantized GGUF (Q8_0, Q5_K_M,
    Q4_K_M; F16/F32 are not repacked and run). So they are off where the CPU has AMX, on
    elsewhere; ``KIBIDANGO_LLAMACPP_EXTRA_BUFTS=1|0`` decides instead."""
    forced = os.environ.get("KIBIDANGO_LLAMACPP_EXTRA_BUFTS")
    if forced is not None:
        return forced not in ("0", "false", "no")
    return not _cpu_has_amx()


def thread_counts(threads: int | None = None, threads_batch: int | None = None) -> tuple[int, int]:
    """llama.cpp's threads for one-token steps and for multi-token batches (a verification).

    llama-cpp-python's defaults differ: half the CPUs for steps, all of them for batches. On a
    machine whose cores are busy with anything else (a second process, the other tier's step), a
    batch then waits at every barrier of ggml's thread pool for a thread that is not running:
    here a 5-token verification of the bench family's target took 2.6x longer with 2 batch threads
    than with 1 while one core was busy, while the one-token step, on 1 thread, did not suffer. So
    both use the same count by default: ``threads``, else ``$KIBIDANGO_THREADS``, else half the CPUs
    this process may run on (at least 1). ``threads_batch`` (else ``$KIBIDANGO_THREADS_BATCH``)
    sets the batches' count apart, for a machine whose other cores are idle while it decodes."""
    if threads is None and os.environ.get("KIBIDANGO_THREADS"):
        threads = int(os.environ["KIBIDANGO_THREADS"])
    if threads is None:
        threads = max(1, len(os.sched_getaffinity(0)) // 2) if hasattr(os, "sched_getaffinity") else 1
    if threads_batch is None and os.environ.get("KIBIDANGO_THREADS_BATCH"):
        threads_batch = int(os.environ["KIBIDANGO_THREADS_BATCH"])
    if threads_batch is None:
        threads_batch = threads
    if min(threads, threads_batch) < 1:
        raise ValueError(f"threads must be >= 1, got {threads} (steps) and {threads_batch} (batches)")
    return threads, threads_batch


@contextlib.contextmanager
def _cache_error(path: str | Path, kv_cache: str) -> Iterator[None]:
    """llama.cpp cannot make a quantized cache whose rows (one attention head) are narrower than
    the type's block of 32 values; it only says "Failed to create llama_context"."""
    try:
        yield
    except ValueError as e:
        if kv_cache == "f16" or "llama_context" not in str(e):
            raise
        raise ValueError(
            f"{path}: llama.cpp could not create a {kv_cache} KV cache; a quantized cache needs attention "
            "heads whose width is a multiple of 32 (use kv_cache='f16' for this model)"
        ) from e


class LlamaCppSession:
    """A llama.cpp context holds one sequence, so a model serves one session at a time; a new
    session clears the cache of the previous one."""

    def __init__(self, model: LlamaCppModel):
        self._model = model
        self._llm = model.llm
        self._llm.reset()
        self._llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        self.tokens: list[int] = []
        self.forward_calls = 0
        self.tokens_fed = 0
        model.active = self

    def feed(self, tokens: list[int], first: int = 0) -> np.ndarray:
        check_feed(self._model.name, len(self.tokens), tokens, first, self._model.context_length)
        if self._model.active is not self:
            raise RuntimeError(f"{self._model.name}: another session has used this llama.cpp context since")
        rows = self._decode(tokens, first)
        self.tokens.extend(tokens)
        self.forward_calls += 1
        self.tokens_fed += len(tokens)
        return rows

    def _decode(self, tokens: list[int], first: int) -> np.ndarray:
        """``tokens`` through ``llama_decode`` in batches of the context's n_batch, asking llama.cpp
        for the logits of positions ``first`` on only (a batch with none of them yields its last
        row, which is dropped): llama-cpp-python's ``eval`` with ``logits_all`` computes the output
        layer at every position and keeps each row twice (its output buffer and ``Llama.scores``),
        ~3 x 196 KB a prompt token for a 49K vocabulary."""
        llm = self._llm
        llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)  # as Llama.eval: nothing cached past the sequence
        rows = np.empty((len(tokens) - first, self._model.vocab_size), dtype=np.float32)
        for start in range(0, len(tokens), llm.n_batch):
            chunk = tokens[start : start + llm.n_batch]
            want = max(first - start, 0)  # the chunk's first wanted row (len(chunk): none)
            llm._batch.set_batch(batch=chunk, n_past=llm.n_tokens, logits_all=False)
            for i in range(want, len(chunk)):
                llm._batch.batch.logits[i] = True
            llm._ctx.decode(llm._batch)
            llm.input_ids[llm.n_tokens : llm.n_tokens + len(chunk)] = chunk
            llm.n_tokens += len(chunk)
            if want < len(chunk):
                got = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(chunk) - want, rows.shape[1]))
                rows[start + want - first : start + len(chunk) - first] = got
        return rows

    def crop(self, n: int) -> None:
        if n < len(self.tokens):
            self._llm._ctx.kv_cache_seq_rm(0, n, -1)  # drop cached positions >= n
            self._llm.n_tokens = n
            del self.tokens[n:]


class LlamaCppModel:
    def __init__(
        self,
        path: str | Path,
        name: str = "",
        n_ctx: int | None = None,
        threads: int | None = None,
        extra_bufts: bool | None = None,
        kv_cache: str = "f16",
        flash_attn: bool | None = None,
    ):
        """``kv_cache``: the K/V cache type (:data:`KV_CACHE_TYPES`); ``flash_attn``: llama.cpp's
        flash attention (default: on for a quantized cache, which needs it; llama.cpp's own choice
        otherwise)."""
        llama_cpp = _llama_cpp()
        if kv_cache not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache {kv_cache!r}: use one of {', '.join(KV_CACHE_TYPES)}")
        self.name = name or Path(path).stem
        self.kv_cache = kv_cache
        cache: dict = {} if flash_attn is None else {"flash_attn": flash_attn}
        if kv_cache != "f16":
            if flash_attn is False:
                raise ValueError(f"a {kv_cache} KV cache needs flash attention")
            ggml_type = getattr(llama_cpp, f"GGML_TYPE_{kv_cache.upper()}")
            cache = {"type_k": ggml_type, "type_v": ggml_type, "flash_attn": True}
        probe_ctx = n_ctx or 0  # 0: the model's training context
        self.threads, self.threads_batch = thread_counts(threads)
        with (
            _model_params(_extra_bufts_default() if extra_bufts is None else extra_bufts),
            _cache_error(path, kv_cache),
        ):
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=probe_ctx,
                n_batch=max(probe_ctx, 512),
                n_threads=self.threads,
                n_threads_batch=self.threads_batch,
                verbose=False,
                seed=0,
                **cache,
            )
        self.context_length = self.llm.n_ctx()
        self.vocab_size = self.llm.n_vocab()
        self.active: LlamaCppSession | None = None
        self._loras: dict[str, object] = {}

    def kv_bytes_per_token(self) -> float:
        """Bytes of K/V cache one token of context takes at this model's cache type: a K and a V row
        of the KV heads' width per layer (what llama.cpp allocates for each of the context's cells)."""
        llama_cpp, model = _llama_cpp(), self.llm._model.model
        head_dim = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
        width = llama_cpp.llama_model_n_head_kv(model) * head_dim
        return 2 * llama_cpp.llama_model_n_layer(model) * width * KV_BYTES_PER_ELEMENT[self.kv_cache]

    def set_threads(self, threads: int, threads_batch: int) -> None:
        """llama.cpp's thread counts for one-token steps and for batches from now on (the context's
        ``llama_set_n_threads``; nothing is reloaded)."""
        threads, threads_batch = thread_counts(threads, threads_batch)  # both given: checked, nothing read
        _llama_cpp().llama_set_n_threads(self.llm._ctx.ctx, threads, threads_batch)
        self.threads, self.threads_batch = threads, threads_batch

    # llama.cpp LoRA adapters (GGUF), loaded against the model and switched on the context; a
    # session started after a switch starts from an empty cache.
    def load_lora(self, name: str, adapter) -> None:
        llama_cpp = _llama_cpp()
        path = adapter.gguf_path()
        ptr = llama_cpp.llama_adapter_lora_init(self.llm._model.model, str(path).encode())
        if not ptr:
            from kibidango.integrity import BundleError

            raise BundleError(f"llama.cpp could not load the LoRA adapter {path}")
        self._loras[name] = ptr

    def set_lora(self, name: str | None) -> None:
        import ctypes

        llama_cpp = _llama_cpp()
        if name is None:
            llama_cpp.llama_set_adapters_lora(self.llm._ctx.ctx, None, 0, None)
        else:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self._loras[name])
            scales = (ctypes.c_float * 1)(1.0)
            if llama_cpp.llama_set_adapters_lora(self.llm._ctx.ctx, adapters, 1, scales):
                raise RuntimeError(f"{self.name}: llama.cpp refused the LoRA adapter {name!r}")
        self.active = None  # the cached positions were computed with the previous weights

    def unload_lora(self, name: str) -> None:
        ptr = self._loras.pop(name, None)
        if ptr is not None:
            _llama_cpp().llama_adapter_lora_free(ptr)

    def new_session(self) -> LlamaCppSession:
        return LlamaCppSession(self)

    def parameters(self) -> int:
        return int(_llama_cpp().llama_model_n_params(self.llm.model))


class DraftModelHook:
    """llama-cpp-python's own speculative loop takes a ``LlamaDraftModel``: this one proposes
    ``k`` greedy tokens from a draft GGUF (used by ``kibidango bench`` as the llama.cpp peer)."""

    def __new__(cls, draft: LlamaCppModel, k: int = 4):
        from llama_cpp.llama_speculative import LlamaDraftModel

        class _Hook(LlamaDraftModel):
            def __init__(self) -> None:
                self.session = draft.new_session()

            def __call__(self, input_ids, /, **kwargs):
                ids = [int(t) for t in input_ids]
                out: list[int] = []
                row = sync_and_feed(self.session, ids, [])[0]
                for _ in range(k):
                    out.append(int(np.argmax(row)))
                    if len(ids) + len(out) >= draft.context_length:
                        break
                    row = self.session.feed([out[-1]])[0]
                return np.array(out, dtype=np.intc)

        return _Hook()
