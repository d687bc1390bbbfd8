"""A training recipe: the part of an axolotl config a stage's YAML sets. The stage adds the model,
the data, the output paths and the hardware switches (:func:`methods.training.axolotl.render`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from core.contract import StageConfig

__all__ = ["LoraSpec", "PreferenceSpec", "TrainRecipe"]


class LoraSpec(StageConfig):
    r: int = Field(8, description="LoRA rank.")
    alpha: int = Field(16, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(0.0, description="LoRA dropout.")
    target_linear: bool = Field(True, description="Adapt every linear layer (axolotl lora_target_linear).")
    target_modules: list[str] = Field(
        default_factory=list, description="Explicit modules instead of every linear layer."
    )


class PreferenceSpec(StageConfig):
    """A preference fine-tune in place of plain SFT: TRL's DPO loss (the ``sigmoid`` loss, Rafailov et
    al. 2023) on (prompt, chosen, rejected) rows plus ``nll_weight`` times the negative log-likelihood of
    the chosen answer (TRL's ``sft`` loss beside it: RPO, Pang et al. 2024, arXiv 2404.19733), run by
    axolotl's ``rl: dpo`` with the reference model the trained one starts from. A row whose rejected
    answer is its chosen one has a DPO term of exactly zero gradient: it trains as an SFT row."""

    beta: float = Field(0.1, gt=0, description="DPO's beta: how far the policy may move from the reference.")
    nll_weight: float = Field(1.0, ge=0, description="Weight of the chosen answer's NLL beside the DPO loss.")
    tiers: list[str] | None = Field(
        None,
        min_length=1,
        description="1D tiers whose pairs take the student's failed answer as the rejected reply (None: every "
        "pair). `[self, self-hint]`: the on-policy pairs only, both replies the student's own as iterative RPO "
        "builds them; a pair from another tier (and a control's row) trains by the NLL term alone.",
    )


class TrainRecipe(StageConfig):
    """Hyper-parameters of one axolotl run. Units are axolotl's."""

    max_steps: int = Field(description="Optimizer steps (the run's length; epochs are not used).", gt=0)
    micro_batch_size: int = Field(8, description="Sequences per device per forward pass.", gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    sequence_len: int = Field(256, gt=8, description="Tokens per sequence; longer examples are truncated.")
    learning_rate: float = Field(
        1e-3, gt=0, description="Peak learning rate (after warm-up, before the schedule's decay)."
    )
    lr_scheduler: str = Field("cosine", description="transformers scheduler name.")
    warmup_steps: int = Field(10, ge=0, description="Steps of linear warm-up from 0 to the learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay of the optimizer.")
    optimizer: str = Field("adamw_torch", description="axolotl optimizer name (adamw_torch runs everywhere).")
    seed: int = Field(0, description="Seed of initialisation, data order and dropout.")
    logging_steps: int = Field(10, gt=0, description="Loss is logged (console and MLflow) every this many steps.")
    save_steps: int = Field(
        100, gt=0, description="Checkpoint every this many steps; an interrupted stage resumes from the last one."
    )
    adapter: Literal["full", "lora"] = Field("full", description="Full fine-tune, or a LoRA adapter.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings (adapter: lora).")
    merge_lora: bool = Field(False, description="Merge the trained LoRA into the base weights for the output model.")
    gpus: int = Field(
        1,
        ge=1,
        description="Processes on the node, one per GPU: above 1, axolotl runs under `accelerate launch "
        "--num_processes N` (data parallel); pair it with axolotl.deepspeed (ZeRO) or axolotl.fsdp_config "
        "to shard a model that one GPU cannot hold.",
    )
    axolotl: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra axolotl keys passed through unchanged (e.g. flash_attention, deepspeed, "
        "gradient_checkpointing, sample_packing on GPU nodes). Hardware switches still win.",
    )

    @property
    def sequences_seen(self) -> int:
        return self.max_steps * self.micro_batch_size * self.gradient_accumulation_steps
