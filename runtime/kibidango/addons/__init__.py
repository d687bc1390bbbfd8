"""What a request may add to decoding (floor 2): the domain router (:mod:`.router`), the domain
adapters it routes to (:mod:`.adapters`: an LRU of peft / llama.cpp LoRAs) and the calibrated
confidence and escalation detector (:mod:`.confidence`); the environment a bundle's chat template
renders in (:mod:`.chat_template`). Each reads its part of a bundle; none
imports the decoding core, the bundle loader or anything above."""
