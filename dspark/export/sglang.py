"""Export a drafter in the layouts SGLang's own draft-model loaders read.

Eagle3 -> `LlamaForCausalLMEagle3` (sglang/srt/models/llama_eagle3.py): a plain Llama config with
  architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1, target_hidden_size, and
  eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}. SGLang's capture hook adds
  1 to each id itself (`layers_to_capture = [id + 1 ...]`, the input of layer id+1 = the output of
  layer id), so the ids are ours unchanged. Weights: fc.weight (3·d -> d: the loader's fc is fixed
  at three target layers), midlayer.{input_layernorm, hidden_norm, post_attention_layernorm,
  self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}.weight (q/k/v and gate/up stacked on load),
  norm.weight. The embedding always comes from the target; the LM head too when the config has no
  draft_vocab_size (full vocabulary). A reduced vocabulary writes draft_vocab_size, lm_head.weight
  and d2t (offsets: target id = draft id + d2t[id]).
DFlash -> `DFlashDraftModel` (sglang/srt/models/dflash.py, config parsed by
  speculative/dflash_utils.parse_dflash_draft_config): a Qwen3 config with architectures
  ["DFlashDraftModel"], block_size and dflash_config {target_layer_ids (ours: output-of-layer ids,
  the hook adds 1), block_size = γ+1, mask_token_id}. Weights: layers.{i}.*, fc.weight,
  hidden_norm.weight, norm.weight; no embedding or LM head (the target's are used, so the MASK must
  be a target vocabulary row).
DSpark: no SGLang loader carries the Markov/confidence heads this export could target; refused.
"""
from __future__ import annotations

import torch

from dspark.drafters.base import Drafter
from dspark.export.vllm import (ExportError, check_layer_ids, draft_token_ids, layer_config, map_weights,
                                         write_checkpoint)


def check_sglang(drafter: Drafter) -> None:
    algo, c = drafter.algo, drafter.config
    if algo == "dspark":
        raise ExportError("algo='dspark': SGLang has no DSpark loader this export targets (its DFlash loader has no "
                          "markov_head/confidence_head); export --format vllm, or train algo=dflash for SGLang")
    check_layer_ids(drafter, "SGLang")
    if algo == "eagle3" and len(drafter.layer_ids) != 3:
        raise ExportError(f"target_layer_ids: SGLang's LlamaForCausalLMEagle3 fuses exactly 3 target layers "
                          f"(fc is 3·hidden_size wide); this drafter uses {len(drafter.layer_ids)}")
    if algo == "dflash" and c.mask_token_id is None:
        raise ExportError("mask_token_id: SGLang's DFlash embeds the MASK with the target's embedding, so a learned "
                          "MASK vector (mask_token_id=None) cannot be carried; train with mask_token_id set to a "
                          "reserved token id, or export --format vllm")


def sglang_weights(drafter: Drafter) -> tuple[dict[str, torch.Tensor], int | None]:
    """Renamed weights (+ lm_head/d2t for a reduced vocabulary) and the draft vocab size (None = full)."""
    weights = {k.replace("layers.0.", "midlayer.", 1) if drafter.algo == "eagle3" else k: v
               for k, v in map_weights(drafter, drafter.algo).items()}
    ids = draft_token_ids(drafter)
    if ids is None:
        return weights, None
    if drafter.algo != "eagle3":
        raise ExportError(f"draft_vocab_size={ids.numel()}: SGLang's DFlash always uses the target's full LM head")
    weights["d2t"] = ids - torch.arange(ids.numel())
    weights["lm_head.weight"] = drafter.target.lm_head.weight.detach()[ids.to(drafter.target.device)]
    return weights, int(ids.numel())


def sglang_config(drafter: Drafter, draft_vocab_size: int | None) -> dict:
    c = drafter.config
    cfg = layer_config(drafter, drafter.algo, drafter.vocab_size)
    num_layers = drafter.target_meta.get("num_layers")
    meta = {"algo": drafter.algo, "target_layer_ids": drafter.layer_ids, "calibration": drafter.calibration,
            "draft_vocab_size": draft_vocab_size or drafter.vocab_size}
    if drafter.algo == "eagle3":
        cfg.update(architectures=["LlamaForCausalLMEagle3"], target_hidden_size=drafter.hidden_size,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": drafter.layer_ids, "use_aux_hidden_state": True},
                   dspark_export=meta)
        if draft_vocab_size is not None:  # absent = share the target's LM head (the loader's rule)
            cfg["draft_vocab_size"] = draft_vocab_size
        return cfg
    cfg.update(architectures=["DFlashDraftModel"], block_size=c.block_size + 1, num_target_layers=num_layers,
               dflash_config={"target_layer_ids": drafter.layer_ids, "block_size": c.block_size + 1,
                              "mask_token_id": c.mask_token_id},
               dspark_export=meta)
    return cfg


def export_sglang(drafter: Drafter, out_dir: str, *, dtype: torch.dtype | None = None) -> str:
    """Write `out_dir` (local or s3://) in SGLang's Eagle3 / DFlash draft layout; returns out_dir."""
    drafter = getattr(drafter, "module", drafter)
    check_sglang(drafter)
    weights, draft_vocab_size = sglang_weights(drafter)
    write_checkpoint(out_dir, weights, sglang_config(drafter, draft_vocab_size), dtype)
    return str(out_dir)
