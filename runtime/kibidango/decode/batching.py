"""Continuous batching: several requests decode at once, their forward passes merged.

Each request keeps its own decoding loop (:class:`kibidango.decode.speculative.Decoder`, every mode:
ar, sd, lookup, pyramid) on its own thread; what is shared is the forward pass. A request's
session does not run its model itself: :meth:`BatchedSession.feed` hands its tokens to the
:class:`Batcher` and waits. The batcher's engine thread runs a forward as soon as every request
that is decoding waits for one, with all the waiting feeds of a model in it — one llama.cpp
decode over several sequence ids, or one padded torch batch — and hands each request its rows
of logits. So ar steps of N requests are one N-row step; sd's verifications of N requests are one
target pass; draft steps are batched with each other. A request joins the running batch when it
starts decoding (at most ``slots`` at once: the server's ``--parallel``) and leaves it when it
ends, between forwards; nobody waits for a batch to fill.

Per backend, a model's caches for ``slots`` sequences (:class:`LlamaCppSlots`,
:class:`TorchSlots`): llama.cpp gets a second context with ``n_seq_max = slots`` (one unified
cache with room for every sequence's full context) and scores a batch of tokens from several sequences in
one ``llama_decode``; torch keeps one preallocated cache of ``slots`` rows (:class:`_SlotCache`: a
row per slot, each sequence's positions its own, a 4-D mask per forward), in which a step writes
its new keys in place and a request joining or leaving copies nothing; feeds of the same length
go in one forward (different lengths in separate ones). On the CPUs this runtime serves, decoding
a 135M-parameter model is bound by reading its weights once per forward (~3.4 GB/s on the 2-core
machine measured: a step of 32 rows took 2.4x one row's), so wide batches pay as long as the cache
is not copied per step. A paged cache (vLLM, transformers' continuous batching) is what a GPU server wants.

Domain adapters: every request records the adapter it was routed to. On torch, the target's feeds
of one step run in one forward with each row's own adapter (peft's mixed-adapter batch: the base
weights read once) when the adapter cache holds all of them at once; otherwise (and on llama.cpp)
a forward groups feeds by adapter and switches the target's adapter between groups.

Results are those of the same forward done alone up to floating-point rounding (a batched matrix
product may sum in another order): lossless modes keep their guarantee, greedy outputs may differ
from an unbatched run at near-ties."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kibidango.backends.base import ContextLengthError, check_feed

__all__ = ["Batcher", "BatchedModel", "BatchedSession", "LlamaCppSlots", "TorchSlots"]

log = logging.getLogger("kibidango.decode.batching")


@dataclass
class _Feed:
    model: str
    slot: int
    cached: int  # the session's cached length before these tokens (its slot is cropped to it)
    tokens: list[int]
    adapter: str | None
    first: int = 0  # the rows the session reads: tokens[first:]'s (a prompt's last only)
    rows: np.ndarray | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class LlamaCppSlots:
    """``slots`` sequences of one llama.cpp model in a second context of its own (sequence ids
    0..slots-1 in one unified cache of ``slots`` x the model's context cells; each sequence is held
    to the model's context by its session), scored together by ``llama_decode``."""

    def __init__(self, model, slots: int):
        import llama_cpp

        self._lib = llama_cpp
        self.model = model
        self.slots = slots
        self.context = model.context_length
        params = llama_cpp.llama_context_params.from_buffer_copy(model.llm.context_params)
        params.n_ctx = self.context * slots
        params.n_seq_max = slots
        # One cache for all sequences: a decode attends over the cells in use, where per-sequence
        # streams made a 16-sequence step of the tiny bundle's target 3x slower here.
        params.kv_unified = True
        self.capacity = max(512, min(self.context * slots, 4096))  # tokens per llama_decode
        params.n_batch = params.n_ubatch = self.capacity
        self.ctx = llama_cpp.llama_init_from_model(model.llm._model.model, params)
        if not self.ctx:
            raise RuntimeError(f"{model.name}: llama.cpp could not make a context for {slots} sequences")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)
        self.length = [0] * slots
        self.vocab = model.vocab_size
        self.lora: str | None = None
        # what each sequence's cells were computed from, (adapter, tokens): a new prompt takes the
        # cells of its longest start that a sequence holds (llama_memory_seq_cp shares them, as
        # llama.cpp's server does for a common prompt) and decodes only the rest; see TorchSlots
        self.held: list[tuple[str | None, list[int]]] = [(None, []) for _ in range(slots)]
        self.reused = 0
        self.prompts = 0  # prompt tokens of new sequences, reused or computed

    def set_lora(self, name: str | None) -> None:
        if name == self.lora:
            return
        if name is None:
            self._lib.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            adapters = (self._lib.llama_adapter_lora_p_ctypes * 1)(self.model._loras[name])
            scales = (ctypes.c_float * 1)(1.0)
            if self._lib.llama_set_adapters_lora(self.ctx, adapters, 1, scales):
                raise RuntimeError(f"{self.model.name}: llama.cpp refused the LoRA adapter {name!r}")
        self.lora = name

    def forward(self, feeds: list[_Feed]) -> None:
        # ``held`` names only cells that exist: prompts take theirs from it before any sequence of
        # this decode is cut back, and a sequence's new tokens join it once decoded
        for f in feeds:
            if f.cached == 0 and len(f.tokens) > 1:
                self.prompts += len(f.tokens)
                self._reuse(f)
        for f in feeds:
            if self.length[f.slot] > f.cached:
                self._lib.llama_memory_seq_rm(self.memory, f.slot, f.cached, -1)
            self.length[f.slot] = f.cached
            adapter, held = self.held[f.slot]
            self.held[f.slot] = (adapter, held[: f.cached])
        # The feeds' tokens in order, ``capacity`` per decode (a feed may span two: its
        # positions stay in order, so the second decode attends to the first's cells).
        queue = [(f, i) for f in feeds for i in range(len(f.tokens))]
        rows: dict[int, list[np.ndarray]] = {id(f): [] for f in feeds}
        try:
            self._decode(queue, rows)
        except BaseException:
            # a decode that failed after an earlier one of this forward wrote cells: no length
            # names them (the next feed from ``cached`` would meet them), so they go now
            for f in feeds:
                self._lib.llama_memory_seq_rm(self.memory, f.slot, f.cached, -1)
            raise
        for f in feeds:
            f.rows = np.stack(rows[id(f)]).astype(np.float32, copy=False)
            self.length[f.slot] = f.cached + len(f.tokens)
            adapter, held = self.held[f.slot]
            self.held[f.slot] = (self.lora, held + f.tokens)

    def _decode(self, queue: list[tuple[_Feed, int]], rows: dict[int, list[np.ndarray]]) -> None:
        for start in range(0, len(queue), self.capacity):
            chunk = queue[start : start + self.capacity]
            b = self.batch
            b.n_tokens = len(chunk)
            for j, (f, i) in enumerate(chunk):
                b.token[j] = f.tokens[i]
                b.pos[j] = f.cached + i
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = f.slot
                b.logits[j] = int(i >= f.first)  # llama.cpp computes the output layer for these only
            code = self._lib.llama_decode(self.ctx, b)
            if code != 0:
                raise RuntimeError(f"{self.model.name}: llama_decode returned {code} for a batch of {len(chunk)}")
            for j, (f, i) in enumerate(chunk):
                if i >= f.first:
                    ptr = self._lib.llama_get_logits_ith(self.ctx, j)
                    rows[id(f)].append(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy())

    def _reuse(self, f: _Feed) -> None:
        """A new sequence's prompt ``f`` takes the cells of its longest start another sequence (or
        its own slot's last) holds under the active adapter; ``f`` is cut to the rest."""
        best, source = _longest_held(self.held, self.lora, f)
        if best == 0:
            return
        if source != f.slot:
            self._lib.llama_memory_seq_rm(self.memory, f.slot, 0, -1)
            self._lib.llama_memory_seq_cp(self.memory, source, f.slot, 0, best)
            self.length[f.slot] = best
        self.held[f.slot] = (self.lora, f.tokens[:best])
        self.reused += best
        f.cached, f.tokens, f.first = best, f.tokens[best:], f.first - best

    def close(self) -> None:
        if self.ctx:
            self._lib.llama_batch_free(self.batch)
            self._lib.llama_free(self.ctx)
            self.ctx = None


