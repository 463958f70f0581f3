"""backend: vllm — rollouts through Ray Data's own LLM batch processor (`ray.data.llm`, vLLM engine).

For GPU clusters whose users already trust vLLM at scale. UNTESTED in this project: there is no GPU
in CI and no vLLM on the project's GPU machine; tests/test_generate_vllm.py checks the config
translation and the row plumbing with the processor mocked.
"""
from __future__ import annotations

import functools
import json
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


# ---------------------------------------------------------------- availability and config translation
def require_vllm() -> None:
    """Raise a clear error unless vllm and Ray Data's LLM processor can be imported."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise RuntimeError("rollout backend 'vllm' needs the vllm package, which is not installed here "
                           "(pip install vllm on the GPU nodes, or use backend 'engine')") from None
    try:
        from ray.data.llm import build_processor, vLLMEngineProcessorConfig  # noqa: F401
    except ImportError as err:
        raise RuntimeError(f"rollout backend 'vllm' needs Ray Data's LLM processor (pip install 'ray[llm]'): "
                           f"{err}") from None


def model_source(target: str) -> str:
    """What vLLM loads: a built-in name becomes its local directory (which must exist on every GPU
    node, e.g. a shared filesystem); an s3:// model dir is refused (vLLM cannot read it directly)."""
    if target.startswith("s3://"):
        raise ValueError(f"backend 'vllm' cannot load target {target!r} from S3: use a hub name or a model "
                         f"directory present on every GPU node")
    from dspark.models.target import resolve_model_path

    return resolve_model_path(target)


def processor_kwargs(cfg) -> dict:
    """RolloutConfig -> keyword arguments of `ray.data.llm.vLLMEngineProcessorConfig`. Tokenization and
    the chat template stay with us (the exact prompt ids and loss masks of dspark/data/schema.py), so
    the processor's own chat-template, tokenize and detokenize stages are off."""
    v = cfg.vllm
    # compute.dtype auto goes to vLLM as its own "auto": its GPU workers pick from the checkpoint and the GPU
    engine = {"dtype": cfg.compute.dtype, "seed": cfg.sampling.seed}
    max_len = v.max_model_len or cfg.max_context_tokens
    if max_len:
        engine["max_model_len"] = max_len
    engine.update(v.engine_kwargs)
    kwargs = {"model_source": model_source(cfg.target), "engine_kwargs": engine, "batch_size": v.batch_size,
              "concurrency": cfg.compute.replicas, "chat_template_stage": False, "tokenize_stage": False,
              "detokenize_stage": False}
    if v.accelerator_type:
        kwargs["accelerator_type"] = v.accelerator_type
    return kwargs


def sampling_params(sampling, max_tokens: int, seed: int, stop_ids: list[int]) -> dict:
    """SamplingConfig -> vLLM SamplingParams fields (temperature 0 is greedy in both; top_k off is -1)."""
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
            "max_tokens": max_tokens, "seed": seed, "stop_token_ids": stop_ids, "detokenize": False,
            "ignore_eos": False, "skip_special_tokens": False}


# ---------------------------------------------------------------- the conversation side (tokenizer only)
class TokenizerTarget:
    """The tokenizer side of a target (what pipelines.generate.ChatRollout needs), without weights."""

    def __init__(self, spec: str):
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from dspark.models.target import Target

        path = model_source(spec)
        self.name, self.revision = spec, ""
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 4096)
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:
            eos = None
        ids = {eos} if isinstance(eos, int) else set(eos or [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(ids)
        self.chat_template_kwargs = Target.chat_template_kwargs.fget(self)
        self._chat_ids = Target.chat_ids

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self._chat_ids(self, messages, add_generation_prompt)


@functools.lru_cache(maxsize=4)
def _chat(spec_json: str):
    """One ChatRollout per worker process and spec (tokenizer loads once)."""
    from dspark.data.rollout_engine import ChatRollout, SamplingConfig

    spec = json.loads(spec_json)
    return ChatRollout(TokenizerTarget(spec["target"]), SamplingConfig(**spec["sampling"]), spec["max_context_tokens"])


def _dump(conv, todo: bool) -> str:
    return json.dumps({"row": conv.row, "ids": conv.ids, "mask": conv.mask, "messages": conv.messages,
                       "finish": conv.finish, "error": conv.error, "todo": todo})


def _load(state: str):
    from dspark.data.rollout_engine import Conversation

    s = json.loads(state)
    return Conversation(s["row"], s["ids"], s["mask"], s["messages"], s["finish"],
                        tuple(s["error"]) if s["error"] else None), s["todo"]


# Row functions of the Ray Data chain (plain dict -> dict; unit-tested without Ray):
def start_row(spec_json: str, row: dict) -> dict:
    return {"state": _dump(_chat(spec_json).new_conversation(row), False)}


def open_row(spec_json: str, turn: int, rec: dict) -> dict:
    """Open user turn `turn` and ask vLLM for its answer. Rows with nothing to do (fewer turns, or an
    error) still pass through the processor with a 1-token dummy request whose output is ignored, so
    the chain streams without filter/union (which would recompute earlier turns)."""
    from dspark.data.rollout_engine import row_seed

    chat = _chat(spec_json)
    conv, _ = _load(rec["state"])
    todo = conv.error is None and turn < len(conv.row["turns"])
    if todo:
        chat.open_turn(conv, turn)
        todo = conv.error is None
    stops = sorted(chat.stops)
    if todo:
        seed = row_seed(chat.sampling.seed, conv.row["prompt_id"], turn)
        return {"state": _dump(conv, True), "tokenized_prompt": conv.ids,
                "sampling_params": sampling_params(chat.sampling, chat.budget(conv), seed, stops)}
    return {"state": _dump(conv, False), "tokenized_prompt": [stops[0]],
            "sampling_params": sampling_params(chat.sampling, 1, 0, stops)}


def absorb_row(spec_json: str, rec: dict) -> dict:
    """vLLM's answer (`generated_tokens`) -> the conversation (ignored for dummy requests)."""
    conv, todo = _load(rec["state"])
    if todo:
        _chat(spec_json).add_answer(conv, [int(t) for t in rec["generated_tokens"]])
    return {"state": _dump(conv, False)}


def finish_batch(spec_json: str, batch):
    """pyarrow batch of states -> RESULT_SCHEMA rows."""
    from dspark.data.rollout_engine import results_table

    chat = _chat(spec_json)
    return results_table([chat.result(_load(s)[0]) for s in batch.column("state").to_pylist()])


def chat_spec(cfg) -> str:
    return json.dumps({"target": cfg.target, "sampling": cfg.sampling.model_dump(),
                       "max_context_tokens": cfg.max_context_tokens}, sort_keys=True)


def vllm_stage(cfg, ds, max_turns: int):
    """Prompt rows -> RESULT_SCHEMA rows through one vLLM processor per turn (a T-turn dataset runs
    T processors of compute.replicas engines each: size the cluster for it)."""
    require_vllm()
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    spec = chat_spec(cfg)
    config = vLLMEngineProcessorConfig(**processor_kwargs(cfg))
    ds = ds.map(functools.partial(start_row, spec))
    for turn in range(max_turns):
        processor = build_processor(config, postprocess=functools.partial(absorb_row, spec))
        ds = processor(ds.map(functools.partial(open_row, spec, turn)))
    return ds.map_batches(functools.partial(finish_batch, spec), batch_format="pyarrow")
