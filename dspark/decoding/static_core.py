"""The static-shape decoding core: one target step over a preallocated KV store, compiled per shape bucket.

One step appends N new tokens to each of R rows (rows = KV slots 0..R-1) and returns their logits and,
if asked, the target's context features. Everything the step needs is a tensor built once on the host
side of the call and then used on the device: the KV columns to write, the positions (RoPE), and the
attention layout. Nothing inside the step depends on Python values that change between calls, so the
step is traced once per bucket (R, N, KV window) and replayed: `torch.compile` (inductor; on CUDA
`mode="reduce-overhead"`, i.e. CUDA graphs over static KV buffers) or eager — the same function either
way (`mode`).

Layout of one step, row r with cached length s_r (= `starts[r]`):
- new token i is written at KV column s_r + i and stands at position s_r + depth[r, i] (depth = i for a
  chain; a node's depth in a tree of drafts);
- it sees every column < s_r (the verified prefix) and, among the new columns s_r + j, those with
  seen[r, i, j] (j <= i for a chain; its ancestors and itself for a tree);
- the attention window is the first `kv_len` columns, kv_len a power-of-two bucket >= max(s_r) + N.
Invariant (as in dspark.decoding.batched_cache): columns [0, length) of a slot hold exactly the verified
prefix of its sequence; later columns are stale (rejected drafts, padding) and never visible, so
dropping a rejected suffix is setting the length, and padding rows or tokens write only stale columns.

The step walks the HF decoder layers itself (embed -> layers -> norm -> LM head), handing each attention a
cache object whose `update` writes the new keys/values into the static store and returns the window:
the model's own attention (SDPA) then runs with the device-built boolean mask. Architectures whose base
model has `embed_tokens`, `layers`, `norm` and `rotary_emb` (Llama, Qwen2/3, Mistral, Qwen3-MoE, ...)
run here; others are refused with their class name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

DecodeCoreMode = Literal["auto", "compiled", "eager", "dynamic"]  # dynamic: HF's cache / the ragged store, no core
MIN_WINDOW = 128  # smallest KV window bucket
COMPILED_MAX_TOKENS = 64  # compiled steps take up to this many new tokens per row (bucketed); longer
# steps (prefills) run the same step eager: compute-bound anyway, and one graph per prompt length would not pay
_CAPACITY_CHUNK = 1024  # the KV store grows in these columns (a regrow retraces: rare)


def default_mode() -> str:
    """DSPARK_DECODE_CORE (auto | compiled | eager | dynamic); auto: compiled on CUDA, eager on CPU (measured:
    benchmarks/results/decode_core/); dynamic: batch-1 decoding on HF's DynamicCache instead of the core."""
    mode = os.environ.get("DSPARK_DECODE_CORE", "auto")
    if mode not in get_args(DecodeCoreMode):
        raise ValueError(f"DSPARK_DECODE_CORE must be auto, compiled, eager or dynamic, got {mode!r}")
    return mode


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in ("auto", "compiled", "eager"):
        raise ValueError(f"decode core mode must be auto, compiled or eager, got {mode!r}")
    if mode == "auto":
        return "compiled" if device.type == "cuda" else "eager"
    return mode


def window_bucket(need: int, capacity: int | None = None) -> int:
    """The KV window of a step: the smallest power of two >= need (>= MIN_WINDOW), at most capacity."""
    window = MIN_WINDOW
    while window < need:
        window *= 2
    return window if capacity is None else min(window, capacity)


