"""What the export layouts need to know about each drafter algorithm, looked up by its name.

vllm.py and sglang.py branch on these capabilities, never on the algorithm's name, so a new
algorithm is one more ALGORITHMS entry (its weight rules, engine class names and layout traits).
"""
from __future__ import annotations

from dataclasses import dataclass

_LAYER = (r"(input_layernorm|post_attention_layernorm)\.weight",
          r"self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight",
          r"mlp\.(gate_proj|up_proj|down_proj)\.weight")
_BLOCK_WEIGHTS = (r"fc\.weight", r"hidden_norm\.weight", r"norm\.weight") + tuple(r"layers\.\d+\." + p for p in _LAYER)
_MARKOV_WEIGHTS = (r"markov_head\.markov_w[12]\.weight", r"confidence_head\.proj\.(weight|bias)",
                   r"markov_head\.joint_proj\.(weight|bias)")
_EAGLE3_WEIGHTS = (r"fc\.weight", r"norm\.weight", r"midlayer\.hidden_norm\.weight") + tuple(
    r"midlayer\." + p for p in _LAYER)


@dataclass(frozen=True)
class AlgoExport:
    """One algorithm's export traits (the engines' names for its model, and how its layout differs)."""
    title: str  # the algorithm as the engines' documentation spells it (error messages)
    weights: tuple[str, ...]  # regexes (fullmatch) of the drafter weights that have an engine counterpart
    speculators_arch: str  # config architectures[0] for speculators / vLLM
    sglang_arch: str  # SGLang's draft-model class
    layer_model_type: str  # transformer_layer_config.model_type
    masked_block: bool = False  # drafts a block of MASK slots (DFlash family): the export must place the MASK
    anchor_slot: bool = False  # block slot 0 holds the anchor (γ+1 slots), else anchor-first (γ slots)
    markov_head_fields: bool = False  # config carries the Markov / confidence head fields (the head may be absent)
    fused_layers: int | None = None  # the engines' fc fuses exactly this many target layers (None: any number)
    one_layer_prefix: str | None = None  # our name of the single decoder layer; speculators/vLLM call it layers.0.
    vllm_mask_file: bool = False  # vLLM's loader reads a learned MASK vector from mask_embedding.pt
    lm_head_in_checkpoint: bool = False  # speculators' loader reads lm_head from the checkpoint, even a full one
    sglang_draft_vocab: bool = False  # SGLang's loader accepts a reduced draft vocabulary

    def block_size(self, gamma: int) -> int:
        """Slots per drafted block: the anchor slot plus γ MASK slots, or γ slots anchor-first."""
        return gamma + (1 if self.anchor_slot else 0)

    @property
    def sample_from_anchor(self) -> bool:
        """speculators' flag for the anchor-first block (slot k-1 predicts t+k)."""
        return self.masked_block and not self.anchor_slot


ALGORITHMS: dict[str, AlgoExport] = {
    "dspark": AlgoExport("DSpark", _BLOCK_WEIGHTS + _MARKOV_WEIGHTS, "DSparkSpeculator", "Qwen3DSparkModel", "qwen3",
                         masked_block=True, markov_head_fields=True),
    "dflash": AlgoExport("DFlash", _BLOCK_WEIGHTS, "DFlashSpeculator", "DFlashDraftModel", "qwen3",
                         masked_block=True, anchor_slot=True, vllm_mask_file=True),
    "eagle3": AlgoExport("Eagle3", _EAGLE3_WEIGHTS, "Eagle3Speculator", "LlamaForCausalLMEagle3", "llama",
                         fused_layers=3, one_layer_prefix="midlayer.", lm_head_in_checkpoint=True,
                         sglang_draft_vocab=True),
}
