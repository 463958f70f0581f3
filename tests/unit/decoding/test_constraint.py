"""Structured output (dspark/decoding/constraint.py) through the engine: exact for the constrained distribution
with speculative decoding (χ² against the exact masked joint, drafts unconstrained), target-only batched steps
masked too, and a JSON schema (llguidance) decoded greedily equals the constrained target-only decoding."""
import json

import numpy as np
import pytest
import torch

from dspark.decoding.constraint import TokenConstraint, response_format_constraint
from dspark.decoding.engine import Engine, EngineConfig
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.scheduler import SchedulerConfig
from dspark.drafters import DrafterConfig, build_drafter
from tests.lossless_stats import three_token_pvalues

VOCAB, PROMPT = 8, [1, 2, 3]


class NoRepeatMatcher:
    """A stand-in for llguidance's LLMatcher (same calls): token 0 is never allowed, nor the token just
    consumed. Small enough to enumerate the constrained joint exactly."""

    def __init__(self, vocab: int):
        self.vocab, self.consumed = vocab, []

    @staticmethod
    def mask(vocab: int, prefix: list[int]) -> torch.Tensor:
        allowed = torch.ones(vocab, dtype=torch.bool)
        allowed[0] = False
        if prefix:
            allowed[prefix[-1]] = False
        return allowed

    def compute_bitmask(self) -> bytes:
        return np.packbits(self.mask(self.vocab, self.consumed).numpy(), bitorder="little").tobytes()

    def consume_token(self, token: int) -> bool:
        if not self.mask(self.vocab, self.consumed)[token]:
            return False
        self.consumed.append(token)
        return True

    def rollback(self, n: int) -> bool:
        del self.consumed[len(self.consumed) - n:]
        return True

    def is_stopped(self) -> bool:
        return False


def _drafter(target, gamma=3):
    torch.manual_seed(0)
    cfg = DrafterConfig(algo="dspark", block_size=gamma, num_layers=1, num_context_layers=2, rank=8, init_std=0.2)
    return build_drafter(cfg, target)


@pytest.mark.parametrize("drafting", [True, False], ids=["speculative", "target_only"])
def test_constrained_decoding_is_exact_for_the_masked_distribution(micro_target, drafting):
    """Every sample follows the grammar and the joint of tokens (1,2), (2,3) is the target's restricted to
    it; with a drafter, its drafts are not constrained (the verify rows are), so forbidden drafts are
    rejected and replaced from the residual."""
    runs, sp = 2000 if drafting else 1200, SamplingParams(temperature=1.0)
    drafter = _drafter(micro_target) if drafting else None
    engine = Engine(micro_target, drafter, EngineConfig(
        scheduler=SchedulerConfig(mode="fixed" if drafting else "off"), max_batch=64, max_waiting=runs))
    reqs = [engine.submit(PROMPT, sp, 3, stop_ids=[], constraint=TokenConstraint(
        NoRepeatMatcher(VOCAB), VOCAB, micro_target.device)) for _ in range(runs)]
    engine.generate([], sp)
    outputs = [r.tokens for r in reqs]
    assert all(len(t) == 3 and 0 not in t and t[0] != t[1] != t[2] for t in outputs)
    p12, p23 = three_token_pvalues(outputs, micro_target, PROMPT, sp, VOCAB,
                                   allowed=lambda prefix: NoRepeatMatcher.mask(VOCAB, prefix))
    assert min(p12, p23) > 1e-3, (p12, p23)
    if drafting:
        totals = engine.stats()["totals"]
        assert totals["accepted"] > 0 and totals["accepted"] < totals["verified"]  # drafts both kept and refused


def test_masks_along_drafts_leave_the_grammar_where_it_was(micro_target):
    c = TokenConstraint(NoRepeatMatcher(VOCAB), VOCAB, "cpu")
    c.commit([3])
    masks = c.masks_along([5, 5, 2])  # the second 5 repeats: refused, so rows past it repeat its mask
    assert masks.shape == (4, VOCAB) and not masks[0, 3] and not masks[1, 5] and masks[1, 3]
    assert torch.equal(masks[2], masks[1]) and torch.equal(masks[3], masks[1])
    assert c.matcher.consumed == [3]


SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}, "unit": {"enum": ["m", "s"]}},
          "required": ["answer", "unit"], "additionalProperties": False}


def test_a_json_schema_decodes_greedily_to_the_constrained_target_output():
    pytest.importorskip("llguidance")
    from dspark.models.target import load_target

    tiny = load_target("tiny")
    prompt = tiny.chat_ids([{"role": "user", "content": "how far"}])
    # the reference: target-only greedy decoding with the grammar's mask, by hand
    ref, ids = response_format_constraint(tiny, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}), []
    with torch.no_grad():
        while len(ids) < 60:
            logits = tiny.forward(torch.tensor([prompt + ids]), logits_at="last").logits[0, -1]
            token = int(logits.masked_fill(~ref.allowed(), float("-inf")).argmax())
            ids.append(token)
            ref.commit([token])
            if token in tiny.eos_token_ids:
                break
    engine = Engine(tiny, _drafter(tiny, gamma=4), EngineConfig(scheduler=SchedulerConfig(mode="fixed")))
    req = engine.submit(prompt, SamplingParams(temperature=0.0), 60, constraint=response_format_constraint(
        tiny, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}))
    engine.generate([], SamplingParams(temperature=0.0))
    assert req.tokens == ids[:len(req.tokens)] and req.finish_reason == "stop"
    value = json.loads(tiny.tokenizer.decode(req.tokens, skip_special_tokens=True))
    assert set(value) == {"answer", "unit"} and isinstance(value["answer"], bool) and value["unit"] in ("m", "s")
    assert engine.stats()["totals"]["verified"] > 0


def test_response_format_is_read_as_openai_defines_it():
    pytest.importorskip("llguidance")
    from dspark.models.target import load_target

    tiny = load_target("tiny")
    assert response_format_constraint(tiny, None) is None
    assert response_format_constraint(tiny, {"type": "text"}) is None
    assert response_format_constraint(tiny, {"type": "json_object"}).allowed().sum() == 1  # '{' only
    with pytest.raises(ValueError, match="json_schema.schema must be a JSON schema object"):
        response_format_constraint(tiny, {"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="must be 'text', 'json_object' or 'json_schema'"):
        response_format_constraint(tiny, {"type": "yaml"})
