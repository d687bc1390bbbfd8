"""The decoding core (floor 2): the decoder of every mode (``ar``, ``sd``, ``pyramid``, ``lookup``;
:mod:`.speculative`, with :class:`~.speculative.DecodeConfig`, the one declaration of the decoding
settings), the distributions it verifies with (:mod:`.distributions`), the n-gram proposers
(:mod:`.ngrams`) and continuous batching of many requests over one set of models
(:mod:`.batching`). It imports the backends and the bundle's integrity errors, nothing above."""
