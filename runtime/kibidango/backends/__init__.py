"""Model backends. Each gives per-sequence sessions with the same small interface
(:class:`~kibidango.backends.base.Session`): feed tokens and get one row of logits per token,
crop the KV cache back to a prefix. Decoding code never sees a framework."""

from __future__ import annotations

from kibidango.backends.base import ContextLengthError, Model, Session

__all__ = ["ContextLengthError", "Model", "Session", "load_model"]


def load_model(
    backend: str,
    tier,
    n_ctx: int | None = None,
    threads: int | None = None,
    kv_cache: str = "f16",
    compile_steps: bool = False,
) -> Model:
    """A tier's model on ``backend``; ``kv_cache`` (llama.cpp only): the K/V cache type;
    ``compile_steps`` (torch only): a static cache and a compiled single-token step."""
    if backend == "torch":
        try:
            import torch

            from kibidango.backends.torch_backend import TorchModel
        except ImportError as e:
            raise ImportError(
                f"the torch backend needs torch and transformers ({e}): pip install 'kibidango[torch]' "
                "(on a CPU machine pip install torch==2.13.0 first), or run the bundle with --backend llamacpp"
            ) from e

        if kv_cache != "f16":
            raise ValueError(f"a {kv_cache} KV cache is a llama.cpp option: use --backend llamacpp")
        if threads is not None:
            torch.set_num_threads(threads)  # process-wide: torch has one intra-op pool
        return TorchModel(tier.hf, name=tier.name, compile_steps=compile_steps)
    if backend == "llamacpp":
        from kibidango.backends.llamacpp_backend import LlamaCppModel

        return LlamaCppModel(tier.gguf, name=tier.name, n_ctx=n_ctx, threads=threads, kv_cache=kv_cache)
    raise ValueError(f"unknown backend {backend!r}: use 'torch' or 'llamacpp'")
