"""The engine's configuration (`EngineConfig`): batch and queue bounds, context length, scheduler, SPS
profiling, seeding, logprobs and the drafter's context catch-up (dspark.decoding.engine)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from dspark.config import StrictModel
from dspark.decoding.sampling import LogprobsMode
from dspark.decoding.scheduler import SchedulerConfig
from dspark.decoding.static_core import DecodeCoreMode, default_mode
from dspark.decoding.tree_specdec import check_branching


class EngineConfig(StrictModel):
    scheduler: SchedulerConfig = Field(default_factory=lambda: SchedulerConfig(mode="dynamic"), description="which drafts each step verifies")
    gamma: int | None = Field(None, description="drafts proposed per round (None = the drafter's block size)")
    max_batch: int = Field(32, description="active requests per step")
    decode_core: DecodeCoreMode | None = Field(None, description=(
        "the target step: the static decoding core compiled or eager, or dynamic (the ragged KV store); auto: "
        "compiled on CUDA, the ragged store on a CPU (measured faster there for a drafting engine, see the "
        "README); None = DSPARK_DECODE_CORE or auto"))
    max_waiting: int = Field(128, description="queued requests beyond which submit() rejects (HTTP 429)")
    max_model_len: int = Field(2048, description="prompt + max_new_tokens + γ + 1 must fit (capped by the target)")
    max_prefill_tokens: int = Field(4096, description="prompt tokens admitted per step (at least one request always)")
    sps_batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256], description="verify batch sizes (tokens) profiled for the SPS table at start")
    sps_context: int = Field(128, description="cached context per row while profiling")
    sps_repeats: int = Field(5, description="timed forwards per profiled batch size (the sizes take turns, one forward each per round)")
    sps_table: dict[int, float] | None = Field(None, description="given table: skip profiling (tests, or a saved profile)")
    seed: int | None = Field(0, description="seeds the generators of requests without a seed of their own (None = nondeterministic)")
    max_consecutive_failures: int = Field(3, description="failed steps in a row before the engine reports unhealthy")
    seeded_sampling: Literal["keyed", "stream"] = Field("keyed", description=(
        "randomness of requests that carry a seed: keyed = noise keyed by (seed, output position) with a "
        "Gumbel-max coupling of draft and target (output independent of the batch and scheduler; "
        "acceptance P(draft == target sample) instead of Σ min(p, q)); stream = the request's generator "
        "stream like unseeded requests (the same output only under the same load)"))
    logprobs_mode: LogprobsMode = Field("processed", description=(
        "which distribution reported logprobs come from: processed = the one the token is drawn from "
        "(temperature, min_p, top_k, top_p applied; raw at temperature 0); raw = log_softmax of the target's "
        "logits (vLLM's default)"))
    draft_tree: list[PositiveInt] | None = Field(None, min_length=1, description=(
        "verify a tree of drafts per round instead of a chain while at most `tree_max_rows` requests are "
        "active (DSpark drafters; lossless, dspark.decoding.tree_specdec): children per depth, e.g. [8] = eight "
        "distinct first tokens, each with its own chain, [4, 2] = two under each of four; None = chains only"))
    tree_max_rows: int = Field(1, ge=1, description=(
        "active requests up to which steps verify draft trees (draft_tree set); above it the scheduler's "
        "chains: a tree costs 1 + nodes verified tokens per row, which pays at low load only"))
    context_catch_up_every: int = Field(256, ge=1, description="steps of target features a request may hold for its drafter before the drafter reads them even without drafting (bounds memory while the draft gate skips; the drafter always catches up before it drafts)")


def engine_core_mode(decode_core: str | None, target, cpu_auto: str = "dynamic") -> str:
    """An engine's target step: decode_core, else DSPARK_DECODE_CORE, else auto. auto: the compiled core on CUDA;
    on a CPU `cpu_auto` — the ragged store for serving (rows of mixed verify lengths padded to one width made the
    eager core 0.83-0.94x of it at c = 1-16, the engine_core benchmark, and target-only serving, the baseline a
    drafting engine is compared with, stays on the same store), the eager core for the rollout generator (every
    row one token: nothing padded; at parity or faster)."""
    mode = decode_core or default_mode()
    if mode != "auto":
        return mode
    return "compiled" if target.device.type == "cuda" else cpu_auto


def check_drafter(cfg: EngineConfig, drafter) -> int:
    """The engine's γ for this drafter under cfg's scheduler mode (0 for mode off); a clear error when the mode
    needs a drafter or draft confidences it lacks."""
    mode = cfg.scheduler.mode
    if mode == "off":
        return 0
    if drafter is None:
        raise ValueError(f"scheduler mode {mode!r} needs a drafter; pass one or use mode 'off'")
    if mode in ("dynamic", "threshold", "async_topk") and not drafter.has_confidences:
        raise ValueError(f"scheduler mode {mode!r} needs draft confidences, but this "
                         f"{drafter.config.algo} drafter has no confidence head; use mode fixed/off or a DSpark drafter")
    gamma = cfg.gamma or drafter.config.block_size
    drafter.check_gamma(gamma)
    return gamma


def check_tree(cfg: EngineConfig, drafter, gamma: int) -> tuple[int, ...] | None:
    """cfg.draft_tree checked against the drafter and γ (None: chains only)."""
    if cfg.draft_tree is None or cfg.scheduler.mode == "off":
        return None
    if not hasattr(drafter, "draft_trees"):
        raise ValueError(f"draft_tree needs a drafter that grows draft trees (DSpark), not "
                         f"{drafter.config.algo}; set draft_tree to null (engine.draft_tree in a serve config)")
    return check_branching(cfg.draft_tree, gamma)
