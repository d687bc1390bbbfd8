"""transformers models with a ``DynamicCache`` that is cropped after a rejection, not rebuilt.
The reference backend and the exactness oracle.

``compile_steps=True`` (the runtime sets it for the draft and qualifier tiers with ``--compile``):
a ``StaticCache`` and the single-token forward compiled with ``torch.compile``. A transformers
forward of a small model is mostly fixed per-call work (module dispatch, mask and cache
bookkeeping in Python); compiling the one shape a draft steps with removes most of it. Multi-token
feeds (prefill, verification) stay eager, on the same cache. Cropping moves each layer's write
position back: slots past it are masked as the future until overwritten. The target is never compiled, so
compiled kernels' rounding cannot change what a lossless mode outputs."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from kibidango.backends import attention
from kibidango.backends.base import check_feed
from kibidango.integrity import BundleError

__all__ = ["TorchModel", "TorchSession"]


class TorchSession:
    def __init__(self, model: TorchModel):
        from transformers import DynamicCache, StaticCache

        self._model = model
        self._static = model.compiled_step is not None
        if self._static:
            self._cache = StaticCache(config=model.hf.config, max_cache_len=model.context_length)
        else:
            self._cache = DynamicCache()
        self.tokens: list[int] = []
        self.forward_calls = 0
        self.tokens_fed = 0

    def feed(self, tokens: list[int], first: int = 0) -> np.ndarray:
        check_feed(self._model.name, len(self.tokens), tokens, first, self._model.context_length)
        keep = len(tokens) - first  # the output layer on the rows asked for only
        ids = torch.tensor([tokens], dtype=torch.long, device=self._model.device)
        with torch.inference_mode():
            if self._static:
                start = len(self.tokens)
                position = torch.arange(start, start + len(tokens), device=self._model.device)
                if len(tokens) == 1:
                    out = self._model.compiled_step(
                        input_ids=ids, past_key_values=self._cache, use_cache=True, cache_position=position
                    )
                else:
                    out = self._model.hf.forward(
                        input_ids=ids,
                        past_key_values=self._cache,
                        use_cache=True,
                        cache_position=position,
                        logits_to_keep=keep,
                    )
            else:
                out = self._model.hf(input_ids=ids, past_key_values=self._cache, use_cache=True, logits_to_keep=keep)
        self.tokens.extend(tokens)
        self.forward_calls += 1
        self.tokens_fed += len(tokens)
        return out.logits[0, -keep:].float().cpu().numpy()

    def crop(self, n: int) -> None:
        drop = len(self.tokens) - n
        if drop > 0:
            if self._static:  # its layers write at their own counter: move it back (in place, a static address)
                with torch.inference_mode():  # the counters were made in feed()'s inference mode
                    for layer in self._cache.layers:
                        if layer.is_initialized:
                            layer.cumulative_length.fill_(n)
            else:
                self._cache.crop(-drop)  # negative: remove that many trailing positions
            del self.tokens[n:]


def _plain_forwards(hf, device) -> None:
    """A compressed-tensors checkpoint (the AWQ target) as a plain model, where that changes no
    output: its weights decompressed once (the first forward pass does it), then the offloading
    wrapper on every module's forward and the on-the-fly quantization wrapper on every decompressed
    weight-only layer removed. They cost a 6-layer model 1/3 of its tokens/s on a CPU (per call:
    moving each argument to the device it is already on; fake-quantizing activations a weight-only
    scheme has none of). Any other checkpoint is left as it is."""
    if not any(hasattr(m, "_original_forward_func") or hasattr(m, "quantization_scheme") for m in hf.modules()):
        return
    from compressed_tensors.offload.dispatch import remove_dispatch
    from compressed_tensors.quantization import QuantizationStatus

    with torch.inference_mode():
        hf(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    remove_dispatch(hf, onload_tensors=True)
    for module in hf.modules():
        scheme, status = getattr(module, "quantization_scheme", None), getattr(module, "quantization_status", None)
        stored = status is not None and status >= QuantizationStatus.COMPRESSED
        if scheme is not None and (scheme.input_activations or scheme.output_activations or not stored):
            continue  # activations quantized on the fly, or weights not yet stored quantized: the wrapper works
        if "forward" in module.__dict__:  # an instance's override of its class's forward
            del module.forward


class TorchModel:
    def __init__(
        self,
        path: str | Path,
        name: str = "",
        device: str | None = None,
        dtype: torch.dtype = torch.float32,
        compile_steps: bool = False,
    ):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per tier per load is noise in a CLI
        self.name = name or Path(path).name
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:  # safetensors only: a bundle carries no pickles (a .bin is refused, never unpickled)
            self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True)
        except (OSError, ValueError, pickle.UnpicklingError) as e:
            raise BundleError(
                f"{path}: the tier's weights could not be loaded ({type(e).__name__}: {str(e)[:300]}); a tier ships "
                "its weights as safetensors"
            ) from None
        self.hf = self.hf.to(self.device).eval()
        _plain_forwards(self.hf, self.device)
        attention.install(self.hf)
        self.vocab_size = self.hf.config.vocab_size
        self.context_length = getattr(self.hf.config, "max_position_embeddings", 2048)
        self._peft = None
        self._lora: str | None = None  # the adapter set_lora chose (None: base weights)
        self.compiled_step = None
        if compile_steps:
            self.compile_steps()

    def compile_steps(self) -> None:
        """Compile the single-token forward (one static shape; compiled on its first call, tens
        of seconds on a CPU) and give every new session a static cache."""
        self.compiled_step = torch.compile(self.hf.forward, dynamic=False, fullgraph=False)

    @classmethod
    def from_hf(cls, hf_model, name: str = "model") -> TorchModel:
        """Wrap an in-memory transformers model (tests build tiny random ones)."""
        self = cls.__new__(cls)
        self.name, self.hf = name, hf_model.eval()
        attention.install(self.hf)
        self.device = next(hf_model.parameters()).device
        self.vocab_size = hf_model.config.vocab_size
        self.context_length = getattr(hf_model.config, "max_position_embeddings", 2048)
        self._peft = None
        self._lora: str | None = None  # the adapter set_lora chose (None: base weights)
        self.compiled_step = None
        return self

    # LoRA adapters (peft), several loaded side by side, one active: peft injects its layers into
    # ``self.hf`` in place, so sessions keep calling ``self.hf``; ``set_lora(None)`` disables them.
    def load_lora(self, name: str, adapter) -> None:
        """Load ``adapter`` (a :class:`kibidango.addons.adapters.Adapter` with peft files) as ``name``."""
        try:
            from peft import PeftModel
        except ImportError as e:
            from kibidango.integrity import BundleError

            raise BundleError("peft adapters need the `peft` package (pip install peft)") from e
        where = str(adapter.peft_dir())
        if self._peft is None:
            # A compressed-tensors checkpoint (the AWQ target) decompresses its weights on the first
            # forward pass (a hook); peft needs them as plain weights, so one token goes first.
            with torch.inference_mode():
                self.hf(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device))
            self._peft = PeftModel.from_pretrained(self.hf, where, adapter_name=name, is_trainable=False)
        else:
            self._peft.load_adapter(where, adapter_name=name, is_trainable=False)
        self._peft.eval()

    def set_lora(self, name: str | None) -> None:
        if self._peft is None:
            if name is not None:
                raise KeyError(f"{self.name}: adapter {name!r} is not loaded")
            return
        if name is None:
            self._peft.base_model.disable_adapter_layers()
        else:
            self._peft.base_model.enable_adapter_layers()
            self._peft.set_adapter(name)
        self._lora = name

    def unload_lora(self, name: str) -> None:
        if self._peft is not None:
            self._peft.delete_adapter(name)

    def mixed_lora_forward(self, adapters: list[str | None], **kwargs):
        """One forward of the model where row ``i`` runs with the loaded adapter ``adapters[i]``
        (None: the base weights): peft's mixed-adapter batch — the base weights once for every row,
        each adapter's low-rank update on its own rows. Whatever ``set_lora`` chose stays chosen."""
        if self._peft is None:
            if any(a is not None for a in adapters):
                raise KeyError(f"{self.name}: no adapter is loaded")
            return self.hf(**kwargs)
        self._peft.base_model.enable_adapter_layers()  # peft runs no adapter at all while they are disabled
        try:
            return self._peft(adapter_names=[a if a is not None else "__base__" for a in adapters], **kwargs)
        finally:
            if self._lora is None:
                self._peft.base_model.disable_adapter_layers()

    def new_session(self) -> TorchSession:
        return TorchSession(self)

    def parameters(self) -> int:
        return sum(p.numel() for p in self.hf.parameters())
