"""Drafters: DSpark (paper §3.1), DFlash and Eagle3 baselines, behind one interface.

    drafter = build_drafter(DrafterConfig(algo="dspark"), target)
    state = drafter.new_state(); drafter.extend_context(state, features, token_ids)
    proposal = drafter.propose(state, anchor, gamma, SamplingParams(), generator)
    save_drafter(drafter, "out/ckpt"); drafter = load_drafter("out/ckpt", target=target)

Every drafter shares the target's frozen token embedding and LM head by reference (attach_target);
checkpoints hold drafter weights only.
"""
from __future__ import annotations

import torch

from dspark.drafters.base import DraftProposal, DraftState, DraftTrainOut, Drafter
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
    With cfg.draft_vocab_size, `draft_ids` (ascending target ids, e.g. dspark.draft_vocab.top_token_ids
    of the rollout token counts) fixes the draft vocabulary."""
    cfg = resolve_config(cfg, target)
    if (cfg.draft_vocab_size is None) != (draft_ids is None):
        raise ValueError("draft_vocab_size and draft_ids go together: pass draft_ids=top_token_ids(counts, N) "
                         "(dspark.draft_vocab) with DrafterConfig.draft_vocab_size=N, or neither")
    meta = {**target.meta(), "layer_ids": list(cfg.target_layer_ids)}
    drafter = drafter_from_config(cfg, meta).to(device=target.device, dtype=dtype)
    if draft_ids is not None:
        drafter.set_draft_vocab(draft_ids)
    drafter.attach_target(target)
    return drafter


def save_drafter(drafter: Drafter, out_dir: str) -> str:
    from dspark.drafters.checkpoint import save_drafter as _save

    return _save(drafter, out_dir)


def load_drafter(path_or_uri: str, target=None, **kwargs) -> Drafter:
    from dspark.drafters.checkpoint import load_drafter as _load

    return _load(path_or_uri, target=target, **kwargs)


def export_vllm(drafter: Drafter, out_dir: str, method: str | None = None, **kwargs) -> str:
    from dspark.drafters.vllm_export import export_vllm as _export

    return _export(drafter, out_dir, method=method, **kwargs)


__all__ = ["DrafterConfig", "DraftProposal", "DraftState", "DraftTrainOut", "Drafter", "DFlashDrafter",
           "DSparkDrafter", "Eagle3Drafter", "build_drafter", "drafter_from_config", "resolve_config",
           "save_drafter", "load_drafter", "export_vllm"]
