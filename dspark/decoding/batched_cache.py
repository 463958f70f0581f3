"""Ragged batched KV store: many requests of different lengths in ONE target forward, no padding
in the linear layers (the paper's §5.3 "flatten tokens, keep sequences apart in attention").

Layout of one forward:
- the input is one flat row [1, N] holding every request's new tokens back to back; `position_ids`
  carry each token's true position in its own sequence, so RoPE is exact;
- keys/values live in a per-layer slot store [S, Hkv, Lcap, D]; request r owns one slot, and a batch
  covers a contiguous slot range [first, first + R);
- inside attention the new keys/values are written at (slot, column L_r + i), the flat queries are
  scattered into a padded [R, Nmax] grid, and row r attends to its own slot with the causal mask
  "key column k visible to new token i  iff  k <= L_r + i" (L_r = the row's cached length);
- a row may instead hold a tree of drafts (`parents`: each new token's parent among the row's new
  tokens, -1 for the first): token i then sits at position L_r + depth(i) and sees the prefix, itself
  and its ancestors only; after acceptance `KVSlots.keep_columns` moves the accepted path's columns
  behind the prefix.
Invariant: columns [0, L_r) of a slot hold exactly the verified prefix of its request. Columns past
that are stale (rejected drafts, padding) and always masked, so "cropping" a rejected suffix is just
setting the length.

The model keeps working normally outside `store.batch(...)`: the attention function registered here
falls back to the model's original implementation when no ragged batch is active. `ragged_forward` is
one such forward of a target over a slot range (the engine's and the generator's).
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

_ACTIVE: contextvars.ContextVar["RaggedBatch | None"] = contextvars.ContextVar("dspark_ragged_batch", default=None)
_PREFIX = "dspark_ragged|"


@dataclass
class RaggedBatch:
    """Index maps of one ragged forward (built by `RaggedBatch.build`)."""

    store: "KVSlots"
    first: int  # first slot of the contiguous slot range
    starts: list[int]  # L_r: cached length of each row before this forward
    counts: list[int]  # n_r: new tokens of each row
    position_ids: Tensor  # [1, N] true positions
    token_slot: Tensor  # [N] slot of each flat token
    token_pos: Tensor  # [N] position (= column in the slot) of each flat token
    flat_index: Tensor  # [N] index into the padded [R * Nmax] grid
    mask: Tensor  # [R, 1, Nmax, Lcur] bool, True = may attend
    width: int  # Nmax
    kv_len: int  # Lcur = max(L_r + n_r)

    @classmethod
    def build(cls, store: "KVSlots", first: int, starts: list[int], counts: list[int],
              parents: list[list[int] | None] | None = None) -> "RaggedBatch":
        """parents: per row None (a chain) or its tree (parent of each new token, -1 for the first)."""
        if not counts or min(counts) < 1:
            raise ValueError(f"every row of a ragged batch needs >= 1 new token, got counts {counts}")
        # index math runs on the host (tiny, data-dependent shapes); every tensor field then moves to
        # store.device, so a batch always lives where its KV slots (and the target) live
        device, rows = store.device, len(counts)
        width = max(counts)
        kv_len = max(s + n for s, n in zip(starts, counts))
        row_of = torch.repeat_interleave(torch.arange(rows), torch.tensor(counts))
        offset = torch.cat([torch.arange(n) for n in counts])
        start_t = torch.tensor(starts)
        token_pos = start_t[row_of] + offset
        # row r, new token i sees key columns 0..L_r+i: its verified prefix and the new tokens up to itself
        limit = start_t[:, None] + torch.arange(width)[None, :]  # [R, Nmax]
        mask = torch.arange(kv_len)[None, None, :] <= limit[..., None]
        position = token_pos.clone()
        at = 0
        for r, tree in enumerate(parents or []):
            if tree is not None:  # a tree row: ancestors instead of everything before, depth positions
                if len(tree) != counts[r]:
                    raise ValueError(f"row {r}: {len(tree)} parents for {counts[r]} new tokens")
                seen, depth = tree_visibility(tree)
                mask[r, : counts[r], starts[r]: starts[r] + counts[r]] = seen
                position[at: at + counts[r]] = starts[r] + depth
            at += counts[r]
        return cls(store=store, first=first, starts=list(starts), counts=list(counts),
                   position_ids=position[None].to(device), token_slot=(row_of + first).to(device),
                   token_pos=token_pos.to(device), flat_index=(row_of * width + offset).to(device),
                   mask=mask[:, None].to(device), width=width, kv_len=kv_len)

    @property
    def rows(self) -> int:
        return len(self.counts)

    def pad(self, flat: Tensor) -> Tensor:
        """[H, N, D] flat queries -> [R, H, Nmax, D] padded grid (zeros in the padding)."""
        heads, _, dim = flat.shape
        grid = flat.new_zeros(self.rows * self.width, heads, dim)
        grid[self.flat_index] = flat.transpose(0, 1)
        return grid.view(self.rows, self.width, heads, dim).transpose(1, 2)

    def unpad(self, grid: Tensor) -> Tensor:
        """[R, Nmax, H, D] attention output -> [1, N, H, D] flat."""
        return grid.reshape(self.rows * self.width, *grid.shape[2:])[self.flat_index].unsqueeze(0)

    def row_slices(self) -> list[slice]:
        """Flat-token slice of each row."""
        out, at = [], 0
        for n in self.counts:
            out.append(slice(at, at + n))
            at += n
        return out


class KVSlots:
    """Per-layer key/value slot store with per-slot verified lengths; grows on demand."""

    def __init__(self, device, dtype, slot_chunk: int = 4, length_chunk: int = 128):
        self.device, self.dtype = torch.device(device), dtype
        self.slot_chunk, self.length_chunk = slot_chunk, length_chunk
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.lengths: list[int] = []  # verified length of each slot in use

    # ---- slots ----------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return len(self.lengths)

    def allocate(self) -> int:
        """A fresh empty slot at the end of the used range."""
        self.lengths.append(0)
        return len(self.lengths) - 1

    def release(self, slot: int) -> int | None:
        """Free `slot`, keeping used slots contiguous: the last slot moves into it.
        Returns the old index of the slot that moved (None if nothing moved)."""
        last = len(self.lengths) - 1
        if not 0 <= slot <= last:
            raise IndexError(f"slot {slot} is not in use (0..{last})")
        moved = None
        if slot != last:
            n = self.lengths[last]
            for buf in (*self.keys.values(), *self.values.values()):
                buf[slot, :, :n] = buf[last, :, :n]
            self.lengths[slot] = n
            moved = last
        self.lengths.pop()
        return moved

    def set_length(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of a slot (commit accepted tokens / drop rejected ones)."""
        self.lengths[slot] = length

    def keep_columns(self, slot: int, base: int, columns: list[int]) -> None:
        """Keep the prefix [0, base) of a slot followed by `columns` (ascending, >= base; a tree row's
        accepted path): their keys/values move to base, base+1, ... and the slot's length becomes
        base + len(columns)."""
        if columns != list(range(base, base + len(columns))):  # else they already stand there
            index = torch.tensor(columns, device=self.device)
            for buf in (*self.keys.values(), *self.values.values()):
                buf[slot, :, base: base + len(columns)] = buf[slot, :, index]  # advanced index: a copy
        self.lengths[slot] = base + len(columns)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))

    # ---- forward plumbing ---------------------------------------------------------------------
    def ragged(self, first: int, counts: list[int], parents: list[list[int] | None] | None = None) -> RaggedBatch:
        """Layout for appending counts[r] tokens to slots first..first+R-1 at their current lengths
        (parents: tree rows, see `RaggedBatch.build`)."""
        starts = self.lengths[first: first + len(counts)]
        if len(starts) != len(counts):
            raise IndexError(f"slots {first}..{first + len(counts) - 1} are not all in use ({self.used} used)")
        return RaggedBatch.build(self, first, starts, counts, parents)

    @contextmanager
    def batch(self, layout: RaggedBatch):
        """Within this block, attention of models prepared with `enable_ragged` runs the ragged layout."""
        token = _ACTIVE.set(layout)
        try:
            yield layout
        finally:
            _ACTIVE.reset(token)

    def write(self, layer: int, key: Tensor, value: Tensor, layout: RaggedBatch) -> tuple[Tensor, Tensor]:
        """Store one layer's new keys/values ([Hkv, N, D]); return the batch rows' [R, Hkv, Lcur, D] views."""
        need_slots, need_len = layout.first + layout.rows, layout.kv_len
        k_buf = self._ensure(self.keys, layer, key, need_slots, need_len)
        v_buf = self._ensure(self.values, layer, value, need_slots, need_len)
        k_buf[layout.token_slot, :, layout.token_pos] = key.transpose(0, 1).to(k_buf.dtype)
        v_buf[layout.token_slot, :, layout.token_pos] = value.transpose(0, 1).to(v_buf.dtype)
        rows = slice(layout.first, need_slots)
        return k_buf[rows, :, :need_len], v_buf[rows, :, :need_len]

    def _ensure(self, store: dict, layer: int, like: Tensor, slots: int, length: int) -> Tensor:
        buf = store.get(layer)
        if buf is not None and buf.shape[0] >= slots and buf.shape[2] >= length:
            return buf
        old_slots, old_len = (buf.shape[0], buf.shape[2]) if buf is not None else (0, 0)
        new_slots = _round_up(max(slots, old_slots), self.slot_chunk)
        new_len = _round_up(max(length, old_len), self.length_chunk)
        heads, dim = like.shape[0], like.shape[-1]
        grown = torch.zeros(new_slots, heads, new_len, dim, device=self.device, dtype=self.dtype)
        if buf is not None:
            grown[:old_slots, :, :old_len] = buf
        store[layer] = grown
        return grown


