"""The model: GGUF files, tokenizer, and the CPU runner (kernels in engine/kernels, GPU in engine/gpu)."""
