"""The algorithm registry: algo name -> drafter class, and building a fresh drafter for a target."""
from __future__ import annotations

import torch

from dspark.drafters.base import Drafter
from dspark.drafters.config import DrafterConfig, resolve_config
from dspark.drafters.dflash import DFlashDrafter
from dspark.drafters.dspark_model import DSparkDrafter
from dspark.drafters.eagle3 import Eagle3Drafter

DRAFTER_CLASSES: dict[str, type[Drafter]] = {"dspark": DSparkDrafter, "dflash": DFlashDrafter, "eagle3": Eagle3Drafter}


def drafter_from_config(cfg: DrafterConfig, target_meta: dict) -> Drafter:
    """Instantiate (random init) from a resolved config and the target's metadata; no target needed."""
    return DRAFTER_CLASSES[cfg.algo](cfg, target_meta)


def build_drafter(cfg: DrafterConfig, target, dtype: torch.dtype = torch.float32,
                  draft_ids: torch.Tensor | None = None) -> Drafter:
    """A freshly initialised drafter for `target` (architecture fields filled from the target), attached.
    With cfg.draft_vocab_size, `draft_ids` (ascending target ids, e.g. dspark.drafters.draft_vocab.top_token_ids
    of the rollout token counts) fixes the draft vocabulary."""
    cfg = resolve_config(cfg, target)
    if (cfg.draft_vocab_size is None) != (draft_ids is None):
        raise ValueError("draft_vocab_size and draft_ids go together: pass draft_ids=top_token_ids(counts, N) "
                         "(dspark.drafters.draft_vocab) with DrafterConfig.draft_vocab_size=N, or neither")
    meta = {**target.meta(), "layer_ids": list(cfg.target_layer_ids)}
    drafter = drafter_from_config(cfg, meta).to(device=target.device, dtype=dtype)
    if draft_ids is not None:
        drafter.set_draft_vocab(draft_ids)
    drafter.attach_target(target)
    return drafter
