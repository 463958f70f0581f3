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
DSpark -> `Qwen3DSparkModel` (sglang/srt/models/dspark.py, config parsed by
  speculative/dspark_components/dspark_config.parse_dspark_draft_config; read at sgl-project/sglang
  commit 01f47623): the DFlash layout above with architectures ["Qwen3DSparkModel"], block_size =
  dflash_config.block_size = γ (the DeepSpec anchor-first block: [anchor, MASK × (γ-1)], slot k
  predicts t+k+1, the first previous token of the Markov head is the anchor: our DSpark layout),
  markov_rank (> 0: SGLang refuses a DSpark draft without a Markov head), markov_head_type
  ("vanilla" = our head="markov"; "rnn" = ours: z = [s; W1[x]; h] -> [gate, cand, out], the same
  recurrence), enable_confidence_head / confidence_head_with_markov, sample_from_anchor = true.
  Weights: the DFlash ones plus markov_head.markov_w{1,2}.weight (V×r both), markov_head.joint_proj
  (RNN) and confidence_head.proj.{weight,bias} ([h; W1[x]] -> 1). It must NOT carry
  speculators_model_type: SGLang refuses such a config (speculators' slot convention). The MASK is
  embedded with the target's embedding (a target row); the vocabulary is the target's full one
  (markov_w1/w2 are built with vocab_size and the base logits are cropped to the target's vocabulary):
  a reduced draft vocabulary is written exactly in that layout (`expand_draft_vocab`, Markov head only).
  With a ragged verify mode (SGLANG_RAGGED_VERIFY_MODE other than "static") SGLang builds a confidence
  head regardless of enable_confidence_head and needs its weights.
"""
from __future__ import annotations

import torch

from dspark.drafters.base import Drafter
from dspark.export.algos import ALGORITHMS
from dspark.export.vllm import (HEAD_TYPES, ExportError, check_layer_ids, draft_token_ids, layer_config,
                                map_weights, write_checkpoint)

SGLANG_DSPARK = {
    "engine": "sglang", "min_version": None, "silent": False,
    "feature": "Qwen3DSparkModel (python/sglang/srt/models/dspark.py; read at sgl-project/sglang commit "
               "01f476234ab4ee99c7fb7cb31b68d31b6a7c54a8); the first release with it was not determined here",
    "older": "SGLang builds without python/sglang/srt/models/dspark.py do not know the architecture and refuse "
             "the checkpoint"}
REQUIRES = {"Qwen3DSparkModel": SGLANG_DSPARK}  # SGLang architecture -> the engine feature it needs


def check_sglang(drafter: Drafter) -> None:
    spec, c = ALGORITHMS[drafter.algo], drafter.config
    if spec.markov_head_fields and drafter.markov_head is None:
        raise ExportError(f"head='none': SGLang's {spec.sglang_arch} requires a Markov head (markov_rank > 0); "
                          "export --format speculators, or train with head=markov")
    check_layer_ids(drafter, "SGLang")
    fused = spec.fused_layers
    if fused is not None and len(drafter.layer_ids) != fused:
        raise ExportError(f"target_layer_ids: SGLang's {spec.sglang_arch} fuses exactly {fused} target layers "
                          f"(fc is {fused}·hidden_size wide); this drafter uses {len(drafter.layer_ids)}")
    if spec.masked_block and c.mask_token_id is None:
        raise ExportError(f"mask_token_id: SGLang's {spec.title} embeds the MASK with the target's embedding, so a "
                          "learned MASK vector (mask_token_id=None) cannot be carried; train with mask_token_id set "
                          "to a reserved token id (mask_token_id: reserved), or export --format vllm")


MASKED_LOGIT = -1.0e4  # exp(-1e4) underflows to 0 in every float format: a token SGLang can never draft


def expand_draft_vocab(weights: dict[str, torch.Tensor], ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """A DSpark Markov head over a draft vocabulary `ids` -> SGLang's full-vocabulary VanillaMarkov, exactly.

    Ours: logits[i] = lm_head[ids[i]]·h + W2[i]·W1[x] over the draft tokens only. SGLang: logits[v] =
    lm_head[v]·h + W2'[v]·W1'[x] over all V. One more rank makes them agree: W1'[x] = [W1[x], 1] for every
    x, W2'[ids[i]] = [W2[i], 0] and W2'[v] = [0, MASKED_LOGIT] for v outside the draft vocabulary. So
    SGLang's logits equal ours on the draft tokens and sit 1e4 lower on the rest (probability 0: the same
    distribution). The confidence head reads [h; W1'[x]]: its weight gets a zero column for the new rank."""
    w1, w2 = weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"]
    rank = w1.shape[1]
    out = dict(weights)
    out["markov_head.markov_w1.weight"] = torch.cat([w1, torch.ones(w1.shape[0], 1, dtype=w1.dtype)], 1)
    full = torch.zeros(vocab_size, rank + 1, dtype=w2.dtype)
    full[:, rank] = MASKED_LOGIT
    full[ids, :rank], full[ids, rank] = w2, 0.0
    out["markov_head.markov_w2.weight"] = full
    if "confidence_head.proj.weight" in weights:
        proj = weights["confidence_head.proj.weight"]
        out["confidence_head.proj.weight"] = torch.cat([proj, torch.zeros(proj.shape[0], 1, dtype=proj.dtype)], 1)
    return out


def sglang_weights(drafter: Drafter) -> tuple[dict[str, torch.Tensor], int | None]:
    """Our weight names (+ lm_head/d2t for a reduced Eagle3 vocabulary, or the expanded Markov head for a
    reduced DSpark one) and the draft vocab size written to the config (None = full)."""
    weights = {k: v.detach().cpu() for k, v in map_weights(drafter, drafter.algo, rename=False).items()}
    ids = draft_token_ids(drafter)
    if ids is None:
        return weights, None
    if ALGORITHMS[drafter.algo].markov_head_fields and drafter.config.head == "markov":
        return expand_draft_vocab(weights, ids.cpu(), drafter.vocab_size), None
    if not ALGORITHMS[drafter.algo].sglang_draft_vocab:
        raise ExportError(f"draft_vocab_size={ids.numel()}: SGLang's DFlash (and DSpark with head={drafter.config.head}) "
                          "always use the target's full LM head, with no per-token bias to mask the tokens outside "
                          "the draft vocabulary; DSpark with head=markov exports exactly, or export --format vllm")
    weights["d2t"] = ids - torch.arange(ids.numel())
    weights["lm_head.weight"] = drafter.target.lm_head.weight.detach()[ids.to(drafter.target.device)]
    return weights, int(ids.numel())


def sglang_config(drafter: Drafter, draft_vocab_size: int | None) -> dict:
    spec = ALGORITHMS[drafter.algo]
    if drafter.config.context_window is not None:
        raise ExportError(f"context_window={drafter.config.context_window}: SGLang's DFlash/DSpark loaders were not "
                          "checked for a windowed, block-bidirectional drafter (it would silently attend to the whole "
                          "context); export --format vllm or speculators, which name the window")
    cfg = layer_config(drafter, drafter.algo, drafter.vocab_size)
    ids = draft_token_ids(drafter)
    meta = {"algo": drafter.algo, "target_layer_ids": drafter.layer_ids, "calibration": drafter.calibration,
            "draft_temperature": drafter.draft_temperature,  # SGLang drafts at the request's temperature
            "draft_vocab_size": draft_vocab_size or (ids.numel() if ids is not None else drafter.vocab_size)}
    if ids is not None and draft_vocab_size is None:
        meta["draft_vocab_expanded"] = ("the reduced draft vocabulary is written as SGLang's full-vocabulary "
                                        "Markov head with one masking rank (markov_rank = rank + 1)")
    cfg["architectures"] = [spec.sglang_arch]
    cfg.update(block_fields(drafter) if spec.masked_block else eagle3_fields(drafter))
    cfg["dspark_export"] = meta
    if draft_vocab_size is not None:  # absent = share the target's LM head (the loader's rule)
        cfg["draft_vocab_size"] = draft_vocab_size
    if spec.markov_head_fields:
        cfg.update(sglang_head_fields(drafter))
    if spec.sglang_arch in REQUIRES:
        meta["requires"] = [REQUIRES[spec.sglang_arch]]
    return cfg


def eagle3_fields(drafter: Drafter) -> dict:
    """LlamaForCausalLMEagle3: our layer ids unchanged (SGLang's capture hook adds 1 itself)."""
    return {"target_hidden_size": drafter.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": drafter.layer_ids, "use_aux_hidden_state": True}}


def block_fields(drafter: Drafter) -> dict:
    """DFlash / DSpark block layout: DFlash anchor + γ masks (γ+1 slots); DSpark γ slots anchor-first."""
    c = drafter.config
    block = ALGORITHMS[drafter.algo].block_size(c.block_size)
    return {"block_size": block, "num_target_layers": drafter.target_meta.get("num_layers"),
            "dflash_config": {"target_layer_ids": drafter.layer_ids, "block_size": block,
                              "mask_token_id": c.mask_token_id}}


def sglang_head_fields(drafter: Drafter) -> dict:
    """Qwen3DSparkModel's head fields (check_sglang has refused a drafter without a Markov head); a reduced
    draft vocabulary adds the masking rank (expand_draft_vocab)."""
    c, has_conf = drafter.config, drafter.confidence_head is not None
    expanded = draft_token_ids(drafter) is not None
    return {"markov_rank": c.rank + int(expanded), "markov_head_type": HEAD_TYPES[c.head], "sample_from_anchor": True,
            "enable_confidence_head": has_conf, "confidence_head_with_markov": has_conf}


def export_sglang(drafter: Drafter, out_dir: str, *, dtype: torch.dtype | None = None) -> str:
    """Write `out_dir` (local or s3://) in SGLang's Eagle3 / DFlash draft layout; returns out_dir."""
    drafter = getattr(drafter, "module", drafter)
    check_sglang(drafter)
    weights, draft_vocab_size = sglang_weights(drafter)
    write_checkpoint(out_dir, weights, sglang_config(drafter, draft_vocab_size), dtype)
    return str(out_dir)
