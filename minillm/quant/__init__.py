"""Weight quantization (appendix A1): int8, int4, GPTQ, AWQ, HQQ and GGUF block formats."""
