"""Export a trained drafter as a vLLM speculators-format checkpoint (config.json + model.safetensors).

vLLM reads speculators checkpoints through `SpeculatorsConfig` (vllm/transformers_utils/configs/
speculators/): it requires `speculators_model_type`, `speculators_config.proposal_methods[0]
.speculative_tokens`, `speculators_config.verifier.name_or_path` and a `transformer_layer_config`
dict, then the per-algorithm updater (`update_dflash`, `update_dspark`, `update_eagle3`) maps the
top-level fields below onto the draft model config. Serve with
`vllm serve TARGET --speculative-config '{"model": OUT_DIR}'` (method and γ come from the config).

Config fields written (all algorithms): speculators_model_type, speculators_config {algorithm,
proposal_methods=[{proposal_type: "greedy", speculative_tokens: γ}], default_proposal_method,
verifier {name_or_path, architectures}}, transformer_layer_config (qwen3 for dflash/dspark, llama for
eagle3: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
head_dim, rms_norm_eps, vocab_size, rope_parameters/rope_theta, hidden_act, ...), draft_vocab_size,
target_hidden_size, dspark_calibration (ours; STS temperatures, ignored by vLLM).
- dflash: aux_hidden_state_layer_ids, mask_token_id, block_size = γ+1 (anchor + γ masks).
- dspark: the dflash fields with block_size = γ, sample_from_anchor = true, markov_rank,
  markov_head_type = "vanilla", enable_confidence_head, confidence_head_with_markov.
- eagle3: eagle_aux_hidden_state_layer_ids, norm_before_residual = true.

Layer indexing: our layer id i is the output of target decoder layer i (HF hidden_states[i+1]).
vLLM's aux-hidden-state ids capture the input of decoder layer a, so aux = i + 1; vLLM's DFlash model
derives dflash_config.target_layer_ids = aux - 1 = i (the z-lab/dflash convention).

Weight mapping (ours -> vLLM checkpoint name; layer-internal names are already vLLM's):
  dflash / dspark
    fc.weight                                   -> fc.weight            (W_c: m·d -> d)
    hidden_norm.weight                          -> hidden_norm.weight   (RMSNorm of H_ctx)
    layers.{i}.input_layernorm.weight           -> layers.{i}.input_layernorm.weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight  -> same (vLLM stacks q/k/v into qkv_proj on load)
    layers.{i}.self_attn.{q,k}_norm.weight      -> same
    layers.{i}.post_attention_layernorm.weight  -> same
    layers.{i}.mlp.{gate,up,down}_proj.weight   -> same (gate/up stacked on load)
    norm.weight                                 -> norm.weight
    mask_embedding (learned MASK vector)        -> embed_tokens.weight = [target embedding ; MASK]
        (vocab_size = V+1, mask_token_id = V, draft_vocab_size = V: vLLM's "expanded input vocab";
        this copies the target's embedding into the export, never into our checkpoints). With
        DrafterConfig.mask_token_id set, no embedding is written and that id is exported.
  dspark only
    markov_head.markov_w1.weight                -> markov_head.markov_w1.weight (zero row appended
                                                   for the MASK id when the vocab is expanded)
    markov_head.markov_w2.weight                -> markov_head.markov_w2.weight
    confidence_head.proj.{weight,bias}          -> confidence_head.proj.{weight,bias}
    markov_head.joint_proj.* (RNN head)         -> none: vLLM serves only the Markov head -> error
  eagle3
    fc.weight                                   -> fc.weight            (3·d -> d; vLLM needs m = 3)
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight -> same
    midlayer.self_attn.{q,k,v,o}_proj.weight    -> same (vLLM renames midlayer. -> layers.0.)
    midlayer.mlp.{gate,up,down}_proj.weight     -> same
    norm.weight                                 -> norm.weight
The target LM head is not exported (vLLM shares the target's when the checkpoint has none and
draft_vocab_size equals the target vocabulary). Any drafter weight without a rule is an error.
Draft vocabulary (DrafterConfig.draft_vocab_size = N, all algorithms), in the speculators layout:
    d2t [N] int64 (target_id = draft_id + d2t[draft_id]; vLLM's draft_id_to_target_id) -> d2t
    t2d [V] bool (one False appended for an expanded MASK id)                          -> t2d
    target LM head rows of the N draft tokens (ascending target id)                    -> lm_head.weight [N, d]
    draft_vocab_size = N; markov_w2 is already [N, r] and markov_w1 stays over the target ids.
"""
from __future__ import annotations

import json
import os
import re
import tempfile

import torch
from safetensors.torch import save_file

from dspark.drafters.base import Drafter

RULES: dict[str, list[str]] = {
    "dflash": [r"fc\.weight", r"hidden_norm\.weight", r"norm\.weight",
               r"layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
               r"layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight",
               r"layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight"],
    "eagle3": [r"fc\.weight", r"norm\.weight",
               r"midlayer\.(input_layernorm|hidden_norm|post_attention_layernorm)\.weight",
               r"midlayer\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight",
               r"midlayer\.mlp\.(gate_proj|up_proj|down_proj)\.weight"],
}
RULES["dspark"] = RULES["dflash"] + [r"markov_head\.markov_w[12]\.weight", r"confidence_head\.proj\.(weight|bias)"]
VOCAB_MAPS = [r"d2t", r"t2d"]  # draft vocabulary maps, every algorithm (present only with draft_vocab_size)
SPECIAL = {"mask_embedding"}  # handled by expand_vocab()
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "eagle3": "Eagle3LlamaForCausalLM"}


