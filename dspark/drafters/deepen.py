"""Deepen a trained drafter: a deeper drafter starts from a shallower one's weights and drafts exactly what
it drafted, so training adds capacity without starting over (function-preserving growth).

Invariant: every added layer is a copy of the source's last layer whose two residual-branch outputs
(attention `o_proj`, MLP `down_proj`) are zero, so it adds nothing to the residual stream: the deeper
drafter's logits equal the source's until training moves those projections off zero.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.drafters.config import TRAINING_ONLY_FIELDS

DEEPENABLE = ("dflash", "dspark")  # drafters with a stack of `layers` (eagle3 has one fixed midlayer)
RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def deepen_from(drafter: nn.Module, source: nn.Module) -> int:
    """Load `source` (same config but fewer layers) into `drafter`; returns how many layers were added."""
    if drafter.algo not in DEEPENABLE or source.algo != drafter.algo:
        raise ValueError(f"only {DEEPENABLE} drafters can be deepened, from the same algo "
                         f"(got {source.algo} -> {drafter.algo})")
    mine, theirs = (d.config.model_dump(exclude={"num_layers", *TRAINING_ONLY_FIELDS}) for d in (drafter, source))
    differ = sorted(k for k in mine if mine[k] != theirs[k])
    if differ:
        raise ValueError(f"a drafter is deepened from one of the same architecture but num_layers; these differ: {differ}")
    have, want = len(source.layers), len(drafter.layers)
    if have >= want:
        raise ValueError(f"deepening goes from fewer layers to more: {have} -> {want}")
    state = source.state_dict()
    last = {name.split(".", 2)[2]: t for name, t in state.items() if name.startswith(f"layers.{have - 1}.")}
    for i in range(have, want):
        for name, t in last.items():
            state[f"layers.{i}.{name}"] = torch.zeros_like(t) if name in RESIDUAL_OUTPUTS else t.clone()
    drafter.load_state_dict(state, strict=True)
    return want - have
