"""Continuous-batching generator (dspark/decoding/generator.py) on the built-in `tiny` target: exact target
distribution at temperature 1 (χ² of the first two tokens against the exact joint), greedy equal to
HF greedy, seeded answers independent of the batch (χ² on the core eager; greedy and seeding also compiled,
greedy also on the ragged store), finished sequences making room at once, and bad input."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from dspark.decoding.generator import BatchGenerator, GeneratorConfig
from dspark.decoding.sampling import SamplingParams
from tests.lossless_stats import chi2_pvalue, exact_joint


@pytest.fixture(scope="module")
def tiny():
    from dspark.models.target import load_target

    return load_target("tiny")


def _chat(target, text: str) -> list[int]:
    return target.chat_ids([{"role": "user", "content": text}])


@pytest.mark.heavy
def test_first_two_tokens_follow_the_exact_target_joint(tiny):
    """3000 samples of one prompt, interleaved with longer 'filler' sequences of other prompts so that
    sequences join and leave mid-batch at different ages: the joint of the first two tokens matches
    P(t1, t2) computed exactly from the target."""
    sp, runs = SamplingParams(temperature=1.0), 3000
    prompt, filler = _chat(tiny, "what is 2 + 3"), _chat(tiny, "def add(a, b): return a + b and more")
    prompts, budgets = [], []
    for i in range(runs):
        prompts.append(prompt), budgets.append(2)
        if i % 10 == 0:
            prompts.append(filler), budgets.append(9)
    gen = BatchGenerator(tiny, GeneratorConfig(max_batch=16, bucket_by_length=False, decode_core="eager"))
    out = gen.generate(prompts, sp, seeds=list(range(len(prompts))), max_new_tokens=budgets, stop_ids=[])
    pairs = collections.Counter(tuple(toks) for (toks, _), p in zip(out, prompts) if p == prompt)
    assert sum(pairs.values()) == runs and all(len(k) == 2 for k in pairs)
    joint = exact_joint(tiny, prompt, 2, sp, tiny.vocab_size)
    counts = np.zeros_like(joint)
    for (a, b), n in pairs.items():
        counts[a, b] = n
    assert chi2_pvalue(counts, joint) > 1e-3
    assert gen.stats.max_active == 16 and gen.stats.generated_tokens == 2 * runs + 9 * (runs // 10)


@pytest.mark.parametrize("core", ["eager", pytest.param("compiled", marks=pytest.mark.heavy), "dynamic"])
def test_greedy_equals_hf_greedy_with_joins_and_leaves(tiny, core):
    texts = ["hi", "what is 2 + 3", "def f(x): return x * 2 and then some more words here", "list the primes",
             "a b c d e f g h i j k l m n o p", "sum the list", "why"]
    prompts = [_chat(tiny, t) for t in texts]
    gen = BatchGenerator(tiny, GeneratorConfig(max_batch=4, max_prefill_tokens=40, decode_core=core))  # 7 requests
    out = gen.generate(prompts, SamplingParams(temperature=0.0), seeds=[0] * len(prompts),
                       max_new_tokens=[12, 5, 20, 3, 16, 9, 1])
    for (tokens, finish), p, budget in zip(out, prompts, [12, 5, 20, 3, 16, 9, 1]):
        reference = tiny.generate([p], max_new_tokens=budget, temperature=0.0)[0]
        assert tokens == reference
        assert finish == ("stop" if tokens[-1] in tiny.eos_token_ids else "length")


def test_a_long_answer_does_not_hold_the_batch(tiny):
    """One 40-token answer and twelve 2-token answers, two slots: the short ones flow through the
    second slot while the long one decodes, so the run takes about 40 steps, not 7 x 40."""
    prompts = [_chat(tiny, f"question {i}") for i in range(13)]
    gen = BatchGenerator(tiny, GeneratorConfig(max_batch=2, bucket_by_length=False))
    out = gen.generate(prompts, SamplingParams(temperature=1.0), seeds=list(range(13)),
                       max_new_tokens=[40] + [2] * 12, stop_ids=[])
    assert [len(t) for t, _ in out] == [40] + [2] * 12 and {f for _, f in out} == {"length"}
    assert gen.stats.steps <= 41 and gen.kv.used == 0


@pytest.mark.parametrize("core", ["eager", pytest.param("compiled", marks=pytest.mark.heavy)])
def test_same_seed_same_answer_whatever_the_batch(tiny, core):
    prompts = [_chat(tiny, f"tell me about number {i}" * (1 + i)) for i in range(4)]
    gen = BatchGenerator(tiny, GeneratorConfig(max_batch=4, decode_core=core))
    together = gen.generate(prompts, SamplingParams(temperature=1.0), seeds=[5, 6, 7, 8], max_new_tokens=10)
    alone = [gen.generate([p], SamplingParams(temperature=1.0), seeds=[s], max_new_tokens=10)[0]
             for p, s in zip(prompts, [5, 6, 7, 8])]
    assert together == alone


def test_bad_input_is_named(tiny):
    gen = BatchGenerator(tiny)
    with pytest.raises(ValueError, match="prompt 1"):
        gen.generate([[1, 2], []], SamplingParams(), seeds=[0, 1], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 prompts, 1 seeds"):
        gen.generate([[1, 2], [3]], SamplingParams(), seeds=[0], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_batch"):
        GeneratorConfig(max_batch=0)


def test_stream_cycles_requests_and_stops_mid_batch_with_valid_prefixes(tiny):
    """An endless request stream (prompts cycled with fresh seeds) stopped by a token goal checked every
    step: finished answers equal generate() for the same seeds, stopped ones are prefixes of them."""
    import itertools

    from dspark.decoding.generator import PromptJob

    prompts = [_chat(tiny, t) for t in ("what is 2 + 3", "def f(x): return x", "list the primes")]
    sp = SamplingParams(temperature=1.0)
    requests = (PromptJob((c, i), p, seed=1000 * c + i, max_new_tokens=24)
                for c in itertools.count() for i, p in enumerate(prompts))
    gen = BatchGenerator(tiny, GeneratorConfig(max_batch=4))
    steps = []
    out = list(gen.stream(requests, sp, stop=lambda: steps.append(1) or gen.stats.generated_tokens >= 150))
    assert gen.stats.generated_tokens >= 150 and len(steps) == gen.stats.steps + 1  # asked before every step
    assert {r.key[0] for r, _, _ in out} >= {0, 1, 2}  # the prompts came round again, with new seeds
    stopped = [o for o in out if o[2] == "stopped"]
    assert 1 <= len(stopped) <= 4 and gen.kv.used == 0
    ref = BatchGenerator(tiny, GeneratorConfig(max_batch=4))
    for r, tokens, finish in out:
        (full, _), = ref.generate([r.prompt], sp, [r.seed], 24)
        assert (tokens == full) if finish != "stopped" else full[:len(tokens)] == tokens
