"""Mixture-of-experts targets: the parameters one token passes through, and the router's share of them.

An MoE block (transformers' Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek classes) holds `gate` (the router: a
[E, hidden] linear) and `experts` (E experts stacked on a leading dimension). A token runs every parameter
outside the experts (attention, norms, shared experts, the routers) and `top_k` of each block's E experts.
Invariant: FLOPs per token = 2 × active parameters (+ the attention scores), so the training MFU and
`dspark memory` count the active parameters, not the total (an MoE target's total overstates its compute
by up to E/top_k on the expert share), and the router's cost is 2 × its parameters per token per block.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class MoEProfile:
    blocks: int  # MoE layers
    experts: int  # E per block
    top_k: int  # experts each token runs per block
    total_params: int
    expert_params: int  # all blocks' experts together
    router_params: int  # all blocks' routers together

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all but the (E - top_k)/E of the experts it skips."""
        return self.total_params - self.expert_params + self.expert_params * self.top_k // self.experts

    @property
    def router_share(self) -> float:
        """The routers' share of a token's FLOPs (matmuls only)."""
        return self.router_params / max(1, self.active_params)

    def as_dict(self) -> dict:
        return {"blocks": self.blocks, "experts": self.experts, "top_k": self.top_k,
                "total_params": self.total_params, "active_params": self.active_params,
                "expert_params": self.expert_params, "router_params": self.router_params,
                "router_share": round(self.router_share, 6)}


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that route tokens: those holding both a `gate` and an `experts` child."""
    return [m for m in model.modules() if isinstance(getattr(m, "gate", None), nn.Module)
            and isinstance(getattr(m, "experts", None), nn.Module)]


def moe_profile(model: nn.Module) -> MoEProfile | None:
    """The MoE profile of a transformers model (meta-device models too: only shapes are read); None if dense."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
               or getattr(config, "n_routed_experts", None))
    top_k = getattr(config, "num_experts_per_tok", None)
    blocks = moe_blocks(model)
    if not (experts and top_k and blocks):
        return None
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    return MoEProfile(blocks=len(blocks), experts=int(experts), top_k=int(top_k),
                      total_params=count(model), expert_params=sum(count(b.experts) for b in blocks),
                      router_params=sum(count(b.gate) for b in blocks))


def active_param_count(model: nn.Module) -> int:
    """Parameters one token passes through (all of them for a dense model)."""
    profile = moe_profile(model)
    return profile.active_params if profile else sum(p.numel() for p in model.parameters())
