"""DrafterConfig: the one config section that defines a drafter's architecture and its losses.

Fields left `None` are filled from the target when the drafter is built (`resolve_config`), and the
resolved config is what a checkpoint stores, so a saved drafter rebuilds without the target.
"""
from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field, model_validator

from dspark.config import StrictModel

# fields that shape how a drafter is trained, not what it computes: they may change between a run and its
# resume, or when a saved drafter is continued or deepened
TRAINING_ONLY_FIELDS = {"loss_ce", "loss_tv", "loss_conf", "anchors_per_seq", "position_weight", "init_std",
                        "ttt_steps", "position_decay", "ce_target", "loss_norm", "dense_ttt"}


class DrafterConfig(StrictModel):
    algo: Literal["dspark", "dflash", "eagle3"] = Field("dspark", description="dspark (parallel block + sequential head + confidences), dflash (parallel block) or eagle3 (autoregressive, one layer)")
    block_size: int = Field(7, ge=1, description="γ: draft tokens proposed per round")
    num_layers: int = Field(5, ge=1, description="decoder layers (eagle3 always uses 1)")
    num_context_layers: int = Field(3, ge=1, description="m: target layers fused into the context features")
    target_layer_ids: list[int] | None = Field(None, description="None -> target.default_layer_ids(m)")
    head: Literal["markov", "rnn", "none"] = Field("markov", description="dspark only: sequential head")
    rank: int = Field(256, ge=1, description="r: Markov / RNN rank")
    confidence_head: bool = Field(True, description="dspark only")
    ttt_steps: int = Field(7, ge=1, description="eagle3: training-time-test unroll depth")
    num_heads: int | None = Field(None, description="None -> from the target config")
    num_kv_heads: int | None = Field(None, description="None -> from the target config")
    head_dim: int | None = Field(None, description="None -> from the target config")
    intermediate_size: int | None = Field(None, description="MLP width; None -> from the target config")
    rms_norm_eps: float | None = Field(None, description="None -> target's")
    rope_theta: float | None = Field(None, description="None -> target's")
    mask_token_id: int | Literal["reserved", "auto"] | None = Field(
        "auto", description="MASK input of the γ-1 slots after the anchor: a (frozen) target vocab row id; 'reserved' -> "
        "the row the target's tokenizer reserves (mask token, first padding row, else an unused special token; "
        "dspark.drafters.mask_token), which every engine can load; None -> a learned MASK vector (vLLM only); "
        "'auto' (default) -> 'reserved' where the target reserves a row, else a learned MASK (with a warning)")
    init_std: float = Field(0.02, description="std of the normal init of new drafter weights")
    position_weight: Literal["paper", "reference", "geometric"] = Field(
        "paper", description="per-position loss weight w_k: 'paper' exp(-(k-1)/γ), 'reference' exp(-(k-1)/4) "
                             "(DFlash code), 'geometric' position_decay^(k-1) (Eagle3 TTT step weights)")
    position_decay: float = Field(0.8, gt=0, le=1, description="decay of position_weight='geometric' "
                                                               "(0.8 in the Eagle3 reference)")
    ce_target: Literal["hard", "soft"] = Field(
        "hard", description="cross-entropy labels: 'hard' the rollout token, 'soft' the target's full "
                            "next-token distribution (the Eagle3 reference)")
    loss_norm: Literal["token", "block", "sequence_step"] | None = Field(
        None, description="loss normaliser: 'token' a weighted mean over supervised tokens (Σ w_k; LR and "
                          "clipping transfer between block sizes), 'block' the paper's per-block sum / blocks, "
                          "'sequence_step' the Eagle3 references' mean per (sequence, step k) averaged over "
                          "sequences, then Σ_k w_k·mean_k / Σ_k w_k (long sequences weigh no more than short "
                          "ones); None = 'sequence_step' for eagle3, 'token' otherwise")
    dense_ttt: bool = Field(False, description="eagle3 only: training-time test from every eligible position "
                                               "of every sequence (anchors_per_seq is then ignored)")
    loss_ce: float = Field(0.1, description="weight of the cross-entropy term (paper: 0.1)")
    loss_tv: float = Field(0.9, description="weight of the L1/TV term ||p_d - p_t||_1 (paper: 0.9; 0 for DFlash/Eagle3 references)")
    loss_conf: float = Field(1.0, description="weight of the confidence BCE (dspark with a confidence head)")
    anchors_per_seq: int = Field(16, description="anchor blocks sampled per training sequence")
    context_window: int | None = Field(
        None, ge=1, description="dflash / dspark: a block anchored at t attends only to the target context "
        "t-W .. t-1 (a sliding window; the block itself stays bidirectional: speculators' sliding_window with "
        "sliding_window_non_causal). Training and drafting cost O(W) per block at any context length. None = "
        "the whole context")
    draft_vocab_size: int | None = Field(
        None, ge=1, description="Eagle3-style draft vocabulary: the drafter's LM head (and DSpark's Markov W2) "
        "predict over this many of the target's most frequent rollout tokens (d2t/t2d maps, built by the "
        "training job from the rollouts). None = the full target vocabulary.")

    @model_validator(mode="after")
    def _consistent(self) -> "DrafterConfig":
        ids = self.target_layer_ids
        if ids is not None and len(ids) != self.num_context_layers:
            raise ValueError(f"target_layer_ids has {len(ids)} ids but num_context_layers="
                             f"{self.num_context_layers}; make them agree (or leave target_layer_ids unset)")
        if self.context_window is not None and self.algo == "eagle3":
            raise ValueError("context_window is a dflash / dspark option (eagle3 attends to its own causal "
                             "context); leave it unset for eagle3")
        if self.num_heads and self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        return self

    @property
    def train_steps(self) -> int:
        """Predictions per anchor during training: γ for block drafters, ttt_steps for eagle3."""
        return self.ttt_steps if self.algo == "eagle3" else self.block_size

    @property
    def resolved_loss_norm(self) -> str:
        return self.loss_norm or ("sequence_step" if self.algo == "eagle3" else "token")

    @property
    def depth(self) -> int:
        return 1 if self.algo == "eagle3" else self.num_layers


