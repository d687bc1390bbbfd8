"""An axolotl plugin the axolotl process loads (its own environment; ``methods.training.axolotl.PLUGINS``
is this folder, on that process's path): a LoRA's starting weights drawn from the recipe's ``seed``.

The LoRA is drawn before the Trainer seeds (axolotl's loader for SFT, TRL's ``DPOTrainer`` for ``rl:
dpo``), from whatever state the random generator is in by then: two runs of one config started from
uncorrelated A matrices (r = 0.005 on SmolLM2-135M's DPO run, 0.003 on stories260K's SFT), and so
trained different weights. :func:`methods.training.axolotl.render` lists this plugin in every LoRA run.
After the trainer is built, it redraws every LoRA layer's starting weights (PEFT's own
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
