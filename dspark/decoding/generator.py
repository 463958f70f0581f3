"""Continuous-batching target-only generation for offline jobs (rollouts, benchmarks).

The target's decoding core over preallocated KV slots (dspark.decoding.static_core `CoreSlots`: the
static-shape step, compiled or eager; decoding steps bucketed by batch size), or with
`decode_core: dynamic` the ragged KV store and forward the serving engine uses (dspark.decoding.batched_cache).
`BatchGenerator.generate(prompts, ...)` keeps up to `max_batch` sequences decoding together:
  1. admission: waiting prompts, sorted by length (length buckets: sequences admitted together
     have similar lengths, so the padded attention grid wastes little), take free slots at once,
     up to `max_prefill_tokens` prompt tokens per step, and are prefilled in one ragged forward;
  2. decode: one ragged forward appends one token to every active sequence;
  3. a sequence that hits a stop token or its token budget leaves right away; its slot is reused by
     the next waiting prompt at the next step, so one long answer never holds a batch.

Sampling is per sequence and independent of the batch: sequence i draws its uniforms from its own
CPU `torch.Generator(seed_i)` and its token by inverse CDF of `to_probs(logits)` (dspark.decoding.sampling).
The forward for sequence i computes the same logits as a batch-1 forward with a KV cache (each row
attends to its own slot only), so each sequence is distributed exactly as target-only sampling
(tests/test_generator.py: χ² at temperature 1, greedy equals HF greedy).

Invariant between steps, for active sequence s in slot s: KV length == len(prompt) + len(tokens) - 1
(everything but the last sampled token, which the next decode step feeds in).

`BatchGenerator.stream(requests, ...)` is the same loop over an open-ended iterator of `Request`s
(e.g. prompts cycled with fresh seeds), yielding each sequence as it finishes; `stop()` is asked before
every step (a deadline, a token goal): when it says yes, the sequences still decoding are yielded with
finish reason "stopped" (their tokens so far are a valid prefix of a target sample) and the stream ends.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from pydantic import Field, field_validator

from dspark.config import StrictModel
from dspark.decoding.kv_sequence import open_slots
from dspark.decoding.sampling import SamplingParams, inverse_cdf, to_probs
from dspark.decoding.static_core import DecodeCoreMode
from dspark.decoding.specdec import _keep


@dataclass
class Request:
    """One prompt to answer: `key` is the caller's (returned with the answer)."""

    key: Any
    prompt: Sequence[int]
    seed: int
    max_new_tokens: int


