"""backend: vllm (pipelines/generate_vllm.py) without vLLM: the config translation checked against Ray
Data's real `vLLMEngineProcessorConfig`, the per-turn row chain with the processor mocked (its
output rows must satisfy the rollout schema), and the clear error when vllm is missing."""
from __future__ import annotations

import importlib.util

import pyarrow as pa
import pytest

from dspark.data import schema
from pipelines import generate_vllm
from pipelines.generate import RolloutConfig, run_rollouts
from tests.unit.data.test_rollouts import check_row, engine_row

SOURCES = [{"uri": "data/train/chat.jsonl"}]


def _cfg(**extra) -> RolloutConfig:
    base = {"target": "tiny", "sources": SOURCES, "output": "/tmp/unused", "backend": "vllm",
            "sampling": {"temperature": 0.0, "top_k": 0, "max_new_tokens": 6, "seed": 4}, "max_context_tokens": 256}
    return RolloutConfig.model_validate({**base, **extra})


def test_config_translates_to_ray_data_vllm_processor_config():
    cfg = _cfg(compute={"replicas": 3, "num_gpus": 1}, vllm={"batch_size": 32, "accelerator_type": "H100",
                                                              "engine_kwargs": {"tensor_parallel_size": 2,
                                                                                "seed": 9}})
    kwargs = generate_vllm.processor_kwargs(cfg)
    # compute.dtype auto (the default) is vLLM's own dtype auto, resolved on its GPU workers
    assert kwargs["engine_kwargs"] == {"dtype": "auto", "seed": 9, "max_model_len": 256, "tensor_parallel_size": 2}
    pinned = generate_vllm.processor_kwargs(_cfg(compute={"num_gpus": 1, "dtype": "float16"}))
    assert pinned["engine_kwargs"]["dtype"] == "float16"
    assert kwargs["concurrency"] == 3 and kwargs["batch_size"] == 32 and kwargs["accelerator_type"] == "H100"
    from ray.data.llm import vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(**kwargs)  # Ray's own validation of every translated field
    assert config.model_source == kwargs["model_source"] and config.batch_size == 32
    params = generate_vllm.sampling_params(cfg.sampling, 6, 11, [2])
    assert params["top_k"] == -1 and params["max_tokens"] == 6 and params["stop_token_ids"] == [2]
    with pytest.raises(ValueError, match="S3"):
        generate_vllm.processor_kwargs(_cfg(target="s3://bucket/model"))


def fake_vllm(target, rec: dict) -> dict:
    """What the vLLM stage adds to a row: greedy tokens of the real target for `tokenized_prompt`,
    up to max_tokens, stopping at (and keeping) a stop token."""
    sp = rec["sampling_params"]
    new = target.generate([rec["tokenized_prompt"]], max_new_tokens=sp["max_tokens"], temperature=0.0)[0]
    return {**rec, "generated_tokens": new, "num_generated_tokens": len(new)}


def test_turn_chain_with_a_mocked_processor_yields_schema_rows():
    """The chain vllm_stage builds (start → per turn: open → processor → absorb → finish), run row by
    row with the processor replaced by `fake_vllm`: rows match the schema and the engine path."""
    from dspark.models.target import load_target
    from dspark.data.rollout_engine import RolloutEngine

    tiny = load_target("tiny")
    cfg = _cfg()
    spec = generate_vllm.chat_spec(cfg)
    rows = [engine_row(["what is 2 + 3"]), engine_row(["def f(x): return", "and again"], "be short"),
            engine_row(["the a of " * 120])]  # too long for 256 tokens: an error row, no request
    recs = [generate_vllm.start_row(spec, r) for r in rows]
    for turn in range(2):
        opened = [generate_vllm.open_row(spec, turn, r) for r in recs]
        recs = [generate_vllm.absorb_row(spec, fake_vllm(tiny, r)) for r in opened]
    table = generate_vllm.finish_batch(spec, pa.Table.from_pylist(recs))
    assert table.schema.equals(schema.RESULT_SCHEMA)
    results = table.to_pylist()
    assert [r["error_reason"] for r in results] == [None, None, "prompt_too_long"]
    for r in results[:2]:
        check_row(r, tiny, 6)
    greedy = RolloutEngine(tiny, cfg.sampling, cfg.max_context_tokens).run(rows[:2])
    assert [r["input_ids"] for r in results[:2]] == [r["input_ids"] for r in greedy]


def test_stage_builds_one_processor_per_turn(monkeypatch):
    """vllm_stage wiring with Ray Data's processor mocked and a stand-in dataset that applies maps."""
    class Rows:
        def __init__(self, rows):
            self.rows = rows

        def map(self, fn):
            return Rows([fn(r) for r in self.rows])

        def map_batches(self, fn, batch_format):
            return fn(pa.Table.from_pylist(self.rows))

    from dspark.models.target import load_target

    tiny = load_target("tiny")
    built = []

    def build_processor(config, postprocess):
        built.append(config)
        return lambda ds: ds.map(lambda r: postprocess(fake_vllm(tiny, r)))

    import ray.data.llm

    monkeypatch.setattr(generate_vllm, "require_vllm", lambda: None)
    monkeypatch.setattr(ray.data.llm, "build_processor", build_processor)
    rows = [engine_row(["hi", "more", "again"]), engine_row(["x"])]
    table = generate_vllm.vllm_stage(_cfg(), Rows(rows), max_turns=3)
    assert len(built) == 3 and [r["num_turns"] for r in table.to_pylist()] == [3, 1]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_is_a_clear_error_before_any_work(tmp_path):
    cfg = _cfg(output=str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="needs the vllm package"):
        run_rollouts(cfg, progress=False)
    assert not (tmp_path / "out" / "_plan.json").exists()