def _round_up(n: int, chunk: int) -> int:
    return max(chunk, -(-n // chunk) * chunk)


def tree_visibility(parents: list[int]) -> tuple[Tensor, Tensor]:
    """(seen [n, n] bool: token i sees token j iff j is i or an ancestor of i, depth [n]: 0 for the
    root) of a tree given by each token's parent (-1 for the root, parents before children)."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i, parent in enumerate(parents):
        if parent >= 0:
            if parent >= i:
                raise ValueError(f"tree parents must come before their children: token {i} has parent {parent}")
            seen[i] |= seen[parent]
            depth[i] = depth[parent] + 1
    return seen, depth


def _ragged_attention_for(original: str):
    """An attention function: ragged layout inside `KVSlots.batch`, the model's original one outside."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        layout = _ACTIVE.get()
        if layout is None:
            fallback = ALL_ATTENTION_FUNCTIONS.get_interface(original, eager_attention_forward)
            return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if query.shape[0] != 1:
            raise ValueError("a ragged forward takes one flat row of tokens (input_ids [1, N])")
        keys, values = layout.store.write(module.layer_idx, key[0], value[0], layout)
        return layout.unpad(grouped_sdpa(layout.pad(query[0]), keys, values, layout.mask, scaling)), None

    return attention


def grouped_sdpa(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scaling: float | None) -> Tensor:
    """Attention of [R, H, N, D] queries over [R, Hkv, L, D] keys/values (H = g·Hkv), -> [R, N, H, D].
    Query head h reads KV head h // g (as repeat_kv has it), so the g query heads of one KV head are
    stacked along the query axis ([R, Hkv, g·N, D], index j·N + n) and the [R, 1, N, L] mask repeated g
    times to match: the same attention per head, without repeat_kv's g copies of the whole KV cache (the
    ragged decoding step's largest memory traffic at a few hundred rows; transformers packs only
    single-token queries, and 5.17 not even those when a mask is given)."""
    rows, heads, n, dim = query.shape
    groups = heads // keys.shape[1]
    grouped = query.reshape(rows, keys.shape[1], groups * n, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, keys, values, attn_mask=mask.repeat(1, 1, groups, 1) if groups > 1 else mask, scale=scaling)
    return out.reshape(rows, heads, n, dim).transpose(1, 2)


def enable_ragged(model) -> str:
    """Switch a HF model to the ragged-capable attention (idempotent). Outside a ragged batch the
    model computes exactly what its original attention implementation computes."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = model.config._attn_implementation
    if current.startswith(_PREFIX):
        return current
    name = _PREFIX + current
    ALL_ATTENTION_FUNCTIONS.register(name, _ragged_attention_for(current))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} refused attention implementation {name!r}; the serving "
                           f"engine needs a model that uses transformers' AttentionInterface")
    return name


def ragged_forward(target, store: KVSlots, first: int, ids: torch.Tensor, counts: list[int], logits_at: str,
                   layer_ids: list[int] | None = None, parents: list[list[int] | None] | None = None) -> list[tuple]:
    """One target forward appending counts[r] tokens (flat `ids` [1, N]) to slots first..first+R-1 of
    `store`. Returns per row (logits, features): logits of all its new tokens (logits_at "all") or of
    its last one ("last", shape [1, V]); features of the `layer_ids` layers (None without them).
    parents: per row None or a tree of its new tokens (`RaggedBatch.build`)."""
    layout = store.ragged(first, counts, parents)
    slices = layout.row_slices()
    where = "all" if logits_at == "all" else torch.tensor([s.stop - 1 for s in slices], device=target.device)
    with store.batch(layout):
        out = target.forward(ids.to(target.device), position_ids=layout.position_ids,
                             attention_mask=layout.mask, layer_ids=layer_ids, logits_at=where)
    logits, feats = out.logits[0], out.features[0] if out.features is not None else None
    if logits_at == "all":
        return [(logits[s], None if feats is None else feats[s]) for s in slices]
    return [(logits[i: i + 1], None if feats is None else feats[s]) for i, s in enumerate(slices)]


class RaggedSlots:
    """`CoreSlots`' interface over the ragged store (DSPARK_DECODE_CORE=dynamic, or a target the core cannot
    walk): one flattened row per forward, a host-built mask."""

    def __init__(self, target):
        enable_ragged(target.model)
        self.target, self.kv = target, KVSlots(target.device, target.dtype)
        self.device = self.kv.device

    @property
    def used(self) -> int:
        return self.kv.used

    @property
    def lengths(self) -> list[int]:
        return self.kv.lengths

    def allocate(self) -> int:
        return self.kv.allocate()

    def release(self, slot: int) -> int | None:
        return self.kv.release(slot)

    def set_length(self, slot: int, length: int) -> None:
        self.kv.set_length(slot, length)

    def keep_columns(self, slot: int, base: int, columns: list[int]) -> None:
        self.kv.keep_columns(slot, base, columns)

    def memory_bytes(self) -> int:
        return self.kv.memory_bytes()

    def forward(self, first: int, rows: list[torch.Tensor], logits_at: str, layer_ids=(),
                parents: list[list[int] | None] | None = None, eager: bool = True) -> list[tuple]:
        ids = torch.cat([r.to(self.device) for r in rows])[None]
        return ragged_forward(self.target, self.kv, first, ids, [int(r.shape[0]) for r in rows], logits_at,
                              list(layer_ids or ()) or None, parents)
