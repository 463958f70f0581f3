"""The learning curve's rollout plan: pass order, id suffixes, and `first_pass` (fresh answers for a drafter
trained on a folder that stopped earlier) without changing the fingerprint of folders made before it."""
from __future__ import annotations

from dspark.data.prompts import Prompt
from recipes.learning_curve.rollouts import _fingerprint, rollout_plan

SETTINGS = {"target": "tiny", "sampling": {"temperature": 1.0}}


def prompts(n: int) -> list:
    return [Prompt(prompt_id=f"q{i}", source="test", domain="math", split="train", system="", turns=[f"question {i}"])
            for i in range(n)]


def ids(plan) -> list[str]:
    return [p.prompt_id for chunk in plan.chunks for p in chunk]


def test_passes_in_order_every_prompt_once_per_pass():
    plan = rollout_plan(prompts(5), passes=3, chunk_prompts=2, settings=SETTINGS)
    suffixes = [i.rsplit("~", 1)[1] for i in ids(plan)]
    assert suffixes == ["p0"] * 5 + ["p1"] * 5 + ["p2"] * 5
    assert len(plan.chunks) == 3 * 3  # 5 prompts in chunks of 2 -> 3 chunks per pass


def test_first_pass_skips_the_earlier_passes_and_has_its_own_fingerprint():
    full = rollout_plan(prompts(5), passes=4, chunk_prompts=2, settings=SETTINGS)
    fresh = rollout_plan(prompts(5), passes=4, chunk_prompts=2, settings=SETTINGS, first_pass=2)
    assert ids(fresh) == [i for i in ids(full) if i.endswith(("~p2", "~p3"))]  # same order, same ids
    assert fresh.fingerprint != full.fingerprint  # a folder never mixes the two plans


def test_fingerprint_without_first_pass_is_the_one_older_folders_have():
    plan = rollout_plan(prompts(3), passes=2, chunk_prompts=2, settings=SETTINGS)
    shuffled_ids = [i.rsplit("~", 1)[0] for i in ids(plan)[:3]]  # pass 0, in the plan's shuffled order
    assert plan.fingerprint == _fingerprint({"ids": shuffled_ids, "passes": 2, "chunk": 2, **SETTINGS})
