"""Export a trained drafter as a speculators-format checkpoint (config.json + model.safetensors), in
one of two flavors:

- "vllm": what vLLM's speculators loaders read (`vllm serve TARGET --speculative-config
  '{"model": OUT_DIR}'`; method and γ come from the config). vLLM's DFlash/DSpark drafters take
  `embed_tokens` from the checkpoint when it has one, so a learned MASK vector can be carried.
- "speculators": what the `speculators` library (0.9) loads with `SpeculatorModel.from_pretrained`
  (to fine-tune or convert further). It always reloads `embed_tokens` from the verifier, so the
  MASK must be a verifier vocabulary row; it does serve the DSpark RNN head, which vLLM does not.

Config fields written (all algorithms): speculators_model_type, speculators_config {algorithm,
proposal_methods=[{proposal_type: "greedy", speculative_tokens: γ}], default_proposal_method,
verifier {name_or_path, architectures}}, transformer_layer_config (qwen3 for dflash/dspark, llama for
eagle3), draft_vocab_size, target_hidden_size, dspark_calibration (STS temperatures),
dspark_draft_temperature (Drafter.draft_sampling; dspark serving only), dspark_export
(ours: flavor, our layer ids, how the MASK was placed; engines ignore it).
- dflash: aux_hidden_state_layer_ids, mask_token_id, block_size = γ+1, sample_from_anchor = false
  (slot 0 holds the anchor, slot j predicts token t+j: our DFlash layout).
- dspark: the dflash fields with block_size = γ, sample_from_anchor = true (slot k-1 predicts t+k,
  the previous token of slot 0 is the anchor: our DSpark layout), markov_rank (0 = no head),
  markov_head_type ("vanilla" = our head="markov", "rnn" = ours), enable_confidence_head,
  confidence_head_with_markov.
- eagle3: eagle_aux_hidden_state_layer_ids, norm_before_residual = true.
- a context window (DrafterConfig.context_window W): transformer_layer_config.sliding_window = W and
  layer_types = ["sliding_attention"] * layers, sliding_window_non_causal = true (speculators' DFlash
  fields: a block anchored at t sees the context t-W .. t-1, bidirectional inside the block).

Layer indexing: our layer id i is the output of target decoder layer i (HF hidden_states[i+1]).
speculators and vLLM count hidden_states index 0 as the embeddings (aux id a = the input of decoder
layer a), so aux = i + 1; vLLM's DFlash model derives dflash_config.target_layer_ids = aux - 1 = i.
Our last layer's feature is HF's post-norm output, which no engine captures: exporting a drafter that
uses the target's last layer fails naming target_layer_ids.

MASK token (DFlash/DSpark). DrafterConfig.mask_token_id set: that vocabulary row, nothing extra is
written. A learned MASK vector (mask_token_id None), vllm flavor only: if the tokenizer reserves an
id (its mask token, else the first embedding row past the tokenizer's vocabulary, e.g. 151669 for
Qwen3, as DeepSpec uses) embed_tokens = the target embedding with that row set to the MASK vector;
otherwise one row is added (vocab_size = V+1, mask_token_id = V: vLLM's "expanded input vocab",
which its loader accepts when the checkpoint has embed_tokens; markov_w1 gets a zero row there, an
id that is never a previous token).

Weight mapping (ours -> checkpoint name; layer-internal names are already the engines'):
  dflash / dspark: fc, hidden_norm, layers.{i}.{input_layernorm, post_attention_layernorm,
    self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}, norm -> same
    (vLLM stacks q/k/v and gate/up on load); mask_embedding -> embed_tokens (see above)
  dspark: markov_head.markov_w{1,2}, confidence_head.proj.{weight,bias} -> same;
    markov_head.joint_proj.{weight,bias} (RNN) -> same (speculators flavor only)
  eagle3: fc (m·d -> d), midlayer.{input_layernorm, hidden_norm, post_attention_layernorm,
    self_attn.*, mlp.*}, norm -> layers.0.* (speculators' and vLLM's name for the one layer)
Reduced draft vocabulary (drafter config draft_vocab_size < V with `d2t`/`t2d` buffers): d2t is
written as speculators' offsets (target id = draft id + d2t[draft id]), t2d as a bool mask over the
target vocabulary, and lm_head.weight = the target LM head's rows of the draft tokens (both engines
need it; they cannot slice the target head). Otherwise the target LM head is shared and not written,
except for speculators-flavor Eagle3, whose loader reads lm_head from the checkpoint (the full head).
Any drafter weight without a rule is an error naming it.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from typing import Literal

import torch
from safetensors.torch import save_file

from dspark.drafters.base import Drafter
from dspark.export.algos import ALGORITHMS

Flavor = Literal["vllm", "speculators"]
SPECIAL = {"mask_embedding", "d2t", "t2d"}  # handled by place_mask() / draft_vocab()
HEAD_TYPES = {"markov": "vanilla", "rnn": "rnn"}


class ExportError(ValueError):
    """The drafter's shape cannot be expressed in the requested format; the message names the field."""


