"""What the compression and export stages (2A-2F, X) share: llm-compressor's ``oneshot`` with
stage-0 calibration data, tensor-level sparsity and size measurements, llama.cpp quantization and
the GGUF token-agreement gate."""
