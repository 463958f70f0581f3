"""Continuous-batching target-only generation for offline jobs (rollouts, benchmarks): the serving engine
without a drafter (dspark.decoding.engine, scheduler mode off), stepped in the caller's thread. One request
type (`dspark.decoding.request.Request`), one admission loop and one target step (the decoding core's slots,
compiled or eager; `decode_core: dynamic` the ragged store) serve rollouts and the endpoint alike.

`BatchGenerator.generate(prompts, ...)` keeps up to `max_batch` sequences decoding together:
  1. admission (the engine's): waiting prompts, sorted by length here (sequences admitted together have
     similar lengths, so the padded step wastes little), take free slots at once, up to
     `max_prefill_tokens` prompt tokens per step, and are prefilled in one step;
  2. decode: one step appends one token to every active sequence;
  3. a sequence that hits a stop token or its token budget leaves right away; its slot is reused by the next
     waiting prompt at the next step, so one long answer never holds a batch.

Sampling is per sequence and independent of the batch: the token of sequence i at output position j is drawn
by inverse CDF of `to_probs(logits)` at the counter-based uniform u(seed_i, j) (`sampling.keyed_uniform`, on
the device, every row in one call). The step computes for sequence i the same logits as a batch-1 forward
with a KV cache (each row attends to its own slot only), so each sequence is distributed exactly as
target-only sampling (tests/unit/decoding/test_generator.py: χ² at temperature 1, greedy equals HF greedy,
same seed same answer whatever the batch).

`BatchGenerator.stream(prompts, ...)` is the same loop over an open-ended iterator of `PromptJob`s (e.g.
prompts cycled with fresh seeds), yielding each sequence as it finishes; `stop()` is asked before every step
(a deadline, a token goal): when it says yes, the sequences still decoding are yielded with finish reason
"stopped" (their tokens so far are a valid prefix of a target sample) and the stream ends.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from pydantic import Field, field_validator

from dspark.config import StrictModel
from dspark.decoding.engine import Engine, EngineConfig
from dspark.decoding.engine_config import engine_core_mode
from dspark.decoding.request import Request, StepReport
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.scheduler import SchedulerConfig
from dspark.decoding.static_core import DecodeCoreMode


@dataclass
class PromptJob:
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
        self.engine = Engine(target, None, EngineConfig(
            # seeded_sampling stream: no Gumbel noise over the vocabulary (keyed_uniform: one hash per token)
            scheduler=SchedulerConfig(mode="off"), seeded_sampling="stream",
            max_batch=self.cfg.max_batch, max_waiting=self.cfg.max_batch,
            max_prefill_tokens=self.cfg.max_prefill_tokens, decode_core=engine_core_mode(self.cfg.decode_core, target, cpu_auto="eager"),
            # prompt + new tokens <= the target's positions (the engine keeps one column for the anchor, which a
            # target-only request's last token never takes)
            max_model_len=(getattr(target, "max_positions", None) or 1 << 20) + 1))
        self.engine.step_listeners.append(self._account)
        self.kv = self.engine.kv
        self.stats = GeneratorStats()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int],
                 max_new_tokens: int | Sequence[int], stop_ids: Sequence[int] | None = None
                 ) -> list[tuple[list[int], str]]:
        """(new tokens, finish reason) per prompt, in input order; the stop token is kept."""
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if not len(prompts) == len(seeds) == len(budgets):
            raise ValueError(f"got {len(prompts)} prompts, {len(seeds)} seeds and {len(budgets)} token budgets")
        jobs = [PromptJob(i, p, int(s), int(b)) for i, (p, s, b) in enumerate(zip(prompts, seeds, budgets))]
        for job in jobs:
            _check(job, f"prompt {job.key}")
        self.check_kv_fits(jobs)
        order = sorted(jobs, key=lambda j: len(j.prompt)) if self.cfg.bucket_by_length else jobs
        answers = {job.key: (tokens, reason) for job, tokens, reason in self._loop(iter(order), sampling, stop_ids, None)}
        return [answers[i] for i in range(len(jobs))]

    def check_kv_fits(self, jobs: Sequence[PromptJob]) -> int:
        """Refuse, before any work, a set of prompts whose longest max_batch sequences would not fit their KV in
        the device's free memory (dspark.decoding.kv_budget); -> the bytes needed."""
        from dspark.decoding.kv_budget import check_kv_fits

        longest = sorted((len(j.prompt) + j.max_new_tokens for j in jobs), reverse=True)[: self.cfg.max_batch]
        return check_kv_fits(self.target, len(longest), longest[0]) if longest else 0

    @torch.no_grad()
    def stream(self, prompts: Iterable[PromptJob], sampling: SamplingParams, stop_ids: Sequence[int] | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[tuple[PromptJob, list[int], str]]:
        """(prompt, new tokens, finish reason) as sequences finish; prompts are admitted in the given order as
        slots free up (the caller orders them, e.g. by length); `stop()` is checked every step."""
        def checked():
            for job in prompts:
                yield _check(job, f"request {job.key!r}")
        yield from self._loop(checked(), sampling, stop_ids, stop)

    def _loop(self, jobs: Iterator[PromptJob], sampling: SamplingParams, stop_ids, stop) -> Iterator[tuple]:
        """Submit (a batch ahead at most) / step / collect until `jobs` is empty and nothing runs, or `stop()`."""
        engine, finished, pending = self.engine, deque(), {}

        def listener(req: Request, _new: list[int], done: bool) -> None:
            if done:
                finished.append(req)

        while True:
            if stop is not None and stop():
                engine.cancel_all()
                # the ones decoding (a waiting one has no token yet) end "stopped", their tokens a valid prefix
                yield from ((pending.pop(r), r.tokens, "stopped") for r in list(finished) if r.tokens)
                return
            while len(engine.waiting) < self.cfg.max_batch:
                job = next(jobs, None)
                if job is None:
                    break
                req = engine.submit(job.prompt, sampling, job.max_new_tokens, stop_ids, listener=listener,
                                    seed=job.seed)
                pending[req] = job
            if not engine.has_work():
                return
            engine.step()
            while finished:
                req = finished.popleft()
                if req.finish_reason == "error":
                    raise RuntimeError(f"generating {pending[req].key!r} failed: {req.error}")
                yield pending.pop(req), req.tokens, req.finish_reason

    def _account(self, report: StepReport) -> None:
        s = self.stats
        s.steps += 1
        s.prefill_tokens += report.prefill_tokens
        s.generated_tokens += report.emitted
        s.prefill_s += report.prefill_s
        s.decode_s += report.step_s - report.prefill_s
        s.decode_steps += int(report.rows > 0)
        s.max_active = max(s.max_active, report.rows)


def _check(job: PromptJob, name: str) -> PromptJob:
    if not job.prompt or job.max_new_tokens < 1:
        raise ValueError(f"{name}: needs >= 1 prompt token and max_new_tokens >= 1 "
                         f"(got {len(job.prompt)}, {job.max_new_tokens})")
    return job