# ---- checks -----------------------------------------------------------------------------------------
def check_exportable(drafter: Drafter, algo: str, flavor: Flavor = "vllm") -> None:
    if algo != drafter.algo:
        raise ExportError(f"a {drafter.algo} drafter cannot be exported as vLLM {algo}; use method={drafter.algo!r}")
    spec, c = ALGORITHMS[algo], drafter.config
    check_layer_ids(drafter, "speculators/vLLM")
    fused = spec.fused_layers
    if flavor == "vllm" and fused is not None and len(drafter.layer_ids) != fused:
        raise ExportError(f"target_layer_ids: vLLM {algo} fuses exactly {fused} target layers; this drafter uses "
                          f"{len(drafter.layer_ids)} ({drafter.layer_ids})")
    if spec.markov_head_fields and flavor == "vllm" and c.head != "markov":
        hint = " (markov_head.joint_proj has no vLLM counterpart)" if c.head == "rnn" else ""
        raise ExportError(f"head={c.head!r}: vLLM's {algo} runtime serves only the Markov head (head='markov')"
                          f"{hint}; export --format speculators, or train with head=markov")
    if spec.masked_block and flavor == "speculators" and c.mask_token_id is None:
        raise ExportError("mask_token_id: this drafter learned its own MASK vector (mask_token_id=None), but "
                          "speculators' DFlash/DSpark always reload embed_tokens from the verifier, so the MASK "
                          "must be a verifier vocabulary row. Export --format vllm (which carries embed_tokens), "
                          "or train with mask_token_id set to a reserved token id")


def check_layer_ids(drafter: Drafter, fmt: str) -> None:
    """Our id num_layers-1 is HF's final, post-norm hidden state; engines capture pre-norm residuals."""
    n = drafter.target_meta.get("num_layers")
    if n is not None and int(n) - 1 in drafter.layer_ids:
        raise ExportError(f"target_layer_ids {drafter.layer_ids} include the target's last layer ({int(n) - 1}): "
                          f"its feature here is the post-norm final hidden state, which {fmt} engines do not "
                          f"capture; train with layer ids below {int(n) - 1}")


# ---- weights ----------------------------------------------------------------------------------------
def map_weights(drafter: Drafter, algo: str, rename: bool = True) -> dict[str, torch.Tensor]:
    """Every drafter weight the algorithm's rules cover, a single decoder layer renamed to speculators'
    `layers.0.` (unless rename=False: SGLang keeps ours); raise listing every weight without a rule."""
    spec = ALGORITHMS[algo]
    prefix = spec.one_layer_prefix if rename else None
    out, unmapped = {}, []
    for name, tensor in drafter.state_dict().items():
        if name in SPECIAL:
            continue
        if any(re.fullmatch(rule, name) for rule in spec.weights):
            out[name.replace(prefix, "layers.0.", 1) if prefix else name] = tensor
        else:
            unmapped.append(name)
    if unmapped:
        raise ExportError(f"cannot export {algo}: no counterpart for weights {unmapped}")
    return out


