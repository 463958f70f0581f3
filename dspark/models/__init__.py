"""Models: the frozen target adapter (any Hugging Face causal LM), built-in targets that need no hub (and tiny
random Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 ones), a target sharded across the workers of a
node, an MoE target's parameters per token, precision chosen by the hardware, and CPU helpers (OpenMP pool,
small-batch linears)."""
