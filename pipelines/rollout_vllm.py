"""backend: vllm — rollouts through Ray Data's own LLM batch processor (`ray.data.llm`, vLLM engine).

For GPU clusters whose users already trust vLLM at scale. UNTESTED in this project: there is no GPU
in CI and no vLLM on the project's GPU machine; tests/test_rollout_vllm.py checks the config
translation and the row plumbing with the processor mocked.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from dspark.config import StrictModel


class VllmConfig(StrictModel):
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra vLLM engine arguments (e.g. tensor_parallel_size, "
        "gpu_memory_utilization, enable_prefix_caching); they override the ones derived from the config.")
    batch_size: int = Field(64, description="Rows per batch sent to a vLLM engine actor.")
    accelerator_type: str | None = Field(None, description="Ray accelerator type for the engine actors (e.g. H100).")
    max_model_len: int | None = Field(None, description="vLLM max_model_len; default max_context_tokens (if set).")