def reserved_mask_id(target) -> int | None:
    """An id the tokenizer reserves and never produces from text: its mask token, else the first
    embedding row past the tokenizer's vocabulary (padding rows). None when there is neither."""
    tok = getattr(target, "tokenizer", None)
    if tok is None:
        return None
    if getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    rows = target.embed_tokens.weight.shape[0]
    return len(tok) if len(tok) < rows else None


MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's DFlash override file (qwen3_dflash.py _read_mask_embedding)


def place_mask(drafter: Drafter, weights: dict[str, torch.Tensor], algo: str,
               flavor: Flavor) -> tuple[int, int, str, dict[str, object]]:
    """Where the MASK lives in the export -> (exported input vocab size, mask_token_id, how, extra files).
    A learned MASK vector of a DFlash drafter goes into vLLM's `mask_embedding.pt` override ({mask_token_id,
    embedding}: vLLM substitutes it for the embedding of that id) when the tokenizer reserves an id; vLLM's
    DSpark loader ignores that file, so DSpark (and a target without a reserved id) carries embed_tokens."""
    V = drafter.vocab_size
    if drafter.config.mask_token_id is not None:
        return V, drafter.config.mask_token_id, "drafter_config.mask_token_id", {}
    embedding = drafter.target.embed_tokens.weight.detach().to(drafter.mask_embedding.device)
    mask = drafter.mask_embedding.detach().to(embedding.dtype)
    reserved = reserved_mask_id(drafter.target)
    if reserved is not None and ALGORITHMS[algo].vllm_mask_file and flavor == "vllm":
        return V, reserved, MASK_EMBEDDING_FILE, {MASK_EMBEDDING_FILE: {"mask_token_id": reserved, "embedding": mask}}
    if reserved is not None:  # a row no text ever maps to: replacing it changes no real token's input
        table = embedding.clone()
        table[reserved] = mask
        weights["embed_tokens.weight"] = table
        return V, reserved, "reserved tokenizer id", {}
    weights["embed_tokens.weight"] = torch.cat([embedding, mask.unsqueeze(0)], dim=0)
    w1 = weights.get("markov_head.markov_w1.weight")
    if w1 is not None:  # the MASK id is never a previous token; its row is never read
        weights["markov_head.markov_w1.weight"] = torch.cat([w1, w1.new_zeros(1, w1.shape[1])], dim=0)
    return V + 1, V, "added row", {}


def draft_token_ids(drafter: Drafter) -> torch.Tensor | None:
    """Target ids of the draft vocabulary, ascending (draft id j <-> target id ids[j]); None for a
    full-vocabulary drafter. Accepts d2t as absolute target ids or as speculators' offsets, checked
    against t2d (bool mask, or target->draft index with -1 for absent tokens)."""
    size = getattr(drafter.config, "draft_vocab_size", None)
    d2t, t2d = getattr(drafter, "d2t", None), getattr(drafter, "t2d", None)
    if size is None or int(size) == drafter.vocab_size:
        return None
    if d2t is None or t2d is None:
        raise ExportError(f"draft_vocab_size={size} but the drafter has no d2t/t2d buffers to map draft ids "
                          "to target ids")
    present = t2d.bool() if t2d.dtype == torch.bool else t2d >= 0
    ids = present.nonzero().flatten().cpu()
    d2t = d2t.long().cpu()
    for candidate in (d2t, d2t + torch.arange(d2t.numel())):
        if candidate.numel() == ids.numel() == int(size) and torch.equal(candidate, ids):
            return ids
    raise ExportError(f"d2t: the draft-to-target map ({d2t.numel()} ids) does not list the {ids.numel()} tokens "
                      f"t2d marks in ascending order (draft_vocab_size={size}); the speculators layout needs "
                      "draft id j <-> the j-th smallest target id")


