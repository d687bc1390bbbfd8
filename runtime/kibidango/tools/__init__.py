"""Tools over the Python API (floor 5): the benchmark of decoding modes side by side
(:mod:`.bench`, ``kibidango bench``) and the tuning of a bundle's decoding defaults (:mod:`.tune`,
``kibidango tune``, stage 1F)."""