class _SlotCache:
    """The key/value cache of every slot of one model, preallocated: per layer a keys and a values
    tensor of ``[slots, kv_heads, capacity, head_dim]``, slot ``s``'s tokens at ``[s, :, :length]``
    (right-padded: each row from position 0, whatever the others' lengths). It plays transformers'
    ``Cache`` for one forward at a time (:meth:`use`): the attention of each layer calls
    :meth:`update` with the new keys and values of the rows fed, which are written in place at each
    row's own position, and attends over the rows' keys up to ``width`` (the mask, built by
    :class:`TorchSlots`, hides every position a row does not have). A step appends without copying
    the cache (``DynamicCache`` concatenates, a copy of the whole cache per step), and a request
    joining or leaving copies nothing. Capacity grows by doubling (one copy) when a row needs more."""

    def __init__(self, slots: int, context: int):
        self.slots = slots
        self.context = context
        self.keys: list = []
        self.values: list = []
        self.capacity = 0
        self._rows = None  # the forward's rows: a LongTensor of slots, or None for the prefix [0, m)
        self._m = 0
        self._write = None  # (row index, position) tensors of the new tokens, each [m, n]
        self._width = 0

    def use(self, rows, position, width: int) -> None:
        """The next forward: ``rows`` (None: the prefix of slots ``[0, len(position))``), each row's
        new tokens at ``position`` (``[rows, n]``), attention over the first ``width`` positions."""
        import torch

        m = position.shape[0]
        self._rows, self._m, self._width = rows, m, width
        self._write = (torch.arange(m, device=position.device)[:, None].expand_as(position), position)
        need = int(position.max()) + 1
        if need > self.capacity:
            if self.keys:
                self._grow(need)
            else:  # allocated by the first update
                self.capacity = max(need, 64)

    def _grow(self, need: int) -> None:
        capacity = max(need, 2 * self.capacity if 2 * self.capacity <= self.context else need)
        for cache in (self.keys, self.values):
            for i, old in enumerate(cache):
                new = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
                new[:, :, : self.capacity] = old
                cache[i] = new
        self.capacity = capacity

    def update(self, key, value, layer_idx: int, cache_kwargs=None):
        if layer_idx == len(self.keys):  # the first forward: this layer's tensors
            shape = (self.slots, key.shape[1], self.capacity, key.shape[3])
            self.keys.append(key.new_zeros(shape))
            self.values.append(value.new_zeros(shape))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        row, position = self._write
        if self._rows is None:  # the prefix of slots: views, written in place
            keys, values = keys[: self._m], values[: self._m]
            keys[row, :, position] = key.transpose(1, 2)
            values[row, :, position] = value.transpose(1, 2)
            return keys[:, :, : self._width], values[:, :, : self._width]
        slots = self._rows[row]  # a few rows of many (a prefill): gathered, and written back
        keys[slots, :, position] = key.transpose(1, 2)
        values[slots, :, position] = value.transpose(1, 2)
        return keys[self._rows, :, : self._width], values[self._rows, :, : self._width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width


class TorchSlots:
    """``slots`` sequences of one transformers model in one preallocated cache (:class:`_SlotCache`).

    A forward runs the feeds of one length ``n`` together; each sequence's tokens go at its own
    positions (``position_ids``) and attend through a 4-D mask to its own cached positions only. Where
    the feeds are at least half of the slots ``[0, m)`` up to the highest one fed (ar steps and
    verifications of a running batch: the batcher hands out the lowest free slots), the forward
    runs on that prefix of the cache as it is — a view, nothing copied — and the slots in it that
    feed nothing this time get a placeholder token, written past their cached length (never read:
    the mask hides it, their next feed overwrites it) and its logits dropped. Otherwise (a new
    request's prefill beside a running batch) the fed slots' caches are gathered for that forward.

    A new sequence's prompt reuses what any slot's cache still holds of it (prefix caching, as
    vLLM's automatic prefix caching and llama.cpp's server's slot reuse do): every slot remembers
    the tokens (and adapter) its positions were computed from — after its request ended too, until
    they are overwritten — and a prefill whose first tokens some slot holds copies those positions'
    keys and values into its own slot and runs only the rest. A chat template's system prompt is
    computed once per batcher, and a prompt sampled again (a self-teaching tier's samples, one
    after another) is read once. The copied entries are the ones the same model and adapter wrote
    for the same tokens at the same positions: the result is the recomputation's up to rounding.

    Needs a model whose attention layers call ``past_key_values.update(key, value, layer_idx)`` and
    take a prepared 4-D mask as it is (transformers' decoder-only models: Llama, Mistral, Qwen2,
    ...); sliding-window attention would see the whole context."""

    def __init__(self, model, slots: int, adapters: bool = True):
        self.model = model
        self.slots = slots
        self.length = [0] * slots
        self.cache = _SlotCache(slots, model.context_length)
        self.gathered = 0  # forwards that gathered their rows (the rest ran on a prefix, in place)
        # what each slot's cache positions were computed from: (adapter, tokens); kept after release
        self.held: list[tuple[str | None, list[int]]] = [(None, []) for _ in range(slots)]
        self.adapters = adapters  # False: the model runs without the feeds' adapters (a draft's tier)
        self.reused = 0  # prompt tokens copied from a slot's cache instead of computed
        self.prompts = 0  # prompt tokens of new sequences, reused or computed

    def set_lora(self, name: str | None) -> None:  # peft switches the shared weights: the adapters' use() did
        pass

    def release(self, slot: int) -> None:
        """The slot's sequence ended: nothing of it is read again."""
        self.length[slot] = 0

    def forward(self, feeds: list[_Feed], mixed: bool = False) -> None:
        """``mixed``: the feeds' adapters differ, and each row runs with its own (every one of them
        loaded: :meth:`TorchModel.mixed_lora_forward`); else they run with the active adapter."""
        for f in feeds:  # where the session stands: a crop since its last feed moves the slot back, nothing to copy
            self.length[f.slot] = f.cached
        for f in feeds:
            if f.cached == 0 and len(f.tokens) > 1:
                self.prompts += len(f.tokens)
                self._reuse(f)
        groups: dict[int, list[_Feed]] = {}
        for f in sorted(feeds, key=lambda f: f.slot):
            groups.setdefault(len(f.tokens), []).append(f)
        for n, group in groups.items():
            self._forward(group, n, mixed)

    def _key(self, f: _Feed) -> str | None:
        return f.adapter if self.adapters else None

    def _reuse(self, f: _Feed) -> None:
        """A new sequence's prompt ``f``: the longest start of it that a slot's cache holds (the same
        adapter's) is copied into ``f``'s slot, and ``f`` is cut to the rest (at least the tokens
        whose rows it reads)."""
        key = self._key(f)
        best, source = _longest_held(self.held, key, f)
        if best == 0:
            return
        if source != f.slot:
            import torch

            with torch.inference_mode():  # the cache's tensors were made in it
                for cache in (self.cache.keys, self.cache.values):
                    for layer in cache:
                        layer[f.slot, :, :best] = layer[source, :, :best]
        self.held[f.slot] = (key, f.tokens[:best])
        self.reused += best
        f.cached, f.tokens, f.first = best, f.tokens[best:], f.first - best
        self.length[f.slot] = best

    def _forward(self, feeds: list[_Feed], n: int, mixed: bool = False) -> None:
        import torch

        hf, device = self.model.hf, self.model.device
        width = max(self.length[f.slot] for f in feeds) + n  # what the fed rows attend over
        if width > self.model.context_length:
            raise ContextLengthError(f"{self.model.name}: {width} positions exceed the context")
        m = max(f.slot for f in feeds) + 1
        prefix = 2 * len(feeds) >= m
        if prefix:
            fed = {f.slot: f for f in feeds}
            tokens = [fed[s].tokens if s in fed else [0] * n for s in range(m)]
            # a placeholder at or past both its slot's own tokens and the fed rows' width
            starts = [self.length[s] if s in fed else max(self.length[s], width) for s in range(m)]
            adapters = [fed[s].adapter if s in fed else None for s in range(m)]
            rows = None
        else:
            tokens = [f.tokens for f in feeds]
            starts = [self.length[f.slot] for f in feeds]
            adapters = [f.adapter for f in feeds]
            rows = torch.tensor([f.slot for f in feeds], dtype=torch.long, device=device)
            self.gathered += 1
        position = torch.tensor(starts, dtype=torch.long, device=device)[:, None] + torch.arange(n, device=device)
        # row i's query j sees the positions up to its own (a placeholder sees everything: discarded)
        mask = torch.arange(width, device=device)[None, None, None, :] <= position[:, None, :, None]
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        # ``held`` names only positions whose keys and values stand: a fed slot's from where it
        # writes, a placeholder's slot's from where the placeholder goes, are cut before they change
        for f in feeds:
            del self.held[f.slot][1][f.cached :]
        if prefix:
            for s in set(range(m)) - set(fed):
                del self.held[s][1][starts[s] :]
        self.cache.use(rows, position, width)
        call = functools.partial(self.model.mixed_lora_forward, adapters) if mixed else hf
        skip = min(f.first for f in feeds)  # positions no feed reads: no output layer for them
        with torch.inference_mode():
            out = call(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=n - skip,
            )
        logits = out.logits.float().cpu().numpy()
        for i, f in enumerate(feeds):
            f.rows = logits[f.slot if prefix else i, f.first - skip :]
            self.length[f.slot] = f.cached + n
            adapter, held = self.held[f.slot]
            self.held[f.slot] = (self._key(f), held + f.tokens)

    def close(self) -> None:
        self.cache = _SlotCache(self.slots, self.model.context_length)
        self.length = [0] * self.slots
        self.held = [(None, []) for _ in range(self.slots)]


def _longest_held(held: list[tuple[str | None, list[int]]], adapter: str | None, f: _Feed) -> tuple[int, int]:
    """``(n, slot)``: the most first tokens of ``f`` a slot holds under ``adapter`` (up to the
    first row ``f`` reads, and one token short of all of them: a feed computes something), and
    which slot; ``(0, -1)`` when none does."""
    best, source = 0, -1
    limit = min(f.first, len(f.tokens) - 1)
    for s, (key, tokens) in enumerate(held):
        if key != adapter or len(tokens) <= best:
            continue
        n = _common_prefix(tokens, f.tokens, limit)
        if n > best:
            best, source = n, s
    return best, source


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many first tokens ``a`` and ``b`` share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class BatchedSession:
    """One request's sequence on one model, in the request's slot; see the module's text."""

    def __init__(self, model: BatchedModel, slot: int, adapter: str | None):
        self._model = model
        self.slot = slot
        self.adapter = adapter
        self.tokens: list[int] = []
        self.forward_calls = 0
        self.tokens_fed = 0

    def feed(self, tokens: list[int], first: int = 0) -> np.ndarray:
        check_feed(self._model.name, len(self.tokens), tokens, first, self._model.context_length)
        feed = _Feed(self._model.name, self.slot, len(self.tokens), list(tokens), self.adapter, first)
        rows = self._model.batcher.submit(feed)
        self.tokens.extend(tokens)
        self.forward_calls += 1
        self.tokens_fed += len(tokens)
        return rows

    def crop(self, n: int) -> None:
        if n < len(self.tokens):  # the slot follows at the next feed (see _Feed.cached)
            del self.tokens[n:]


class BatchedModel:
    """A tier's model as the decoders see it under a :class:`Batcher`: sessions in the calling
    request's slot."""

    def __init__(self, name: str, model, batcher: Batcher):
        self.name = name
        self.inner = model
        self.batcher = batcher
        self.vocab_size = model.vocab_size
        self.context_length = model.context_length

    def new_session(self) -> BatchedSession:
        slot, adapter = self.batcher.member_state()
        return BatchedSession(self, slot, adapter)

    def parameters(self) -> int:
        return self.inner.parameters()


class _ThreadAdapters:
    """The pipeline's adapter cache under a batcher: ``use(domain)`` records the calling request's
    choice; the engine activates it for that request's forwards."""

    def __init__(self, batcher: Batcher, loaded):
        self._batcher = batcher
        self.real = loaded
        self.adapters = loaded.adapters

    @property
    def loads(self) -> int:
        return self.real.loads

    def use(self, domain: str | None) -> None:
        if domain is not None and domain not in self.adapters.domains:
            raise KeyError(f"no adapter for domain {domain!r}")
        self._batcher.set_adapter(domain)


@dataclass
class _Member:
    slot: int
    adapter: str | None = None


@dataclass
class BatchStats:
    forwards: int = 0
    feeds: int = 0
    rows: dict[int, int] = field(default_factory=dict)  # feeds per forward -> forwards
    mixed: int = 0  # engine steps whose target forward mixed adapters (torch)
    widest: int = 0  # the most adapters (the base weights not counted) one mixed forward ran with

    def mean_batch(self) -> float:
        return self.feeds / self.forwards if self.forwards else 0.0


class Batcher:
    """Merges the forward passes of up to ``slots`` concurrent generations of ``pipe`` (a
    :class:`kibidango.pipeline.Pipeline`, rewired in place: its decoder's models become
    :class:`BatchedModel` s). A thread decodes only inside :meth:`member`."""

    def __init__(self, pipe, slots: int):
        if slots < 1:
            raise ValueError(f"parallel must be >= 1, got {slots}")
        from kibidango.decode.speculative import Decoder

        self.slots = slots
        self.pipe = pipe
        self.raw = dict(pipe.models)
        self.backend = pipe.backend
        self.tiers = {name: self._slots_for(model) for name, model in self.raw.items()}
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)  # the engine's: a forward may run
        self.running = 0  # members not waiting for a forward
        self.members: dict[int, _Member] = {}
        self.free = list(range(slots))
        self.seats = threading.BoundedSemaphore(slots)  # turn(): a slot, waited for
        self.pending: list[_Feed] = []
        self.closed = False
        self.stats = BatchStats()
        self.real_adapters = cache = pipe.adapters
        if cache is not None and slots > 1 and not cache.fits(cache.adapters.domains):
            swapped = len(set(cache.adapters.domains) - {cache.keep})
            log.warning(
                f"the adapter cache holds {cache.size} of the bundle's {swapped} adapters: batched requests "
                "routed to more than that run a forward per adapter, swapping them each step "
                f"(--adapter-cache {swapped} keeps them all)"
            )
        wrapped = {name: BatchedModel(name, model, self) for name, model in self.raw.items()}
        pipe.models = wrapped
        pipe.decoder = Decoder(wrapped, pipe.decoder.ngram_table)
        if pipe.adapters is not None:
            pipe.adapters = _ThreadAdapters(self, pipe.adapters)
        self.engine = threading.Thread(target=self._engine, name="kibidango-batcher", daemon=True)
        self.engine.start()

    def _slots_for(self, model):
        if self.backend == "llamacpp":
            return LlamaCppSlots(model, self.slots)
        if getattr(model, "compiled_step", None) is not None:
            raise ValueError(
                "a compiled draft (--compile) keeps a static cache per sequence: serve it with --parallel 1"
            )
        return TorchSlots(model, self.slots, adapters=model is self.raw.get("target"))

    @contextlib.contextmanager
    def member(self) -> Iterator[int]:
        """The calling thread decodes within: it gets a slot (the caller bounds the members to
        ``slots``: the server's scheduler admits that many) and the engine waits for its feeds."""
        me = threading.get_ident()
        with self.lock:
            if not self.free:
                raise RuntimeError("more generations than batch slots")
            slot = min(self.free)  # the lowest: the running sequences stay a prefix of the slots (TorchSlots)
            self.free.remove(slot)
            self.members[me] = _Member(slot)
            self.running += 1
        try:
            yield slot
        finally:
            for tier in self.tiers.values():  # before the slot is free again
                if hasattr(tier, "release"):
                    tier.release(slot)
            with self.lock:
                del self.members[me]
                self.free.append(slot)
                self.running -= 1
                if self.running == 0:
                    self.wake.notify()

    @contextlib.contextmanager
    def turn(self) -> Iterator[int]:
        """:meth:`member`, waiting for a free slot (a caller that does not bound its threads)."""
        with self.seats, self.member() as slot:
            yield slot

    def member_state(self) -> tuple[int, str | None]:
        m = self.members.get(threading.get_ident())
        if m is None:
            raise RuntimeError("a batched model is used outside Batcher.member()")
        return m.slot, m.adapter

    def set_adapter(self, domain: str | None) -> None:
        m = self.members.get(threading.get_ident())
        if m is None:
            raise RuntimeError("a batched pipeline routes only inside Batcher.member()")
        m.adapter = domain

    def submit(self, feed: _Feed) -> np.ndarray:
        with self.lock:
            if self.closed:
                raise RuntimeError("the batcher is closed")
            self.pending.append(feed)
            self.running -= 1
            if self.running == 0:
                self.wake.notify()
        feed.done.wait()  # the engine counts us running again before it sets this
        if feed.error is not None:
            raise feed.error
        return feed.rows

    def _engine(self) -> None:
        while True:
            with self.lock:
                self.wake.wait_for(lambda: self.closed or (self.pending and self.running == 0))
                batch, self.pending = self.pending, []
                if self.closed:
                    self.running += len(batch)
                    for f in batch:
                        f.error = RuntimeError("the batcher is closed")
                        f.done.set()
                    return
            self._run(batch)
            with self.lock:
                self.running += len(batch)
                self.stats.forwards += 1
                self.stats.feeds += len(batch)
                self.stats.rows[len(batch)] = self.stats.rows.get(len(batch), 0) + 1
            for f in batch:
                f.done.set()

    def _mixes(self, feeds: list[_Feed]) -> bool:
        """Whether the target's ``feeds`` run in one forward, each with its own adapter (torch:
        peft's mixed-adapter batch) — every adapter they name loaded at once (the adapter cache
        holds them all; else one forward per adapter, the cache swapping them) — and loads them."""
        adapters = {f.adapter for f in feeds}
        if self.real_adapters is None or len(adapters) < 2 or not isinstance(self.tiers["target"], TorchSlots):
            return False
        if not self.real_adapters.fits(adapters):
            return False
        for adapter in adapters - {None}:  # the least recently used of the cache are not among them: none is evicted
            self.real_adapters.use(adapter)
        return True

    def _run(self, batch: list[_Feed]) -> None:
        target = [f for f in batch if f.model == "target"]
        mixed = self._guarded("target", target, self._mixes, target)
        if mixed:
            self.stats.mixed += 1
            self.stats.widest = max(self.stats.widest, len({f.adapter for f in target} - {None}))
            self._guarded("target", target, self.tiers["target"].forward, target, mixed=True)
        groups: dict[tuple[str, str | None], list[_Feed]] = {}
        for f in batch:
            if not (mixed and f.model == "target") and f.error is None:
                groups.setdefault((f.model, f.adapter if f.model == "target" else None), []).append(f)
        for (name, adapter), feeds in groups.items():
            self._guarded(name, feeds, self._forward_group, name, adapter, feeds)

    def _forward_group(self, name: str, adapter: str | None, feeds: list[_Feed]) -> None:
        """One tier's ``feeds``, the target's with ``adapter`` active."""
        tier = self.tiers[name]
        if name == "target" and self.real_adapters is not None:
            if adapter != self.real_adapters.active:
                tier.set_lora(None)  # before an eviction can free the adapter it runs with
            self.real_adapters.use(adapter)
            tier.set_lora(adapter)
        tier.forward(feeds)

    @staticmethod
    def _guarded(name: str, feeds: list[_Feed], call, *args, **kwargs):
        """``call(...)``; where it raises, each request of ``feeds`` gets the error and the engine lives on."""
        try:
            return call(*args, **kwargs)
        except Exception as e:
            log.exception(f"a batched forward of {name} failed")
            for f in feeds:
                f.error = e
            return None

    def close(self) -> None:
        """Stop the engine (requests still waiting get an error) and give the pipeline its own
        models, decoder and adapters back: it decodes one request at a time again."""
        from kibidango.decode.speculative import Decoder

        with self.lock:
            self.closed = True
            self.wake.notify()
        self.engine.join(timeout=10)
        for name, tier in self.tiers.items():
            if tier.prompts:
                log.info(
                    f"{name}: {tier.reused:,} of {tier.prompts:,} prompt tokens ({tier.reused / tier.prompts:.0%}) "
                    "taken from a slot's cache, not computed"
                )
            tier.close()
        self.pipe.models = self.raw
        self.pipe.decoder = Decoder(self.raw, self.pipe.decoder.ngram_table)
        self.pipe.adapters = self.real_adapters
