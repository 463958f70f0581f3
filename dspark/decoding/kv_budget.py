"""The KV memory a batch of generations will need, checked before the first token rather than found out of
memory hours into a rollout of long answers.

A target keeps, per token and layer, one key and one value of `kv_heads × head_dim` numbers. A batch of `rows`
sequences of up to `tokens` tokens each therefore needs rows · tokens · layers · 2 · kv_heads · head_dim · bytes
(the decoding core and the ragged store both hold every slot at the batch's longest length). Refused when that
exceeds `fraction` of the memory free on the target's device.
"""
from __future__ import annotations

import torch

GIB = 2**30


def kv_bytes_per_token(target) -> int:
    cfg = target.model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = torch.empty((), dtype=target.dtype).element_size()
    return target.num_layers * 2 * kv_heads * head_dim * element


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def check_kv_fits(target, rows: int, tokens: int, fraction: float = 0.8, free: int | None = None) -> int:
    """Bytes of KV for `rows` sequences of up to `tokens` tokens; ValueError naming the knobs when they exceed
    `fraction` of the free memory (`free`, default: what the target's device has free now)."""
    need = rows * tokens * kv_bytes_per_token(target)
    free = free_bytes(target.device) if free is None else free
    if need > fraction * free:
        fit_rows = int(fraction * free // max(1, tokens * kv_bytes_per_token(target)))
        raise ValueError(f"the KV store for {rows} sequences of up to {tokens} tokens needs {need / GIB:.1f} GiB, more "
                         f"than {fraction:.0%} of the {free / GIB:.1f} GiB free on {target.device}: lower the batch "
                         f"(generator max_batch; {fit_rows} rows fit) or max_new_tokens")
    return need
