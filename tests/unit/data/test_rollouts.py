"""Rollout generation: the engine (unit, tiny target) and the Ray Data job on the local stack
(end to end into S3, exactly-once resume after an injected failure, bad input, fail-fast)."""

from __future__ import annotations






from pathlib import Path


import pytest

from dspark.io import storage


from dspark.data import schema

from dspark.data.prompts import load_prompts, prompt_id_of

from pipelines.generate import RolloutConfig, make_plan

from dspark.data.rollout_engine import RolloutEngine, SamplingConfig, row_seed

from dspark.io.storage.rollout_store import commit_chunk, prepare_output, read_commits, read_rollouts
from tests.job_files import write_jsonl



@pytest.fixture(scope="module")
def tiny():
    from dspark.models.target import load_target

    return load_target("tiny")



def engine_row(turns: list[str], system: str = "") -> dict:
    return {"prompt_id": prompt_id_of(system, turns), "source": "t", "domain": "", "split": "train",
            "system": system, "turns": turns, "chunk": 0}



def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) spans where mask == 1."""
    runs, start = [], None
    for i, bit in enumerate(mask + [0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    return runs



def check_row(row: dict, target, max_new: int) -> None:
    """The invariants of dspark/data/schema.py for one rollout row."""
    ids, mask, stops = row["input_ids"], row["loss_mask"], set(target.eos_token_ids)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    assert row["num_generated_tokens"] == sum(mask) and row["num_prompt_tokens"] == len(ids) - sum(mask)
    has_system = row["messages"][0]["role"] == "system"
    roles = [m["role"] for m in row["messages"][int(has_system):]]
    assert roles == ["user", "assistant"] * row["num_turns"]
    answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    runs = mask_runs(mask)
    assert len(runs) == row["num_turns"] == len(row["turn_finish_reasons"])  # one generated span per turn
    for (start, end), answer, finish in zip(runs, answers, row["turn_finish_reasons"]):
        span = ids[start:end]
        stopped = span[-1] in stops
        assert finish == ("stop" if stopped else "length")
        assert stopped or len(span) <= max_new
        assert target.tokenizer.decode(span[:-1] if stopped else span, skip_special_tokens=False) == answer
    # everything before the first answer is exactly the chat-templated first prompt
    assert ids[:runs[0][0]] == target.chat_ids(row["messages"][:int(has_system) + 1])



BACKENDS = pytest.mark.parametrize("backend", ["engine", "transformers"])  # RolloutEngine's two generators



@BACKENDS
def test_engine_masks_exactly_the_generated_tokens_multi_turn(tiny, backend):
    engine = RolloutEngine(tiny, SamplingConfig(temperature=0.8, max_new_tokens=12, seed=3), backend=backend)
    rows = [engine_row(["what is 2 + 3"]), engine_row(["def f(x): return", "and again", "once more"], "be short")]
    results = engine.run(rows)
    assert [r["error_reason"] for r in results] == [None, None]
    assert [r["num_turns"] for r in results] == [1, 3]
    for r in results:
        check_row(r, tiny, 12)
    users = [m["content"] for m in results[1]["messages"] if m["role"] == "user"]
    assert users == rows[1]["turns"] and results[1]["messages"][0] == {"role": "system", "content": "be short"}
    # the template tokens between answers contain the next user turn
    runs = mask_runs(results[1]["loss_mask"])
    between = tiny.tokenizer.decode(results[1]["input_ids"][runs[0][1]:runs[1][0]])
    assert "and again" in between and between.rstrip().endswith("assistant")



@BACKENDS
def test_engine_is_deterministic_per_prompt_whatever_the_batch(tiny, backend):
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=6, seed=7)
    engine = RolloutEngine(tiny, sampling, backend=backend)
    rows = [engine_row([f"question number {i} " * (1 + 2 * i)]) for i in range(3)]
    together = engine.run(rows)
    alone = [engine.run([r])[0] for r in reversed(rows)][::-1]
    assert [r["input_ids"] for r in together] == [r["input_ids"] for r in alone]
    other_seed = RolloutEngine(tiny, sampling.model_copy(update={"seed": 8}), backend=backend).run(rows)
    assert [r["input_ids"] for r in other_seed] != [r["input_ids"] for r in together]
    assert row_seed(7, rows[0]["prompt_id"], 0) != row_seed(7, rows[0]["prompt_id"], 1)



@BACKENDS
def test_engine_greedy_matches_plain_greedy_generate(tiny, backend):
    engine = RolloutEngine(tiny, SamplingConfig(temperature=0.0, max_new_tokens=10), backend=backend)
    row = engine.run([engine_row(["sum the list"])])[0]
    prompt = row["input_ids"][:row["num_prompt_tokens"]]
    assert tiny.generate([prompt], max_new_tokens=10, temperature=0.0) == [row["input_ids"][len(prompt):]]



@BACKENDS
def test_engine_reports_prompts_longer_than_the_context(tiny, backend):
    engine = RolloutEngine(tiny, SamplingConfig(max_new_tokens=8), max_context_tokens=40, backend=backend)
    results = engine.run([engine_row(["short"]), engine_row(["the a of " * 40]),
                          engine_row(["short two", "second turn " * 20])])
    assert [r["error_reason"] for r in results] == [None, "prompt_too_long", "prompt_too_long"]
    assert "turn 1" in results[2]["error_detail"] and "max_context_tokens" in results[1]["error_detail"]
    assert len(results[0]["input_ids"]) <= 40  # the budget shrinks to fit the context



def test_stream_rollouts_cycles_prompts_with_fresh_seeds_until_stopped(tiny):
    """The timed rollout stream (the GPU recipe's): prompts cycle with fresh seeds, answers are masked as
    generated, and answers cut by `stop` are kept as "stopped" prefixes."""
    from dspark.data.prompts import Prompt
    from dspark.data.rollout_engine import stream_rollouts

    prompts = [Prompt(f"p{i}", "t", "", "train", "", [f"question {i} " * (1 + i)]) for i in range(3)]
    steps = []
    rows = list(stream_rollouts(tiny, prompts, SamplingConfig(temperature=1.0, max_new_tokens=12, seed=3),
                                stop=lambda: steps.append(1) or len(steps) > 40))
    cycles = {r["prompt_id"].split("#")[1] for r in rows}
    assert {"c0", "c1"} <= cycles and {r["prompt_id"].split("#")[0] for r in rows} == {"p0", "p1", "p2"}
    for r in rows:
        assert sum(r["loss_mask"]) == r["num_generated_tokens"] == len(r["input_ids"]) - r["loss_mask"].index(1)
    assert rows[-1]["finish_reason"] == "stopped" or len(steps) <= 41


def _cfg(output: str, sources: list[dict], **extra) -> RolloutConfig:
    return RolloutConfig.model_validate({"target": "tiny", "sources": sources, "output": output, **extra})



def test_commit_markers_decide_what_is_done(tmp_path):
    src = tmp_path / "p.jsonl"
    write_jsonl([{"turns": [f"q{i}"]} for i in range(5)], str(src))
    cfg = _cfg(str(tmp_path / "out"), [{"uri": str(src)}], chunk_size=2)
    plan = make_plan(cfg, load_prompts(cfg.sources))
    assert [len(c) for c in plan.chunks] == [2, 2, 1]
    prepare_output(cfg.output, plan, overwrite=False)
    prepare_output(cfg.output, plan, overwrite=False)  # same plan: fine
    result = {**{k: None for k in schema.RESULT_SCHEMA.names}, "prompt_id": "x" * 32, "source": "p", "domain": "",
              "split": "train", "messages": [], "input_ids": [1], "loss_mask": [1], "num_prompt_tokens": 0,
              "num_generated_tokens": 1, "num_turns": 1, "finish_reason": "stop", "turn_finish_reasons": ["stop"],
              "target": "tiny", "target_revision": "", "sampling": "{}", "chunk": 0, "location": "p:1"}
    commit_chunk(cfg.output, 0, [result])
    storage.write_text(str(tmp_path / "out" / "_commits" / "part-00001.json"), '{"chunk": 1, "rows"')  # torn write
    assert list(read_commits(cfg.output)) == [0]
    assert read_rollouts(cfg.output).num_rows == 1
    changed = cfg.model_copy(update={"sampling": SamplingConfig(seed=1)})
    with pytest.raises(ValueError, match="different plan"):
        prepare_output(cfg.output, make_plan(changed, load_prompts(cfg.sources)), overwrite=False)
    prepare_output(cfg.output, make_plan(changed, load_prompts(cfg.sources)), overwrite=True)
    assert read_commits(cfg.output) == {}



def test_rollout_plots_show_lengths_per_domain_and_finish_reasons(tmp_path, monkeypatch):
    """jobs.generate logs these to MLflow (plots/): prompt and answer length histograms, finish reasons."""
    import pyarrow as pa

    import jobs.generate as generate

    rows = [{"domain": d, "num_prompt_tokens": 10 + i, "num_generated_tokens": 5 * i,
             "finish_reason": "stop" if i % 3 else "length"} for i, d in enumerate(["math", "code", "chat"] * 4)]
    monkeypatch.setattr(generate, "read_rollouts", lambda uri: pa.Table.from_pylist(rows))
    paths = generate.rollout_plots("unused", tmp_path)
    assert [Path(p).name for p in paths] == ["prompt_lengths.png", "answer_lengths.png", "finish_reasons.png"]
    assert all(Path(p).stat().st_size > 1000 for p in paths)


def test_corrupt_rollout_shards_fail_in_the_driver_naming_the_shard(tmp_path):
    """A truncated shard, a shard its commit marker names but that is gone, and a shard with fewer rows
    than its marker counted: each is one ConfigError naming the shard, raised by the check jobs.train runs
    before it starts Ray Train."""
    import pyarrow.parquet as pq

    from dspark.config import ConfigError
    from dspark.io.storage.rollout_store import check_rollouts

    out = str(tmp_path / "out")
    result = {**{k: None for k in schema.RESULT_SCHEMA.names}, "source": "p", "domain": "", "split": "train",
              "messages": [], "input_ids": list(range(40)), "loss_mask": [1] * 40, "num_prompt_tokens": 0,
              "num_generated_tokens": 40, "num_turns": 1, "finish_reason": "stop", "turn_finish_reasons": ["stop"],
              "target": "tiny", "target_revision": "", "sampling": "{}", "location": "p:1"}
    for chunk in range(3):
        commit_chunk(out, chunk, [{**result, "prompt_id": f"{chunk}{i}".ljust(32, "x"), "chunk": chunk}
                                  for i in range(5)])
    files, rows = check_rollouts(out, "train")
    assert rows == 15 and len(files) == 3
    shard = tmp_path / "out" / "data" / f"{schema.shard_name(1)}.parquet"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])  # a write cut short
    with pytest.raises(ConfigError, match=f"{shard.name}.*corrupt or truncated.*rerun jobs.generate"):
        check_rollouts(out, "train")
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{shard.name}.*missing although its commit marker names it"):
        check_rollouts(out, "train")
    pq.write_table(pq.read_table(tmp_path / "out" / "data" / f"{schema.shard_name(0)}.parquet").slice(0, 2), shard)
    with pytest.raises(ConfigError, match=f"{shard.name}.*holds 2 rows but its commit marker counted 5"):
        check_rollouts(out, "train")
