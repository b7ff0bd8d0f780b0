"""Post-training at small scale (appendix A1): SFT, LoRA, reward model, RLHF, DPO, RLAIF."""