def draft_vocab(drafter: Drafter, weights: dict[str, torch.Tensor]) -> int:
    """Write d2t/t2d/lm_head for a reduced draft vocabulary; returns draft_vocab_size."""
    ids = draft_token_ids(drafter)
    if ids is None:
        return drafter.vocab_size
    w2 = weights.get("markov_head.markov_w2.weight")
    if w2 is not None and w2.shape[0] != ids.numel():
        raise ExportError(f"markov_head.markov_w2 has {w2.shape[0]} rows but draft_vocab_size={ids.numel()}: the "
                          "engines add the Markov bias in the draft vocabulary")
    weights["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(drafter.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    weights["t2d"] = t2d
    weights["lm_head.weight"] = drafter.target.lm_head.weight.detach()[ids.to(drafter.target.device)]
    return int(ids.numel())


# ---- config -----------------------------------------------------------------------------------------
def layer_config(drafter: Drafter, algo: str, vocab_size: int) -> dict:
    c = drafter.config
    return {"model_type": ALGORITHMS[algo].layer_model_type,
            "hidden_size": drafter.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "vocab_size": vocab_size, "max_position_embeddings": max_positions(drafter),
            "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"}, "rope_theta": c.rope_theta,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            **window_fields(c)}


def window_fields(c) -> dict:
    """A context window as speculators writes one: every layer a sliding_attention layer of that window."""
    if c.context_window is None:
        return {}
    return {"sliding_window": c.context_window, "layer_types": ["sliding_attention"] * c.depth}


def max_positions(drafter: Drafter) -> int:
    target = drafter._target
    return int(getattr(target, "max_positions", 0) or 32768) if target is not None else 32768


def verifier_path(drafter: Drafter) -> str:
    """A name speculators/vLLM can open: a hub id as given, else the target's local directory
    (built-in targets such as "tiny" live in the dspark cache)."""
    name = str(drafter.target_meta.get("name", ""))
    target = drafter._target
    local = getattr(getattr(target, "model", None), "name_or_path", "") if target is not None else ""
    from dspark.models import builtin as models_builtin

    if local and (name in models_builtin.BUILTIN or name.startswith("s3://") or os.path.isdir(name)):
        return str(local)
    return name


def is_local_path(name: str) -> bool:
    """A verifier name only this machine can open (an absolute or existing local path), not a hub id."""
    return os.path.isabs(name) or os.path.exists(name) or name.startswith(("./", "../", "~"))


class LocalVerifierWarning(UserWarning):
    """The export names its verifier by a path on this machine; another machine cannot open it."""


def verifier(drafter: Drafter, name: str | None) -> dict:
    target = drafter._target
    archs = list(getattr(target.model.config, "architectures", None) or []) if target is not None else []
    path = name or verifier_path(drafter)
    if path and is_local_path(path):
        warnings.warn(f"speculators_config.verifier.name_or_path is the local path {path!r}: vLLM/speculators on "
                      "another machine cannot open it; pass --verifier <hub id or path there> (--portable makes "
                      "that required)", LocalVerifierWarning, stacklevel=3)
    return {"name_or_path": path, "architectures": archs}


