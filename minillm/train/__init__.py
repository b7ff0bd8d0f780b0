"""Post-training at small scale (appendix A1): SFT, LoRA, reward model, RLHF, DPO, RLAIF.

:mod:`.lora` (LoRA / QLoRA adapters, merge, unmerge), :mod:`.data` (the course's instruction
and preference sets), :mod:`.sft`, :mod:`.preference` (reward model, DPO), :mod:`.rl`
(REINFORCE with a KL penalty, judges, RLAIF). The figures are in :mod:`minillm.viz.a1`.
"""
from .lora import LoRALinear, add_lora, fold_lora, lora_disabled, merge_lora, unmerge_lora
from .preference import RewardModel, dpo_loss, train_dpo, train_reward_model
from .rl import rlaif_pairs, rule_judge, train_rlhf
from .sft import train_sft

__all__ = ["LoRALinear", "RewardModel", "add_lora", "dpo_loss", "fold_lora", "lora_disabled",
           "merge_lora", "rlaif_pairs", "rule_judge", "train_dpo", "train_reward_model",
           "train_rlhf", "train_sft", "unmerge_lora"]
