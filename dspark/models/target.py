"""Target adapter: any Hugging Face causal LM behind one small, frozen interface.

The drafters need four things from a target: its frozen token embedding, its frozen LM head, the
hidden states of a few chosen layers (the drafter's context features) and the final normed hidden
state (to get target distributions only where they are needed). `Target.forward` returns exactly
those, with an optional KV cache for decoding.

Layer id i (0-based) is the output of decoder layer i, i.e. HF `hidden_states[i + 1]`.
"""
from __future__ import annotations

import functools
import inspect
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from dspark.models import builtin as models_builtin
from dspark.models.precision import bf16_is_native  # noqa: F401  (kept importable here)
from dspark.models.small_batch_linear import use_small_batch_linear


@dataclass
class TargetOutput:
    features: Tensor | None  # [B, T, m*d] selected layers, concatenated in layer_ids order
    final_hidden: Tensor  # [B, T, d] after the final norm
    logits: Tensor | None  # [B, T', V] where asked
    cache: Any  # DynamicCache or None


def spread_layer_ids(num_layers: int, m: int) -> list[int]:
    """m layer ids spread evenly over the depth, never the last layer (its output is the LM head's input)."""
    if num_layers < 2:
        raise ValueError(f"target has {num_layers} layer(s); need at least 2 to pick context layers")
    roomy = num_layers >= m + 3
    lo, hi = (1, num_layers - 3) if roomy else (0, num_layers - 2)
    if m == 1:
        return [hi]
    ids = [round(lo + i * (hi - lo) / (m - 1)) for i in range(m)]
    return sorted(set(ids))