def token_bucket(n: int) -> int:
    """New tokens per row of a compiled step: the next power of two (so verify and prefill steps of
    varying length share a few graphs)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class StepOut:
    logits: Tensor | None  # [R, K, V] at the picked new tokens (all N when pick is None)
    features: Tensor | None  # [R, N, m*d] outputs of the context layers, concatenated


class _StaticWriter:
    """The cache object one step hands to every attention: `update` writes this step's keys/values at
    their columns and returns the rows' KV window (HF attention modules call `cache.update`)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], slots: slice, columns: Tensor, window: int):
        self.keys, self.values, self.slots, self.columns, self.window = keys, values, slots, columns, window
        self.row_index = torch.arange(slots.start, slots.stop, device=columns.device)[:, None]  # [R, 1]

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        # key [R, Hkv, N, D] -> entries (r, :, columns[r, i]) of the [S, Hkv, L, D] store
        k_buf[self.row_index, :, self.columns] = key.transpose(1, 2).to(k_buf.dtype)
        v_buf[self.row_index, :, self.columns] = value.transpose(1, 2).to(v_buf.dtype)
        return k_buf[self.slots, :, : self.window], v_buf[self.slots, :, : self.window]

    def get_seq_length(self, *args, **kwargs) -> int:  # asked by some attention modules; unused here
        return 0


def _step(model, keys: list[Tensor], values: list[Tensor], layer_ids: tuple[int, ...], window: int, first: int,
          cache_kw: str, ids: Tensor, starts: Tensor, depth: Tensor, seen: Tensor, pick: Tensor | None) -> tuple:
    """The traced step (see the module doc) on slots first..first+R-1. ids/depth [R, N], starts [R],
    seen [R, N, N] bool, pick [R, K] or None -> (logits [R, K or N, V], features [R, N, m*d] or None).
    cache_kw: the decoder layers' KV-cache argument (`cache`, or `past_key_values` in older transformers:
    a wrong name is silently ignored and the layers would attend to the new tokens only)."""
    base = model.model
    rows, n = ids.shape
    columns = starts[:, None] + torch.arange(n, device=ids.device)  # [R, N] where the new keys go
    position_ids = starts[:, None] + depth
    rel = torch.arange(window, device=ids.device)[None, :] - starts[:, None]  # [R, L] column - s_r
    within = (rel >= 0) & (rel < n)
    new_seen = torch.gather(seen, 2, rel.clamp(0, n - 1)[:, None, :].expand(rows, n, window))  # [R, N, L]
    visible = ((rel < 0)[:, None, :] | (within[:, None, :] & new_seen))[:, None]  # [R, 1, N, L]
    # additive mask (0 visible, dtype min hidden): read alike by SDPA and the eager attention
    dtype = base.embed_tokens.weight.dtype
    mask = torch.zeros((), dtype=dtype, device=ids.device).masked_fill(~visible, torch.finfo(dtype).min)
    writer = _StaticWriter(keys, values, slice(first, first + rows), columns, window)
    hidden = base.embed_tokens(ids)
    per_type = getattr(base.rotary_emb, "layer_types", None)  # Gemma 3: one rotary table per kind of layer
    ropes = ({kind: base.rotary_emb(hidden, position_ids, kind) for kind in per_type} if per_type
             else base.rotary_emb(hidden, position_ids=position_ids))
    captured = []
    for i, layer in enumerate(base.layers[: model.config.num_hidden_layers]):
        rope = ropes[model.config.layer_types[i]] if per_type else ropes
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, use_cache=True,
                       position_embeddings=rope, **{cache_kw: writer})
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if i in layer_ids:
            captured.append(hidden)
    features = torch.cat([captured[layer_ids.index(i)] for i in layer_ids], -1) if layer_ids else None
    final = base.norm(hidden)
    if pick is not None:
        final = torch.gather(final, 1, pick[..., None].expand(-1, -1, final.shape[-1]))
    return model.lm_head(final), features


_WALKED = ("embed_tokens", "layers", "norm", "rotary_emb")


def missing_parts(target) -> list[str]:
    """What the step needs from the target's base model and it lacks ([] = the core runs this target)."""
    return [a for a in _WALKED if not hasattr(target.model.model, a)]


