"""An axolotl plugin the axolotl process loads (its own environment; ``methods.training.axolotl.PLUGINS``
is this folder, on that process's path): a LoRA's starting weights drawn from the recipe's ``seed``.

axolotl's preference runs (``rl: dpo``) hand the LoRA to TRL's ``DPOTrainer``, which wraps the model in
it before the Trainer seeds, from whatever state the random generator is in by then: two runs of one
config started from different A matrices (correlation 0.005 on SmolLM2-135M), and so trained different
weights. After the trainer is built, this redraws every LoRA layer's starting weights (PEFT's own
``reset_lora_parameters``, with the adapter's ``init_lora_weights``) from ``torch.manual_seed(seed)``,
before the first step; a run resumed from a checkpoint loads the checkpoint's weights over them."""

from __future__ import annotations

import torch
from axolotl.integrations.base import BasePlugin


class SeedLoRA(BasePlugin):
    def post_trainer_create(self, cfg, trainer) -> None:
        model = trainer.model
        configs = getattr(model, "peft_config", None)
        if not configs:
            return
        torch.manual_seed(int(cfg.seed or 0))
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A"):
                    for name in list(module.lora_A.keys()):
                        module.reset_lora_parameters(name, configs[name].init_lora_weights)
