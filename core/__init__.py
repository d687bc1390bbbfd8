"""The pipeline's plumbing: the stage contract, the artifact store, progress reporting, code
hashing for cache keys, secret redaction, and where the repository is. Nothing here can change
what a stage writes, so none of it enters a stage's code version."""