class DecodeCore:
    """A target's static KV store (`slots` sequences) and its step, compiled or eager (module doc)."""

    def __init__(self, target, slots: int = 1, mode: str | None = None, capacity: int = _CAPACITY_CHUNK,
                 chunk: int = _CAPACITY_CHUNK, max_len: int | None = None):
        missing = missing_parts(target)
        if missing:
            raise NotImplementedError(f"{type(target.model).__name__}: the decoding core walks embed_tokens, "
                                      f"layers, norm and rotary_emb; this model lacks {missing}")
        from dspark.models.target import cache_kwarg_of

        self.target, self.slots = target, int(slots)
        self.max_len = int(max_len or getattr(target, "max_positions", None) or 1 << 15)  # sizes the graph budget
        self.cache_kw = cache_kwarg_of(type(target.model.model.layers[0]))
        self.mode = resolve_mode(mode or default_mode(), target.device)
        cfg = target.model.config
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.capacity, self.chunk = 0, int(chunk)
        self._reserve(capacity)
        self._compiled = None
        self.owner = None  # the CoreSequence using slot 0 (batch-1 decoding), if any
        self._chain_layout: dict[int, tuple[Tensor, Tensor]] = {}
        self.steps = 0

    # ---- the KV store --------------------------------------------------------------------------
    def _reserve(self, columns: int) -> None:
        """Make room for `columns` KV columns per slot (copying what is there: a regrow retraces)."""
        if columns <= self.capacity:
            return
        cap = -(-columns // self.chunk) * self.chunk
        dev, dtype = self.target.device, self.target.dtype
        shape = (self.slots, self.kv_heads, cap, self.head_dim)
        for store in (self.keys, self.values):
            for layer in range(self.target.num_layers):
                grown = torch.zeros(shape, device=dev, dtype=dtype)
                if layer < len(store):
                    grown[:, :, : self.capacity] = store[layer]
                    store[layer] = grown
                else:
                    store.append(grown)
                if dev.type == "cuda":  # CUDA graphs may then write the store in place
                    torch._dynamo.mark_static_address(grown)
        self.capacity = cap

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` columns of slot src into slot dst (a released slot's replacement)."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]

    def keep_columns(self, slot: int, base: int, columns: Tensor) -> None:
        """Columns `columns` (ascending, >= base) of a slot move to base, base+1, ... (a tree's accepted path)."""
        for buf in (*self.keys, *self.values):
            buf[slot, :, base: base + len(columns)] = buf[slot, :, columns.to(buf.device)]

    # ---- one step ----------------------------------------------------------------------------
    def chain_layout(self, n: int) -> tuple[Tensor, Tensor]:
        """(depth [1, n], seen [1, n, n]) of n chained tokens, made once per n on the device."""
        layout = self._chain_layout.get(n)
        if layout is None:
            dev = self.target.device
            depth = torch.arange(n, device=dev)[None]
            seen = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None]
            layout = self._chain_layout[n] = (depth, seen)
        return layout

    @torch.no_grad()
    def step(self, ids: Tensor, starts: list[int], layer_ids: tuple[int, ...] = (), pick: Tensor | None = None,
             depth: Tensor | None = None, seen: Tensor | None = None, first: int = 0, eager: bool = False) -> StepOut:
        """Append ids [R, N] to slots first..first+R-1 whose cached lengths are `starts` (host ints: they size
        the window). depth/seen: a tree layout per row (default: chains). pick [R, K]: new-token indices whose
        logits are wanted (default all). The caller sets the slots' lengths afterwards. Compiled cores compile
        steps from slot 0 of at most COMPILED_MAX_TOKENS new tokens unless `eager`; others run eager."""
        rows, n = ids.shape
        if first + rows > self.slots:
            raise ValueError(f"slots {first}..{first + rows - 1} on a decoding core of {self.slots} slots")
        need = max(starts) + n
        if need > self.capacity:
            self._reserve(need)
        dev = self.target.device
        if depth is None:
            depth, seen = (t.expand(rows, *t.shape[1:]) for t in self.chain_layout(n))
        args = (ids.to(dev), torch.tensor(starts, device=dev), depth.to(dev), seen.to(dev),
                None if pick is None else pick.to(dev))
        window = window_bucket(need, self.capacity)
        compiled = self.mode == "compiled" and not eager and n <= COMPILED_MAX_TOKENS and first == 0
        fn = self._compiled_step() if compiled else _step
        logits, features = fn(self.target.model, self.keys, self.values, tuple(layer_ids), window, first,
                              self.cache_kw, *args)
        self.steps += 1
        if compiled and dev.type == "cuda":  # CUDA-graph outputs are overwritten by the next replay
            logits = logits.clone()
            features = None if features is None else features.clone()
        return StepOut(logits, features)

    def _compiled_step(self):
        if self._compiled is None:  # one graph per bucket (rows, new tokens, window, context layers)
            self._compiled = compile_static(_step, self.target.device, graphs=graph_grid(self.slots, self.max_len))
        return self._compiled


_COMPILED_FUNCTIONS: dict[str, object] = {}  # "module.name" -> every function given to compile_static


def graph_grid(rows: int, max_len: int, chunk: int = _CAPACITY_CHUNK) -> int:
    """An upper bound on the graphs a step over `rows` slots can need up to `max_len` positions: row counts (powers of
    two below `rows`, and `rows`) x new-token buckets (powers of two up to COMPILED_MAX_TOKENS) x 2 layouts (a
    chain's and a tree's tensors differ in strides, which static guards check) x the KV windows of every capacity the
    store passes through (a regrow retraces every bucket; a window is a power of two from MIN_WINDOW, or the
    capacity itself; the last capacity holds max_len plus a padded step)."""
    row_buckets = (rows - 1).bit_length() + 1
    last = -(-(max_len + COMPILED_MAX_TOKENS) // chunk) * chunk
    windows = sum((cap - 1).bit_length() - MIN_WINDOW.bit_length() + 2 for cap in range(chunk, last + 1, chunk))
    return row_buckets * COMPILED_MAX_TOKENS.bit_length() * 2 * windows


def compile_static(fn, device: torch.device, backend: str = "inductor", graphs: int = 64):
    """fn under torch.compile with static shapes, one graph per shape bucket, CUDA graphs on a GPU (inductor's
    reduce-overhead): the core's step and the drafters' captured passes. Dynamo's graph cache (per function, and
    in all) is raised to hold `graphs` of them: past it a bucket would run eager, unannounced (`full_graph_caches`)."""
    from torch._dynamo import config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, graphs + 256)
    _COMPILED_FUNCTIONS[f"{fn.__module__}.{fn.__qualname__}"] = fn
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    return torch.compile(fn, backend=backend, mode=mode, dynamic=False)


def full_graph_caches() -> dict[str, int]:
    """The functions given to `compile_static` whose graph cache is full -> their graph count. Dynamo keeps at most
    `recompile_limit` graphs per function (64, or the largest core's `graph_grid`) and runs a call with a shape
    bucket it has no graph for eager, warning once and raising nothing: so a step or capture listed here may run
    eager from then on, unseen by the fallbacks that catch failed captures. Empty: every bucket met so far has its
    graph."""
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    counts = {name: len(_debug_get_cache_entry_list(fn.__code__)) for name, fn in _COMPILED_FUNCTIONS.items()}
    return {name: n for name, n in counts.items() if n >= dynamo_config.recompile_limit}


class CoreSequence:
    """Batch-1 decoding on slot 0 of a core: the KV-cache operations speculative decoding needs. The
    core holds one sequence at a time: opening another one on it retires this one (using it then raises)."""

    def __init__(self, core: DecodeCore):
        self.core, self.length = core, 0
        core.owner = self

    def extend(self, ids: list[int] | Tensor, layer_ids=(), logits: str = "all", depth: Tensor | None = None,
               seen: Tensor | None = None, pad_to: int | None = None, eager: bool = False) -> StepOut:
        """Append tokens (their KV stays: `crop` or `keep_path` drop rejected ones); logits "all" or "last".
        depth [N] / seen [N, N]: a tree layout (default a chain). pad_to: pad the new tokens to this many
        (stale columns) so steps of varying length share a graph (compiled cores pad to `token_bucket`).
        eager: run this step eager on a compiled core (a prompt's prefill: once per request, no graph to build)."""
        if self.core.owner is not self:
            raise RuntimeError("this decoding core now holds another sequence (one sequence per core at a time)")
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        n = ids.shape[0]
        if pad_to is None and self.core.mode == "compiled" and n <= COMPILED_MAX_TOKENS and not eager:
            pad_to = token_bucket(n)
        width = max(n, pad_to or 0)
        if width > n:
            ids = torch.cat([ids, ids.new_zeros(width - n)])
            if depth is not None:  # tree layouts pad with lone nodes that see only the prefix
                depth = torch.cat([depth.reshape(-1).cpu(), torch.zeros(width - n, dtype=torch.long)])
                grown = torch.eye(width, dtype=torch.bool)
                grown[:n, :n] = seen.reshape(n, n).cpu()
                seen = grown
        pick = torch.tensor([[n - 1]]) if logits == "last" else None
        out = self.core.step(ids[None], [self.length], tuple(layer_ids), pick=pick,
                             depth=None if depth is None else depth.reshape(1, -1),
                             seen=None if seen is None else seen.reshape(1, width, width), eager=eager)
        self.length += n
        if width > n:  # drop the padding's outputs ("last" already picked a real token)
            out = StepOut(out.logits if logits == "last" else out.logits[:, :n],
                          None if out.features is None else out.features[:, :n])
        return out

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a sequence of {self.length} positions to {length}")
        self.length = length

    def keep_path(self, base: int, path: Tensor) -> None:
        """Keep [0, base) and then the columns `path` (ascending, >= base): a verified tree's accepted path."""
        cols = path.tolist()
        if cols != list(range(base, base + len(cols))):
            self.core.keep_columns(0, base, path)
        self.length = base + len(cols)


def core_for(target, slots: int = 1, mode: str | None = None) -> DecodeCore:
    """The target's batch-1 decoding core (made once per target and mode, reused by every sequence)."""
    mode = resolve_mode(mode or default_mode(), target.device)
    cores = target.__dict__.setdefault("_decode_cores", {})
    key = (slots, mode)
    if key not in cores:
        cores[key] = DecodeCore(target, slots=slots, mode=mode)
    return cores[key]


class CoreSlots:
    """Batched sequences on a core's slots (the KV store of the serving engine and the rollout generator):
    slots 0..used-1 hold the active sequences, contiguous, slot s verified up to `lengths[s]`. `forward`
    appends a row of tokens (a chain, or a tree of drafts) to each of a range of slots in one step; rows
    pad to one width, and compiled steps from slot 0 pad rows and width to powers of two (a few graphs, not
    one per shape): padding tokens write stale columns only, padding rows free slots' columns, which the
    next prefill there overwrites. A compiled store starts at min(max_len, 1024) columns and grows in chunks
    of 1024 (a regrow retraces every graph: rare); an eager one starts at 128 and grows in chunks of 256."""

    def __init__(self, target, max_batch: int, mode: str | None = None, max_len: int | None = None):
        mode = resolve_mode(mode or default_mode(), target.device)
        compiled = mode == "compiled"
        up_front = min(max_len or _CAPACITY_CHUNK, _CAPACITY_CHUNK) if compiled else MIN_WINDOW
        self.core = DecodeCore(target, slots=max_batch, mode=mode, capacity=up_front,
                               chunk=_CAPACITY_CHUNK if compiled else 256, max_len=max_len)
        self.device = target.device
        self.lengths: list[int] = []

    @property
    def used(self) -> int:
        return len(self.lengths)

    def allocate(self) -> int:
        if self.used >= self.core.slots:
            raise RuntimeError(f"all {self.core.slots} slots are in use")
        self.lengths.append(0)
        return self.used - 1

    def release(self, slot: int) -> int | None:
        """Free `slot`; the last slot moves into it (returns its old index, None if nothing moved)."""
        last = self.used - 1
        if not 0 <= slot <= last:
            raise IndexError(f"slot {slot} is not in use (0..{last})")
        if slot != last:
            self.core.move_slot(last, slot, self.lengths[last])
            self.lengths[slot] = self.lengths[last]
        self.lengths.pop()
        return last if slot != last else None

    def set_length(self, slot: int, length: int) -> None:
        """Keep the first `length` columns of a slot (commit accepted tokens / drop rejected ones)."""
        self.lengths[slot] = length

    def keep_columns(self, slot: int, base: int, columns: list[int]) -> None:
        """Keep [0, base) of a slot, then `columns` (ascending, >= base: a tree row's accepted path)."""
        if columns != list(range(base, base + len(columns))):
            self.core.keep_columns(slot, base, torch.tensor(columns, device=self.device))
        self.lengths[slot] = base + len(columns)

    def memory_bytes(self) -> int:
        return self.core.memory_bytes()

    def forward(self, first: int, rows: list[Tensor], logits_at: str, layer_ids=(),
                parents: list[list[int] | None] | None = None, eager: bool = False) -> list[tuple]:
        """Append rows[r] (token ids [n_r]) to slot first + r at its length -> per row (logits [n_r, V] with
        logits_at "all", [1, V] with "last"; features [n_r, m*d] or None): `ragged_forward`'s contract.
        parents: per row None (a chain) or its tree (`tree_visibility`). eager: run this step uncompiled (prefills:
        compute-bound, and one graph per prompt width would never pay back its compile). The caller sets the
        lengths after."""
        counts, real = [int(r.shape[0]) for r in rows], len(rows)
        width, count = max(counts), real
        if self.core.mode == "compiled" and not eager and first == 0 and width <= COMPILED_MAX_TOKENS:
            width, count = token_bucket(width), min(token_bucket(real), self.core.slots)
        ids = torch.zeros(count, width, dtype=torch.long, device=self.device)
        for r, row in enumerate(rows):
            ids[r, : counts[r]] = row
        depth = seen = None
        if parents is not None and any(p is not None for p in parents):
            depth, seen = _row_layouts(parents, counts, count, width)
        pick = torch.tensor([[n - 1] for n in counts] + [[0]] * (count - real)) if logits_at == "last" else None
        starts = self.lengths[first: first + real] + [0] * (count - real)
        out = self.core.step(ids, starts, tuple(layer_ids or ()), pick=pick, depth=depth, seen=seen, first=first,
                             eager=eager)
        feats = out.features
        return [(out.logits[r] if pick is not None else out.logits[r, :n], None if feats is None else feats[r, :n])
                for r, n in enumerate(counts)]


def _row_layouts(parents: list[list[int] | None], counts: list[int], rows: int, width: int) -> tuple[Tensor, Tensor]:
    """(depth [rows, width], seen [rows, width, width]) of a step's rows: a chain's (padding continues the
    chain), a tree's (`tree_visibility`; padding tokens are lone nodes that see the prefix only); padding
    rows are chains."""
    from dspark.decoding.batched_cache import tree_visibility

    depth = torch.arange(width).repeat(rows, 1)
    seen = torch.ones(width, width, dtype=torch.bool).tril().repeat(rows, 1, 1)
    for r, tree in enumerate(parents):
        if tree is not None:
            n = counts[r]
            tree_seen, tree_depth = tree_visibility(tree)
            depth[r], seen[r] = 0, torch.eye(width, dtype=torch.bool)
            depth[r, :n], seen[r, :n, :n] = tree_depth, tree_seen
    return depth, seen