def _target_rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(hf_config, "rope_theta", None) or 10000.0)


def _reserved_mask(target) -> int:
    from dspark.drafters.mask_token import reserved_token_id

    token = reserved_token_id(target)
    if token is None:
        raise ValueError(f"mask_token_id: reserved: target {target.name!r} reserves no token (no mask token, padding "
                         "row or unused special token); set mask_token_id to an id, or None for a learned MASK")
    return token


def _auto_mask(cfg: DrafterConfig, target) -> int | None:
    """The reserved row where the target has one (every engine loads the drafter), else a learned MASK."""
    from dspark.drafters.mask_token import reserved_token_id

    token = reserved_token_id(target) if cfg.algo != "eagle3" else None  # eagle3 has no MASK slots
    if token is None and cfg.algo != "eagle3" and getattr(target, "tokenizer", None) is not None:
        warnings.warn(f"target {target.name!r} reserves no token for the MASK: this drafter learns its own MASK "
                      "vector, which only vLLM's export carries (set mask_token_id to a row id for SGLang)",
                      stacklevel=3)
    return token


def resolve_config(cfg: DrafterConfig, target) -> DrafterConfig:
    """Fill every `None` architecture field from the target; check the layer ids fit the target."""
    hf = target.model.config
    if cfg.algo == "eagle3" and cfg.num_layers not in (1, DrafterConfig.model_fields["num_layers"].default):
        warnings.warn(f"eagle3 drafters have exactly one decoder layer; num_layers={cfg.num_layers} is ignored",
                      stacklevel=2)
    heads = cfg.num_heads or hf.num_attention_heads
    update = {
        "target_layer_ids": list(cfg.target_layer_ids or target.default_layer_ids(cfg.num_context_layers)),
        "num_heads": heads,
        "num_kv_heads": cfg.num_kv_heads or getattr(hf, "num_key_value_heads", None) or heads,
        "head_dim": cfg.head_dim or getattr(hf, "head_dim", None) or target.hidden_size // heads,
        "intermediate_size": cfg.intermediate_size or hf.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps or float(getattr(hf, "rms_norm_eps", 1e-6)),
        "rope_theta": cfg.rope_theta or _target_rope_theta(hf),
    }
    if cfg.algo == "eagle3":
        update["num_layers"] = 1
    if cfg.mask_token_id == "reserved":
        update["mask_token_id"] = _reserved_mask(target)
    elif cfg.mask_token_id == "auto":
        update["mask_token_id"] = _auto_mask(cfg, target)
    ids = update["target_layer_ids"]
    if len(ids) != cfg.num_context_layers:  # default_layer_ids dedups on shallow targets
        update["num_context_layers"] = len(ids)
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} do not exist in target {target.name!r} "
                         f"({target.num_layers} layers, ids 0..{target.num_layers - 1})")
    mask = update.get("mask_token_id", cfg.mask_token_id)
    if mask is not None and not 0 <= mask < target.vocab_size:
        raise ValueError(f"mask_token_id={mask} is outside the target vocabulary "
                         f"(size {target.vocab_size})")
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > target.vocab_size:
        raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} exceeds the target vocabulary "
                         f"({target.vocab_size}); lower it or leave it unset")
    data = cfg.model_dump()
    data.update(update)
    return DrafterConfig.model_validate(data)