class Target:
    """A frozen causal LM with the accessors drafters need."""

    shards = 1  # > 1: its decoder layers are partitioned across that many ranks (dspark.models.sharded_target)

    def __init__(self, model, tokenizer, name: str, revision: str = ""):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        use_small_batch_linear(self.model)  # CPU verify passes of a few tokens: dspark/models/small_batch_linear.py
        self.tokenizer = tokenizer
        self.name = name
        self.revision = revision
        cfg = model.config
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.num_layers: int = cfg.num_hidden_layers
        self.max_positions: int = getattr(cfg, "max_position_embeddings", 4096)
        self.sliding_window: int | None = sliding_window_of(cfg)
        capped = [k for k in ("final_logit_softcapping", "attn_logit_softcapping") if getattr(cfg, k, None)]
        if capped:
            raise NotImplementedError(f"{type(model).__name__}: {capped} (logit soft-capping, e.g. Gemma 2) is not "
                                      f"applied by dspark's LM-head and attention paths; such a target is not supported")

    # ---- properties -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        for source in (eos, getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer else None):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return sorted(ids)

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        if tok is not None and tok.pad_token_id is not None:
            return tok.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def meta(self) -> dict:
        return {"name": self.name, "revision": self.revision, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "num_layers": self.num_layers}

    def default_layer_ids(self, m: int = 3) -> list[int]:
        return spread_layer_ids(self.num_layers, m)

    # ---- math ---------------------------------------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        return self.embed_tokens(ids)

    def lm_logits(self, final_hidden: Tensor) -> Tensor:
        # hidden states may come from a cache or a drafter in another precision than the head's
        return self.lm_head(final_hidden.to(self.lm_head.weight.dtype))

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @staticmethod
    def cache_length(cache) -> int:
        return 0 if cache is None else int(cache.get_seq_length())

    def crop_cache(self, cache, length: int) -> None:
        """Keep the first `length` positions of the cache (drop rejected draft tokens)."""
        drop = self.cache_length(cache) - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {self.cache_length(cache)} positions to {length}")
        if drop:
            cache.crop(-drop)

    def keep_cache_path(self, cache, length: int, path: Tensor) -> None:
        """Keep the first `length` cache positions, then the positions `path` (ascending, all >= length) moved
        right behind them, and drop the rest: a verified tree's accepted path, compacted. Only the path's
        keys and values are copied (the prefix stays where it is)."""
        for layer in cache.layers:
            if not hasattr(layer, "keys") or getattr(layer, "is_sliding", False):
                raise NotImplementedError(f"{type(layer).__name__}: only full-attention dynamic caches can keep "
                                          f"a tree's path")
            index = path.to(layer.keys.device)
            for name in ("keys", "values"):
                full = getattr(layer, name)
                moved = full.index_select(-2, index)
                kept = full[..., : length + len(path), :]
                kept[..., length:, :] = moved
                setattr(layer, name, kept)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache=None, layer_ids: list[int] | None = None,
                logits_at: str | Tensor | None = "all", use_cache: bool = False) -> TargetOutput:
        """One pass of the frozen target; LM head only where `logits_at` asks
        ("all", "last", None, or a LongTensor of positions [B, K] / [K])."""
        cache_kw = _cache_kwarg(self.model.model)
        if cache is None and position_ids is None and attention_mask is not None and right_padded(attention_mask):
            attention_mask = None  # see right_padded: exact for the real tokens, and no [B, 1, T, T] mask is built
        with self._layer_outputs(layer_ids or []) as captured:
            out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache or cache is not None, **{cache_kw: cache})
        features = torch.cat([captured[i] for i in layer_ids], dim=-1) if layer_ids else None
        final = out.last_hidden_state
        logits = self._logits_at(final, logits_at)
        return TargetOutput(features=features, final_hidden=final, logits=logits,
                            cache=getattr(out, cache_kw) if (use_cache or cache is not None) else None)

    @contextmanager
    def _layer_outputs(self, layer_ids: list[int]):
        """The outputs of the `layer_ids` decoder layers during one forward (= hidden_states[i + 1]),
        through hooks on those layers only (`output_hidden_states=True` hooks and records every layer;
        the layers are never the last one, whose hidden_states entry HF may take after the final norm)."""
        captured: dict[int, Tensor] = {}
        layers = self.model.model.layers
        handles = [layers[i].register_forward_hook(
            lambda _module, _inputs, output, i=i: captured.__setitem__(i, output[0] if isinstance(output, tuple) else output))
            for i in dict.fromkeys(layer_ids)]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def _logits_at(self, final: Tensor, where) -> Tensor | None:
        if where is None:
            return None
        if isinstance(where, str):
            if where == "all":
                return self.lm_logits(final)
            if where == "last":
                return self.lm_logits(final[:, -1:])
            raise ValueError(f"logits_at must be 'all', 'last', None or a tensor, got {where!r}")
        idx = where if where.dim() == 2 else where.unsqueeze(0).expand(final.shape[0], -1)
        picked = torch.gather(final, 1, idx.unsqueeze(-1).expand(-1, -1, final.shape[-1]))
        return self.lm_logits(picked)

    # ---- text ---------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 template_kwargs: dict | None = None) -> list[int]:
        """Token ids of the rendered chat; template_kwargs: extra template variables, over the defaults
        (`chat_template_kwargs`)."""
        if self.tokenizer is None:
            raise ValueError(f"target {self.name} has no tokenizer")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **{**self.chat_template_kwargs, **(template_kwargs or {})})
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def chat_template_kwargs(self) -> dict:
        # Qwen3 "non-thinking" mode; templates that do not know the flag ignore it.
        return {"enable_thinking": False}

    @torch.no_grad()
    def generate(self, batch_ids: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> list[list[int]]:
        """Batched generation with left padding and KV cache; returns only the new tokens
        (trailing padding removed, the stop token kept)."""
        pad = self.pad_token_id
        width = max(len(ids) for ids in batch_ids)
        input_ids = torch.full((len(batch_ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(batch_ids):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        if seed is not None:
            torch.manual_seed(seed)
        kwargs: dict[str, Any] = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k or None)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new_tokens, pad_token_id=pad,
                                  eos_token_id=self.eos_token_ids or None, **kwargs)
        new = out[:, width:].tolist()
        return [_strip_after_stop(seq, set(self.eos_token_ids), pad) for seq in new]


def sliding_window_of(config) -> int | None:
    """The attention window of a target any of whose layers attend through one (Mistral's `sliding_window`,
    Qwen2's when `use_sliding_window`, Gemma's "sliding_attention" layers), else None. dspark's decoding paths
    attend to the whole context, which is exact up to the window: the engine caps its context there."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def right_padded(attention_mask: Tensor) -> bool:
    """Every row is its real tokens then padding. Causal attention alone then gives the real tokens exactly what
    the mask would (padding only ever follows them, so no real query can see it) at their own positions, while
    a padding mask makes transformers build a dense [B, 1, T, T] one: 2.3 GiB more at 2 × 16 k tokens, measured."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


@functools.lru_cache(maxsize=None)
def cache_kwarg_of(forward_cls: type) -> str:
    """The KV-cache argument name of a transformers module class's forward (base model or decoder layer)."""
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_kwarg(base_model) -> str:
    """The KV-cache argument (and output field) name of this transformers version's base models:
    `cache` in newer releases, `past_key_values` before. Passing the wrong one is silently ignored,
    so it is looked up, never guessed."""
    return cache_kwarg_of(type(base_model))


def _strip_after_stop(seq: list[int], stops: set[int], pad: int) -> list[int]:
    for i, tok in enumerate(seq):
        if tok in stops:
            return seq[: i + 1]
    while seq and seq[-1] == pad and pad not in stops:
        seq = seq[:-1]
    return seq


def resolve_model_path(spec: str, local_copy: Callable[[str], str] | None = None) -> str:
    """A local model directory for a built-in name or an s3:// dir (copied here by `local_copy`: the
    edges pass dspark.io.storage.local_copy); else the spec itself (a local dir, or a hub name that
    needs network or a mirror, HF_ENDPOINT)."""
    if spec in models_builtin.BUILTIN:
        return str(models_builtin.prepare(spec))
    if spec.startswith("s3://"):
        if local_copy is None:
            raise ValueError(f"target {spec!r} is an object-store directory: pass local_copy "
                             f"(dspark.io.storage.local_copy) to copy it here (the jobs and pipelines do)")
        return str(local_copy(spec))
    return spec


def load_target(spec: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                local_copy: Callable[[str], str] | None = None) -> Target:
    """Load a target by built-in name ("tiny", "smollm2-135m"), local dir, s3:// dir (needs
    `local_copy`, see resolve_model_path) or hub name."""
    from transformers import AutoModelForCausalLM

    name = spec
    path = resolve_model_path(spec, local_copy)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = tokenizer_of(path)
    except OSError as err:
        raise ValueError(f"cannot load target {spec!r}: {err}. Use 'tiny', 'smollm2-135m', a local "
                         f"model directory, an s3:// URI, or a hub name reachable from this machine.") from None
    revision = getattr(model.config, "_commit_hash", None) or models_builtin.revision_of(spec)
    return Target(model.to(device), tokenizer, name=name, revision=revision or "")


def tokenizer_of(path: str):
    """The tokenizer saved with a model; None for a local directory that holds none (a random test target)."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in files):
        return None
    return AutoTokenizer.from_pretrained(path)