def export_config(drafter: Drafter, algo: str, vocab_size: int, mask: tuple[int, str] | None,
                  draft_vocab_size: int, flavor: Flavor, verifier_name: str | None = None) -> dict:
    c = drafter.config
    aux = [i + 1 for i in drafter.layer_ids]
    if drafter.draft_temperature != 1.0:
        warnings.warn(f"the drafter's draft_temperature {drafter.draft_temperature} is a dspark setting: vLLM and "
                      "speculators draft at the request's temperature (kept as dspark_draft_temperature)")
    cfg = {"architectures": [ALGORITHMS[algo].speculators_arch], "speculators_model_type": algo,
           "speculators_config": {"algorithm": algo, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size}],
                                  "verifier": verifier(drafter, verifier_name)},
           "transformer_layer_config": layer_config(drafter, algo, vocab_size),
           "draft_vocab_size": draft_vocab_size, "target_hidden_size": drafter.hidden_size,
           "dspark_calibration": drafter.calibration,
           "dspark_draft_temperature": drafter.draft_temperature,  # vLLM drafts at the request's temperature
           "dspark_export": {"flavor": flavor, "algo": algo, "target_layer_ids": drafter.layer_ids,
                             "layer_id_convention": "ours = output of decoder layer i; aux ids = i + 1",
                             "block_size_gamma": c.block_size,
                             "mask": None if mask is None else {"id": mask[0], "placed_by": mask[1]}}}
    cfg.update(layout_fields(drafter, algo, aux, mask))
    return cfg


def layout_fields(drafter: Drafter, algo: str, aux: list[int], mask: tuple[int, str] | None) -> dict:
    """The algorithm's own config fields: Eagle3's fused layers, or the MASK block (+ DSpark's heads)."""
    spec = ALGORITHMS[algo]
    if not spec.masked_block:
        return {"eagle_aux_hidden_state_layer_ids": aux, "norm_before_residual": True}
    fields = {"aux_hidden_state_layer_ids": aux, "mask_token_id": mask[0],
              "sample_from_anchor": spec.sample_from_anchor, "block_size": spec.block_size(drafter.config.block_size)}
    if drafter.config.context_window is not None:
        fields["sliding_window_non_causal"] = True  # bidirectional inside the block, as it was trained
    if spec.markov_head_fields:
        fields.update(speculators_head_fields(drafter))
    return fields


def speculators_head_fields(drafter: Drafter) -> dict:
    """speculators' DSpark head fields; markov_rank 0 = no Markov head."""
    c, has_head, has_conf = drafter.config, drafter.markov_head is not None, drafter.confidence_head is not None
    return {"markov_rank": c.rank if has_head else 0, "markov_head_type": HEAD_TYPES.get(c.head, "vanilla"),
            "enable_confidence_head": has_conf, "confidence_head_with_markov": has_head and has_conf}


# ---- engine versions --------------------------------------------------------------------------------
# What each layout needs from the engine that loads it, as read in the engines' source (README "Export").
# "min_version" is the oldest release known to have the feature, not necessarily the first one with it;
# "silent": older builds load the export without an error but misread it (dspark export warns).
VLLM_SAMPLE_FROM_ANCHOR = {
    "engine": "vllm", "min_version": "0.27.1", "silent": True,
    "feature": "reads sample_from_anchor from speculators configs (vllm-project/vllm#48639, merged 2026-07-16; "
               "0.27.1 reads it per vllm-project/vllm#56792)",
    "older": "older vLLM builds load a speculators DSpark checkpoint in the bonus-anchor (DFlash 1+N) layout and "
             "ignore sample_from_anchor: this anchor-first export then loads without error and accepts almost "
             "nothing (tau ~ 1)"}
VLLM_MASK_EMBEDDING = {
    "engine": "vllm", "min_version": None, "silent": True,
    "feature": "reads the DFlash mask_embedding.pt override (vllm-project/vllm#46104, merged 2026-06-18; "
               "qwen3_dflash.py _read_mask_embedding); the first release with it was not determined here",
    "older": "older vLLM builds ignore mask_embedding.pt and embed the MASK slots with the verifier's row "
             "mask_token_id, which this drafter was not trained with (low acceptance, no error)"}
SPECULATORS_ANCHOR = {
    "engine": "speculators", "min_version": "0.9.0", "silent": False,
    "feature": "sample_from_anchor in DFlash/DSpark configs (vllm-project/speculators#760); 0.9.0 is the "
               "version tests/test_export_parity.py loads",
    "older": "older speculators releases do not know sample_from_anchor"}


