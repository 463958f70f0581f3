"""The committed CPU drafter (benchmarks/results/learning_curve/drafter-cpu-mix2) is what the README's
figures come from: it stays small, in bf16 with the 8k draft vocabulary, loads by path against its
target, decodes through the serving engine (chain and tree 2) exactly as the target does greedily while
accepting drafts, and exports by path."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dspark.decoding.engine import Engine, EngineConfig
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.scheduler import SchedulerConfig
from dspark.drafters import load_drafter
from dspark.export import export_ref
from dspark.models.target import load_target

pytestmark = pytest.mark.heavy  # `make test` runs these; `make test-fast` skips them (README, Testing)

DRAFTER = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "learning_curve" / "drafter-cpu-mix2"
PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?")


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m")


def test_the_committed_drafter_is_small_bf16_with_the_8k_vocabulary():
    weights = DRAFTER / "model.safetensors"
    assert weights.stat().st_size < 20 * 2**20
    config = json.loads((DRAFTER / "config.json").read_text())
    assert config["drafter_config"]["draft_vocab_size"] == 8192 and config["target_meta"]["name"] == "smollm2-135m"
    with safe_open(str(weights), "pt") as f:
        floats = [f.get_slice(k).get_dtype() for k in f.keys()]
    assert set(floats) - {"I64", "I32", "BOOL"} == {"BF16"}  # integer and mask buffers aside


@pytest.mark.parametrize("draft_tree", [None, [2]])
def test_it_decodes_through_the_engine_as_the_target_does(smollm2, draft_tree):
    drafter = load_drafter(str(DRAFTER), smollm2, dtype=torch.float32)
    ids = smollm2.chat_ids([{"role": "user", "content": PROMPT}])
    greedy = SamplingParams(temperature=0.0)
    outputs, accepted = [], None
    for with_drafter in (False, True):
        cfg = EngineConfig(scheduler=SchedulerConfig(mode="fixed" if with_drafter else "off"), gamma=3,
                           max_batch=1, draft_tree=draft_tree if with_drafter else None, sps_table={1: 20.0, 8: 18.0})
        engine = Engine(smollm2, drafter if with_drafter else None, cfg)
        [req] = engine.generate([ids], greedy, max_new_tokens=32, stop_ids=[])
        outputs.append(req.tokens)
        accepted = engine.stats()["totals"]["accepted"]
    print(f"\n[committed drafter] tree {draft_tree}: {accepted} of 32 tokens drafted")
    assert outputs[1] == outputs[0]
    assert accepted >= 6  # drafts made 9 (chain) and 10 (tree 2) of the 32 tokens when this was written


def test_it_exports_by_path(tmp_path):
    out = export_ref(str(DRAFTER), str(tmp_path / "vllm"), "vllm", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert json.loads((Path(out) / "config.json").read_text())["dspark_export"]["algo"] == "dspark"
