"""Training inside a wall-clock budget (single process): a deadline checked before every step, the step
time measured over batches from several length buckets, and the schedule sized from it.

`train_for(trainer, batches, seconds, deadline)` trains one drafter (a dspark.training.loop.LocalTrainer,
i.e. the shared step) for its own share of the time: it measures the step time first (one warm-up, then
forward + backward without an update on a short, a median and a long batch: a single random batch
mis-sizes the run by the length spread), sets the learning-rate schedule to the steps that fit, re-sizes
it from the real step time as it goes (StepBudget, shared with the learning-curve recipe), and steps
until the planned steps are done or `min(start + seconds, deadline)` passes — whichever is first,
checked before every step, so a slow step overruns by at most one step.
`run_steps(trainer, budget, batches, step)` is that loop alone, the one every single-process run trains with
(train_for; the learning curve's steps on cached target features, with an epoch-sized or timed StepBudget).
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from dspark.training.batching import bucketed_batches, collate


@dataclass(frozen=True)
class Deadline:
    """An absolute wall-clock time (time.time()); `within(s)` is the earlier of it and now + s."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        return cls(time.time() + seconds)

    def left(self) -> float:
        return self.at - time.time()

    def passed(self) -> bool:
        return time.time() >= self.at

    def within(self, seconds: float) -> "Deadline":
        return Deadline(min(self.at, time.time() + max(0.0, seconds)))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def epoch_batches(rows: Sequence[dict], batch_size: int, max_len: int, pad_id: int, window: int,
                  seed: int) -> Iterator[dict]:
    """Endless collated batches: a new permutation per epoch, length-bucketed in windows of `window`
    batches (dspark.training.batching), each with its epoch number under "epoch"."""
    if not rows:
        raise ValueError("no training rows (the rollouts produced nothing)")
    batch_size = min(batch_size, len(rows))
    lengths = [min(len(r["input_ids"]), max_len) for r in rows]
    epoch = 0
    while True:
        order = list(range(len(rows)))
        random.Random(seed + epoch).shuffle(order)
        for pick in bucketed_batches(order, lengths, batch_size, window, seed + epoch):
            batch = collate({"input_ids": [rows[j]["input_ids"] for j in pick],
                             "loss_mask": [rows[j]["loss_mask"] for j in pick]}, max_len, pad_id)
            yield {**batch, "epoch": epoch}
        epoch += 1


