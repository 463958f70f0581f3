"""The reserved MASK token: a target vocabulary row that text never produces.

DFlash/DSpark feed γ-1 MASK slots after the anchor. Engines that take the embedding table from the
verifier (speculators, SGLang; vLLM too unless the checkpoint ships its own) embed those slots with
the verifier's row `mask_token_id`, so a drafter is portable exactly when its MASK is such a row.
DeepSpec and speculators use an id the tokenizer reserves (Qwen3: 151669, the first padding row);
`mask_token_id: reserved` in a drafter config picks one by the same rule (`reserved_token_id`).
"""
from __future__ import annotations


def reserved_token_id(target) -> int | None:
    """An embedding row no chat text maps to, in order of preference:
    1. the tokenizer's mask token;
    2. the first embedding row past the tokenizer's vocabulary (padding rows, e.g. Qwen3's 151669);
    3. the highest-id special token that is not BOS/EOS and that the chat template never writes
       (SmolLM2: 16 `<empty_output>`; the built-in tiny target: 0 `<|endoftext|>`).
    None when the target has no tokenizer or no such row."""
    tok = getattr(target, "tokenizer", None)
    if tok is None:
        return None
    if getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    rows = int(target.embed_tokens.weight.shape[0])
    if len(tok) < rows:
        return len(tok)
    template = str(getattr(tok, "chat_template", None) or "")
    excluded = {tok.bos_token_id, tok.eos_token_id, *getattr(target, "eos_token_ids", ())}
    candidates = [i for i, added in getattr(tok, "added_tokens_decoder", {}).items()
                  if added.special and i < rows and i not in excluded and added.content not in template]
    return max(candidates) if candidates else None
