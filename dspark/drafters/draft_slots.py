"""One store for the context K/V of every request a block drafter drafts through captured graphs: per layer a
preallocated [slots, KV heads, capacity, head dim] tensor, a request's `DraftState` holding one slot of it.

Why one store: a captured pass (dspark.drafters.block_capture) then reads and writes the same tensors whichever
requests it serves, picking their rows by a device tensor of slot ids, so
- one graph drafts any set of requests (batch bucket, window bucket), not one request at a time, and
- on a GPU the CUDA graphs keep their input addresses when requests come and go (per-request buffers would give
  every new request its own recording).
A state joins the store the first time a captured pass touches it (`bind`: its columns so far are copied in) and
leaves it when it is garbage (its slot is freed). Its buffers become `SlotKVBuffer`s: views of its slot row, so
the eager passes (prompts longer than a graph's bucket, a failed capture) read and write the store in place.
Invariant: columns [0, length) of a slot hold the state's context K/V exactly as its eager buffers would; columns
past the length are zeros or stale values, never read unmasked. Growing the store (more slots, more columns)
copies it: rare, and it retraces.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

from dspark.decoding.static_core import token_bucket
from dspark.drafters.layers import KVBuffer

CHUNK = 1024  # columns the store grows by (a growth retraces every captured pass: rare)
FIRST_SLOTS = 4  # slots of a new store (doubled when full)


class DraftSlots:
    """A drafter's slot store on its device (module doc); `keys[layer]`, `values[layer]`: [S, KV, C, hd]."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, device, dtype):
        self.shape, self.device, self.dtype = (kv_heads, head_dim), torch.device(device), dtype
        self.keys = [self._zeros(FIRST_SLOTS, CHUNK) for _ in range(layers)]
        self.values = [self._zeros(FIRST_SLOTS, CHUNK) for _ in range(layers)]
        self.free = list(range(FIRST_SLOTS - 1, -1, -1))  # a stack: the lowest first, a freed slot next

    def _zeros(self, slots: int, columns: int) -> Tensor:
        kv_heads, head_dim = self.shape
        t = torch.zeros(slots, kv_heads, columns, head_dim, device=self.device, dtype=self.dtype)
        if self.device.type == "cuda":  # CUDA graphs then read and write the store in place
            from torch._dynamo import mark_static_address

            mark_static_address(t)
        return t

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def _grow(self, slots: int, columns: int) -> None:
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                store[i] = self._zeros(slots, columns)
                store[i][: old.shape[0], :, : old.shape[2]] = old

    def reserve(self, columns: int) -> None:
        """At least `columns` columns per slot (grown in CHUNKs, contents kept)."""
        if columns > self.capacity:
            self._grow(self.slots, -(-columns // CHUNK) * CHUNK)

    def reserve_slots(self, slots: int) -> None:
        """At least `slots` slots (contents kept; the new ones handed out after the free ones, lowest first)."""
        if slots > self.slots:
            self.free = list(range(slots - 1, self.slots - 1, -1)) + self.free
            self._grow(slots, self.capacity)

    def acquire(self) -> int:
        if not self.free:  # full: double the slots
            self.reserve_slots(2 * self.slots)
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)


class SlotKVBuffer(KVBuffer):
    """A state's K/V of one layer as a view of its slot row in the store (`KVBuffer`'s contract, in place)."""

    def __init__(self, store: DraftSlots, slot: int, layer: int, length: int):
        self.store, self.slot, self.layer, self.length = store, slot, layer, length

    @property
    def k(self) -> Tensor:
        return self.store.keys[self.layer][self.slot]

    @property
    def v(self) -> Tensor:
        return self.store.values[self.layer][self.slot]

    def append(self, k: Tensor, v: Tensor) -> None:
        n = k.shape[-2]
        self.store.reserve(self.length + n)
        self.k[:, self.length:self.length + n] = k
        self.v[:, self.length:self.length + n] = v
        self.length += n

    def reserve(self, columns: int, like: Tensor | None = None, chunk: int | None = None) -> None:
        self.store.reserve(columns)

    def __deepcopy__(self, memo) -> KVBuffer:
        """A copy leaves the store: a plain KVBuffer holding the same columns (two states never share a slot)."""
        copy = KVBuffer()
        if self.length:
            copy.append(self.k[:, :self.length].clone(), self.v[:, :self.length].clone())
        return copy


def store_of(drafter) -> DraftSlots:
    """The drafter's slot store (made on first use; a new one if the drafter moved device or dtype)."""
    store = drafter.__dict__.get("_draft_slots")
    if store is None or store.device != drafter.device or store.dtype != drafter.dtype:
        c = drafter.config
        store = drafter.__dict__["_draft_slots"] = DraftSlots(c.depth, c.num_kv_heads, c.head_dim, drafter.device,
                                                              drafter.dtype)
    return store


def bind(drafter, state) -> int:
    """The state's slot in the drafter's store, taking one (and copying its context in) on first use."""
    store = store_of(drafter)
    held = state.kv[0] if state.kv else None
    if isinstance(held, SlotKVBuffer) and held.store is store:
        return held.slot
    slot = store.acquire()
    store.reserve(state.length)
    for t in (*store.keys, *store.values):  # a reused slot holds its last request's columns: never read unmasked,
        t[slot].zero_()  # but a masked non-finite value would still poison attention (0 x NaN)
    for layer, buf in enumerate(state.kv):
        if buf.length:
            store.keys[layer][slot, :, : buf.length] = buf.k[:, : buf.length]
            store.values[layer][slot, :, : buf.length] = buf.v[:, : buf.length]
    state.kv = [SlotKVBuffer(store, slot, layer, buf.length) for layer, buf in enumerate(state.kv)]
    weakref.finalize(state, store.release, slot)
    return slot


def padded_rows(drafter, states, values: list[int]) -> tuple[Tensor, Tensor, int]:
    """(slot ids, values) [bucket] on the device for the states' rows (joined to the store) padded to a power of two
    by repeating the last row (a padding row then reads, and writes, exactly what that request does), and the
    real row count."""
    slots = [bind(drafter, s) for s in states]
    pad = token_bucket(len(states)) - len(states)
    return (torch.tensor(slots + slots[-1:] * pad, device=drafter.device),
            torch.tensor(values + values[-1:] * pad, device=drafter.device), len(states))


def last_repeated(t: Tensor, rows: int) -> Tensor:
    """t [R, ...] with its last row repeated up to `rows` rows: a tensor argument's padding rows, as `padded_rows`
    pads the slot ids."""
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t
