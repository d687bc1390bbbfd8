"""kibidango runtime: load a bundle and generate with target-only decoding (``ar``), 2-model
speculative decoding (``sd``) or Pyramid speculative decoding (``pyramid``)."""

from kibidango.bundle import Bundle, BundleError, load_bundle, write_bundle
from kibidango.decode.speculative import DecodeConfig, Decoder, Metrics
from kibidango.pipeline import GenerationResult, Pipeline

__all__ = [
    "Bundle",
    "BundleError",
    "DecodeConfig",
    "Decoder",
    "GenerationResult",
    "Metrics",
    "Pipeline",
    "load_bundle",
    "write_bundle",
]
__version__ = "0.1.0"
