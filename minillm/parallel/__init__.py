"""Sharding on torch.distributed (chapters 03 and 09): TP, PP, EP, ring attention, Ulysses."""