def requirements(algo: str, flavor: Flavor, extras: dict[str, object]) -> list[dict]:
    """The engine features this export depends on (written to dspark_export.requires)."""
    spec = ALGORITHMS[algo]
    if flavor == "speculators":
        return [SPECULATORS_ANCHOR] if spec.masked_block else []
    out = [VLLM_SAMPLE_FROM_ANCHOR] if spec.sample_from_anchor else []
    return out + ([VLLM_MASK_EMBEDDING] if MASK_EMBEDDING_FILE in extras else [])


# ---- entry point ------------------------------------------------------------------------------------
def export_vllm(drafter: Drafter, out_dir: str, method: str | None = None, *, dtype: torch.dtype | None = None,
                flavor: Flavor = "vllm", verifier_name: str | None = None) -> str:
    """Write `out_dir` (local or s3://) as a speculators-format checkpoint; returns out_dir."""
    drafter = getattr(drafter, "module", drafter)
    algo = method or drafter.algo
    spec = ALGORITHMS.get(algo)
    if spec is None:
        raise ExportError(f"unknown method {algo!r}; choose dspark, dflash or eagle3")
    if flavor not in ("vllm", "speculators"):
        raise ExportError(f"unknown flavor {flavor!r}; choose vllm or speculators")
    check_exportable(drafter, algo, flavor)
    weights = map_weights(drafter, algo)
    draft_size = draft_vocab(drafter, weights)
    if flavor == "speculators" and spec.lm_head_in_checkpoint and "lm_head.weight" not in weights:
        # speculators' Eagle3 loads lm_head from the checkpoint (only DFlash/DSpark re-derive it)
        weights["lm_head.weight"] = drafter.target.lm_head.weight.detach()
    vocab_size, mask, extras = drafter.vocab_size, None, {}
    if spec.masked_block:
        vocab_size, mask_id, how, extras = place_mask(drafter, weights, algo, flavor)
        mask = (mask_id, how)
    if "t2d" in weights and weights["t2d"].numel() < vocab_size:  # an added MASK row is never a draft token
        pad = torch.zeros(vocab_size - weights["t2d"].numel(), dtype=torch.bool)
        weights["t2d"] = torch.cat([weights["t2d"], pad])
    config = export_config(drafter, algo, vocab_size, mask, draft_size, flavor, verifier_name)
    config["dspark_export"]["requires"] = requirements(algo, flavor, extras)
    write_checkpoint(out_dir, weights, config, dtype, extras)
    return str(out_dir)


def write_checkpoint(out_dir: str, weights: dict[str, torch.Tensor], config: dict,
                     dtype: torch.dtype | None = None, extras: dict[str, object] | None = None) -> None:
    """config.json + model.safetensors (+ `extras`: torch.save'd files) to a local dir or an s3:// prefix.
    Floating tensors (also inside extras) are cast to `dtype`; config.json records it as `torch_dtype`."""
    def cast(v: torch.Tensor) -> torch.Tensor:
        return (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()

    tensors = {k: cast(v) for k, v in weights.items()}
    files = {name: {k: cast(v) if isinstance(v, torch.Tensor) else v for k, v in obj.items()}
             for name, obj in (extras or {}).items()}
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    config = {**config, "torch_dtype": str(floating[0] if floating else torch.float32).removeprefix("torch.")}
    if str(out_dir).startswith("s3://"):
        from dspark.io import storage

        with tempfile.TemporaryDirectory(prefix="dspark-export-") as tmp:
            _write(tmp, tensors, config, files)
            storage.upload_dir(tmp, out_dir)
    else:
        _write(str(out_dir), tensors, config, files)


def _write(out_dir: str, tensors: dict[str, torch.Tensor], config: dict, files: dict[str, dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name, obj in files.items():
        torch.save(obj, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