def probe_batches(rows: Sequence[dict], batch_size: int, max_len: int, pad_id: int) -> list[dict]:
    """A short, a median and a long batch (rows sorted by length; `batch_size` rows around each point)."""
    order = sorted(range(len(rows)), key=lambda j: len(rows[j]["input_ids"]))
    n, out = len(order), []
    for start in sorted({0, max(0, n // 2 - batch_size // 2), max(0, n - batch_size)}):
        pick = order[start:start + batch_size]
        out.append(collate({"input_ids": [rows[j]["input_ids"] for j in pick],
                            "loss_mask": [rows[j]["loss_mask"] for j in pick]}, max_len, pad_id))
    return out


def measure_step_s(trainer, batches: Sequence[dict], chunks: int = 1, stop: Deadline | None = None) -> float:
    """Mean seconds of one step (forward + backward, no update) over `batches`, after one warm-up step;
    `stop` is checked before each (a probe cut short is timed on what it ran, the warm-up at worst)."""
    start = time.perf_counter()
    trainer.step(batches[0], seed=0, update=False, chunks=chunks)
    sync(trainer.target.device)
    warm, done, start = time.perf_counter() - start, 0, time.perf_counter()
    for i, batch in enumerate(batches):
        if stop is not None and stop.passed():
            break
        trainer.step(batch, seed=i + 1, update=False, chunks=chunks)
        done += 1
    sync(trainer.target.device)
    return (time.perf_counter() - start) / done if done else warm


REPLAN_FRACTIONS = (0.05, 0.25, 0.5, 0.75)  # of the current plan: where StepBudget re-sizes it


class StepBudget:
    """The step count of one training run, shared by every budgeted loop (train_for here, the learning-curve
    recipe's train_one). Without `seconds` it is just `planned` steps. With it, the plan (from a probed step
    time: a guess) is re-sized when 5 %, 25 %, 50 % and 75 % of the CURRENT plan are done (the trainer's
    cosine schedule with it), capped at `max_steps`, from the step time since the previous re-plan point
    (not the mean since the start: the first steps on a GPU carry its warm-up; measured on an H200, a plan
    sized from the whole mean ended 15 s early of a 60 s share); invariant: no step starts once `seconds`
    have passed since the budget was made (or once `stop`, an absolute Deadline, has passed), so a slow
    step overruns by at most one step.

        budget = StepBudget(planned, seconds); trainer.set_schedule(budget.total)
        while budget.more():
            ...one step...
            budget.stepped(trainer)
    """

    def __init__(self, planned: int, seconds: float | None = None, max_steps: int | None = None,
                 stop: Deadline | None = None):
        self.planned = self.total = max(1, min(planned, max_steps) if max_steps else planned)
        self.seconds, self.max_steps, self.stop = seconds, max_steps, stop
        self.done, self.stopped_by = 0, "steps"
        self.fractions = list(REPLAN_FRACTIONS) if seconds else []  # re-plan points still ahead
        self.t0 = time.perf_counter()
        self.window = (0, 0.0)  # (steps done, seconds elapsed) at the last re-plan point

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def more(self) -> bool:
        """Whether another step may start (and why not: stopped_by = "steps" or "deadline")."""
        if self.done >= self.total:
            return False
        if self.stop.passed() if self.stop is not None else (self.seconds is not None and self.elapsed() >= self.seconds):
            self.stopped_by = "deadline"
            return False
        return True

    def _replan_due(self) -> bool:
        return bool(self.fractions) and self.done >= max(2, int(self.fractions[0] * self.total))

    def stepped(self, trainer) -> int | None:
        """Count a finished step; at a re-plan point re-size the plan and `trainer`'s schedule. Returns the
        previous total when it changed (for the caller's log), else None."""
        self.done += 1
        if not self._replan_due():
            return None
        while self._replan_due():  # a re-plan point the steps have passed (a grown plan moves later ones)
            self.fractions.pop(0)
        elapsed, (done_before, elapsed_before) = self.elapsed(), self.window
        self.window = (self.done, elapsed)
        if elapsed >= self.seconds:  # over already: the budget, not a shrunken plan, ends the run
            return None
        step_s = (elapsed - elapsed_before) / (self.done - done_before)  # this window's steps only
        resized = self.done + int((self.seconds - elapsed) / max(step_s, 1e-9))
        resized = min(resized, self.max_steps) if self.max_steps else resized
        if resized == self.total:
            return None
        before, self.total = self.total, resized
        trainer.set_schedule(resized, done=self.done)
        return before


@dataclass
class TrainReport:
    planned_steps: int = 0
    steps: int = 0
    epochs: int = 0
    tokens: float = 0.0
    flops: float = 0.0
    step_s: float = 0.0  # measured (probe) seconds per step
    train_s: float = 0.0  # wall time of the steps (probe excluded)
    probe_s: float = 0.0
    stopped_by: str = ""  # "steps" (the plan) or "deadline"
    curve: list = field(default_factory=list)
    final_metrics: dict = field(default_factory=dict)  # mean over the last 20 steps


def train_for(trainer, batches: Iterator[dict], probe: Sequence[dict], seconds: float, deadline: Deadline,
              seed: int = 0, chunks: int = 1, log_every: int = 50, max_steps: int | None = None,
              on_log: Callable[[dict], None] | None = None) -> TrainReport:
    """Train `trainer` for `seconds` of wall clock (its share), never past `deadline`; see the module doc."""
    start = time.time()
    stop = deadline.within(seconds)
    report = TrainReport()
    report.step_s = measure_step_s(trainer, probe, chunks, stop)
    report.probe_s = time.time() - start
    budget = StepBudget(int(stop.left() / max(report.step_s, 1e-6)), max(0.0, stop.left()), max_steps, stop)
    trainer.set_schedule(budget.total)
    return run_steps(trainer, budget, batches, lambda batch, s: trainer.step(batch, s, chunks=chunks), seed,
                     log_every, on_log, report)


def run_steps(trainer, budget: StepBudget, batches: Iterator[dict], step: Callable[[dict, int], dict], seed: int = 0,
              log_every: int = 50, on_log: Callable[[dict], None] | None = None,
              report: TrainReport | None = None) -> TrainReport:
    """The training loop of every single-process run (the GPU recipe through `train_for`, the learning curve
    on cached target features, benchmarks): `step(batch, seed)` (one optimiser step of `trainer`, returning its
    metrics with "tokens" and "flops") while `budget` allows (invariant: no step starts past it), re-sizing
    the schedule as the budget re-plans; step k gets seed `seed * 1_000_003 + k`. A curve point every
    `log_every` steps and at the last: the metrics averaged over the steps since the previous point, tokens/s
    so far and the current plan (`on_log` gets each); `final_metrics`: the mean over the last 20 steps."""
    report = report or TrainReport()
    report.planned_steps = budget.planned
    since_point: list[dict] = []
    last = deque(maxlen=20)
    t0 = time.time()
    while budget.more():
        done = budget.done
        batch = next(batches)
        epoch = batch.pop("epoch", 0)
        m = step(batch, seed * 1_000_003 + done)
        report.steps, report.epochs = done + 1, epoch + 1
        report.tokens += m["tokens"]
        report.flops += m["flops"]
        since_point.append(m)
        last.append(m)
        budget.stepped(trainer)
        if (done + 1) % log_every == 0 or done + 1 == budget.total or done == 0:
            point = {"step": done + 1, "planned_steps": budget.total, "epoch": epoch,
                     "seconds": round(time.time() - t0, 2),
                     "tokens_per_s": round(report.tokens / max(time.time() - t0, 1e-9), 1),
                     **{k: round(v, 5) for k, v in mean_metrics(since_point).items() if k not in ("flops", "tokens")}}
            report.curve.append(point)
            since_point = []
            if on_log:
                on_log(point)
    report.stopped_by, report.final_metrics = budget.stopped_by, mean_metrics(list(last))
    sync(trainer.target.device)
    report.train_s = time.time() - t0
    trainer.drafter.eval()
    return report


def mean_metrics(steps: Sequence[dict]) -> dict[str, float]:
    """Per metric, its mean over the steps that report it (float metrics only)."""
    keys = {k for m in steps for k, v in m.items() if isinstance(v, float)}
    return {k: sum(m[k] for m in steps if k in m) / sum(k in m for m in steps) for k in sorted(keys)}
