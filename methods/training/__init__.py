"""Training for stages P, 1E, 1A and 3-5: recipes (:mod:`.recipe`), the chat format every tier is
trained and evaluated in (:mod:`.chat`), axolotl as the engine (:mod:`.axolotl`), and the
measurements training stages log (:mod:`methods.measure.lm`)."""