def map_weights(drafter: Drafter, algo: str) -> dict[str, torch.Tensor]:
    """Rename every drafter weight by the algorithm's rules; raise listing every weight without one."""
    out, unmapped = {}, []
    for name, tensor in drafter.state_dict().items():
        if name in SPECIAL:
            continue
        if any(re.fullmatch(rule, name) for rule in RULES[algo] + VOCAB_MAPS):
            out[name] = tensor
        else:
            unmapped.append(name)
    if unmapped:
        hint = " (vLLM's dspark runtime serves only the Markov head; train with head=markov)" \
            if any(n.startswith("markov_head.joint_proj") for n in unmapped) else ""
        raise ValueError(f"cannot export to vLLM {algo}: no vLLM counterpart for weights {unmapped}{hint}")
    return out


def expand_vocab(drafter: Drafter, weights: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Learned MASK -> extra embedding row V. Returns (exported vocab_size, mask_token_id)."""
    V = drafter.vocab_size
    if drafter.config.mask_token_id is not None:
        return V, drafter.config.mask_token_id
    embedding = drafter.target.embed_tokens.weight.detach().to(drafter.mask_embedding.device)
    mask = drafter.mask_embedding.detach().to(embedding.dtype)
    weights["embed_tokens.weight"] = torch.cat([embedding, mask.unsqueeze(0)], dim=0)
    if "t2d" in weights:  # the MASK id is never drafted
        weights["t2d"] = torch.cat([weights["t2d"], weights["t2d"].new_zeros(1)])
    w1 = weights.get("markov_head.markov_w1.weight")
    if w1 is not None:  # the MASK id is never a previous token; its row is never read
        weights["markov_head.markov_w1.weight"] = torch.cat([w1, w1.new_zeros(1, w1.shape[1])], dim=0)
    return V + 1, V


def layer_config(drafter: Drafter, algo: str, vocab_size: int) -> dict:
    c = drafter.config
    return {"model_type": "llama" if algo == "eagle3" else "qwen3",
            "hidden_size": drafter.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "vocab_size": vocab_size, "max_position_embeddings": _max_positions(drafter),
            "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"}, "rope_theta": c.rope_theta,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}


def _max_positions(drafter: Drafter) -> int:
    target = drafter._target
    return int(getattr(target, "max_positions", 0) or 32768) if target is not None else 32768


def _verifier(drafter: Drafter) -> dict:
    target = drafter._target
    archs = list(getattr(target.model.config, "architectures", None) or []) if target is not None else []
    return {"name_or_path": drafter.target_meta.get("name", ""), "architectures": archs}


def export_config(drafter: Drafter, algo: str, vocab_size: int, mask_token_id: int | None) -> dict:
    c = drafter.config
    aux = [i + 1 for i in drafter.layer_ids]
    cfg = {"architectures": [ARCHITECTURES[algo]], "speculators_model_type": algo,
           "speculators_config": {"algorithm": algo, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size}],
                                  "verifier": _verifier(drafter)},
           "transformer_layer_config": layer_config(drafter, algo, vocab_size),
           "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.hidden_size,
           "dspark_calibration": drafter.calibration}
    if algo == "eagle3":
        cfg.update(eagle_aux_hidden_state_layer_ids=aux, norm_before_residual=True)
        return cfg
    cfg.update(aux_hidden_state_layer_ids=aux, mask_token_id=mask_token_id,
               block_size=c.block_size + (1 if algo == "dflash" else 0))
    if algo == "dspark":
        has_markov = drafter.markov_head is not None
        cfg.update(sample_from_anchor=True, markov_rank=c.rank, markov_head_type="vanilla",
                   enable_confidence_head=drafter.confidence_head is not None,
                   confidence_head_with_markov=has_markov)
    return cfg


def check_exportable(drafter: Drafter, algo: str) -> None:
    if algo != drafter.algo:
        raise ValueError(f"a {drafter.algo} drafter cannot be exported as vLLM {algo}; use method={drafter.algo!r}")
    if algo == "eagle3" and len(drafter.layer_ids) != 3:
        raise ValueError(f"vLLM eagle3 fuses exactly 3 target layers; this drafter uses {len(drafter.layer_ids)}")
    if algo == "dspark" and drafter.markov_head is None:
        raise ValueError("vLLM's dspark runtime needs the Markov head; a head='none' drafter cannot be exported")


def export_vllm(drafter: Drafter, out_dir: str, method: str | None = None, *,
                dtype: torch.dtype | None = None) -> str:
    """Write `out_dir` (local or s3://) as a vLLM speculators checkpoint; returns out_dir."""
    drafter = getattr(drafter, "module", drafter)
    algo = method or drafter.algo
    if algo not in RULES:
        raise ValueError(f"unknown vLLM method {algo!r}; choose dspark, dflash or eagle3")
    check_exportable(drafter, algo)
    weights = map_weights(drafter, algo)
    if drafter.draft_ids is not None:  # vLLM shares the target head only for a full draft vocabulary
        weights["lm_head.weight"] = drafter._draft_head()[0].detach()
    vocab_size, mask_id = (drafter.vocab_size, None) if algo == "eagle3" else expand_vocab(drafter, weights)
    config = export_config(drafter, algo, vocab_size, mask_id)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
               for k, v in weights.items()}  # d2t / t2d keep int64 / bool
    if str(out_dir).startswith("s3://"):
        from dspark import storage

        with tempfile.TemporaryDirectory(prefix="dspark-vllm-") as tmp:
            _write(tmp, tensors, config)
            storage.upload_dir(tmp, out_dir)
    else:
        _write(str(out_dir), tensors, config)
    return str(out_dir)


def _write(out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