class GeneratorConfig(StrictModel):
    max_batch: int = Field(64, description="Sequences decoded together (KV slots). On CPU 32-64 saturates "
                                           "the matmuls of a ~100M model; on a GPU use 256 or more.")
    max_prefill_tokens: int = Field(4096, description="Prompt tokens prefilled per step (one prompt is "
                                                      "always admitted, however long).")
    bucket_by_length: bool = Field(True, description="Admit prompts shortest first so that sequences "
                                                     "decoding together have similar lengths.")
    decode_core: DecodeCoreMode | None = Field(
        None, description="the KV path: the static decoding core compiled or eager (auto: compiled on CUDA, eager "
                          "on a CPU), or dynamic (the ragged store); None = DSPARK_DECODE_CORE or auto")

    @field_validator("max_batch", "max_prefill_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v


@dataclass(eq=False)
class _Seq:
    """One prompt being generated (internal)."""

    index: Any  # the caller's key (position in its list, or a Request key)
    prompt: list[int]
    max_new_tokens: int
    rng: torch.Generator
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"


@dataclass
class GeneratorStats:
    steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    max_active: int = 0

    @property
    def busy_s(self) -> float:
        return self.prefill_s + self.decode_s


class BatchGenerator:
    """Continuous batching over one target (see the module doc). Not thread-safe; one call at a time."""

    def __init__(self, target, cfg: GeneratorConfig | None = None):
        self.target, self.cfg = target, cfg or GeneratorConfig()
        self.kv = open_slots(target, self.cfg.max_batch, self.cfg.decode_core)
        self.stats = GeneratorStats()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int],
                 max_new_tokens: int | Sequence[int], stop_ids: Sequence[int] | None = None
                 ) -> list[tuple[list[int], str]]:
        """(new tokens, finish reason) per prompt, in input order; the stop token is kept."""
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if not len(prompts) == len(seeds) == len(budgets):
            raise ValueError(f"got {len(prompts)} prompts, {len(seeds)} seeds and {len(budgets)} token budgets")
        for i, (p, b) in enumerate(zip(prompts, budgets)):
            if not p or b < 1:
                raise ValueError(f"prompt {i}: needs >= 1 prompt token and max_new_tokens >= 1 (got {len(p)}, {b})")
        seqs = [_Seq(i, [int(t) for t in p], int(b), torch.Generator().manual_seed(int(s)))
                for i, (p, b, s) in enumerate(zip(prompts, budgets, seeds))]
        order = sorted(seqs, key=lambda s: len(s.prompt)) if self.cfg.bucket_by_length else seqs
        for _ in self._loop(iter(order), sampling, stop_ids, None):
            pass
        return [(s.tokens, s.finish_reason) for s in seqs]

    @torch.no_grad()
    def stream(self, requests: Iterable[Request], sampling: SamplingParams, stop_ids: Sequence[int] | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[tuple[Request, list[int], str]]:
        """(request, new tokens, finish reason) as sequences finish; requests are admitted in the given
        order as slots free up (the caller orders them, e.g. by length); `stop()` is checked every step."""
        def seqs():
            for r in requests:
                if not r.prompt or r.max_new_tokens < 1:
                    raise ValueError(f"request {r.key!r}: needs >= 1 prompt token and max_new_tokens >= 1")
                yield _Seq(r, [int(t) for t in r.prompt], int(r.max_new_tokens), torch.Generator().manual_seed(int(r.seed)))
        for seq in self._loop(seqs(), sampling, stop_ids, stop):
            yield seq.index, seq.tokens, seq.finish_reason

    def _loop(self, source: Iterator[_Seq], sampling: SamplingParams, stop_ids, stop) -> Iterator[_Seq]:
        """Admit / prefill / decode / retire until `source` is empty and nothing is active, or `stop()`."""
        stops = set(self.target.eos_token_ids if stop_ids is None else stop_ids)
        waiting, active = deque(), []
        while True:
            if stop is not None and stop():
                for seq in active:
                    seq.finish_reason = "stopped"
                yield from self._retire(active)
                return
            while len(waiting) < self.cfg.max_batch:  # look ahead no further than one batch
                nxt = next(source, None)
                if nxt is None:
                    break
                waiting.append(nxt)
            if not waiting and not active:
                return
            newcomers = self._admit(waiting, active)
            t0 = time.perf_counter()
            if newcomers:
                self._prefill(newcomers, sampling, stops)
                yield from self._retire(active)
            t1 = time.perf_counter()
            if active:
                self._decode(active, sampling, stops)
                yield from self._retire(active)
                self.stats.decode_steps += 1
            self.stats.steps += 1
            self.stats.prefill_s += t1 - t0
            self.stats.decode_s += time.perf_counter() - t1

    # ---- one step ------------------------------------------------------------------------------
    def _admit(self, waiting: deque, active: list) -> list[_Seq]:
        newcomers, budget = [], self.cfg.max_prefill_tokens
        while waiting and len(active) < self.cfg.max_batch:
            if newcomers and len(waiting[0].prompt) > budget:
                break
            seq = waiting.popleft()
            budget -= len(seq.prompt)
            slot = self.kv.allocate()
            assert slot == len(active), "slots mirror the active list"
            active.append(seq)
            newcomers.append(seq)
        self.stats.max_active = max(self.stats.max_active, len(active))
        return newcomers

    def _prefill(self, newcomers: list[_Seq], sampling: SamplingParams, stops: set[int]) -> None:
        """Newcomers occupy the last slots: one ragged forward over their prompts, first token each."""
        logits = self.kv.prefill(self.kv.used - len(newcomers), [s.prompt for s in newcomers])
        self.stats.prefill_tokens += sum(len(s.prompt) for s in newcomers)
        self._sample_and_emit(newcomers, logits, sampling, stops)

    def _decode(self, active: list[_Seq], sampling: SamplingParams, stops: set[int]) -> None:
        """Feed every active sequence its last token (the only one not yet in its KV slot)."""
        self._sample_and_emit(active, self.kv.decode([s.tokens[-1] for s in active]), sampling, stops)

    def _sample_and_emit(self, seqs: list[_Seq], logits: torch.Tensor, sampling: SamplingParams,
                         stops: set[int]) -> None:
        """logits [R, V] of the next token of each sequence -> one sampled token each."""
        probs = to_probs(logits, sampling)
        # one uniform per sequence from its own generator: the draw never depends on the batch
        u = torch.cat([torch.rand(1, 1, generator=s.rng, dtype=torch.float64) for s in seqs])
        tokens = inverse_cdf(probs, u.to(probs.device)).tolist()
        for seq, token in zip(seqs, tokens):
            kept, finish = _keep([token], len(seq.tokens), seq.max_new_tokens, stops)
            seq.tokens += kept
            seq.finish_reason = finish
        self.stats.generated_tokens += len(tokens)

    def _retire(self, active: list[_Seq]) -> list[_Seq]:
        """Drop finished sequences (-> them); slots stay contiguous (the last slot moves into the hole)."""
        done = []
        for slot in range(len(active) - 1, -1, -1):
            if active[slot].finish_reason is None:
                continue
            done.append(active[slot])
            moved = self.kv.release(slot)
            last = active.pop()
            if moved is not None:
                active[slot] = last
        return done
