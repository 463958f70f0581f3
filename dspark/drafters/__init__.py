"""Drafters: DSpark (paper §3.1), DFlash and Eagle3 baselines, behind one interface.

    drafter = build_drafter(DrafterConfig(algo="dspark"), target)
    state = drafter.new_state(); drafter.extend_context(state, features, token_ids)
    proposal = drafter.propose(state, anchor, gamma, SamplingParams(), generator)
    save_drafter(drafter, "out/ckpt"); drafter = load_drafter("out/ckpt", target=target)

Every drafter shares the target's frozen token embedding and LM head by reference (attach_target);
checkpoints hold drafter weights only.
"""
from __future__ import annotations

from dspark.drafters.base import DraftProposal, DraftState, DraftTrainOut, Drafter
from dspark.drafters.checkpoint import load_drafter, save_drafter
from dspark.drafters.config import DrafterConfig, resolve_config
from dspark.drafters.dflash import DFlashDrafter
from dspark.drafters.dspark_model import DSparkDrafter
from dspark.drafters.eagle3 import Eagle3Drafter
from dspark.drafters.registry import DRAFTER_CLASSES, build_drafter, drafter_from_config


__all__ = ["DrafterConfig", "DraftProposal", "DraftState", "DraftTrainOut", "Drafter", "DFlashDrafter",
           "DSparkDrafter", "Eagle3Drafter", "build_drafter", "drafter_from_config", "resolve_config",
           "save_drafter", "load_drafter", "DRAFTER_CLASSES"]
