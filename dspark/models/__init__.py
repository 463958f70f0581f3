"""Models: the frozen target adapter (any Hugging Face causal LM), built-in targets that need no hub,
precision chosen by the hardware, and CPU helpers (OpenMP pool, small-batch linears)."""
