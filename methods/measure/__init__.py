"""Measurements stages take: ``lm`` (response-token loss and perplexity, agreement, expected and
runtime acceptance) and ``weights`` (bytes on disk, sparsity of saved tensors)."""
