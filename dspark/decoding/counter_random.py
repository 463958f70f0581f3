"""Counter-based randomness: uniforms and Gumbel noise that are a function of (key, counter) alone (splitmix64
hashes), with no generator state and no read back from the device.

Two uses:
- keyed by output position: `keyed_uniform(seed, j)` and `keyed_gumbel(seed, j, x)` (the rollout generator's
  tokens, `sampling.KeyedNoise`, `sampling.sample_keyed`);
- a request's stream of uniforms (`CounterStream`): draws are handed out in order, like a torch.Generator's,
  draw i of the stream being `keyed_uniform(stream key, i)`. How many draws a call takes is a host int (as it
  is for a torch.Generator), the draws of every request of a step are hashed together on the host and reach the
  device in ONE copy (`stream_table`, `uniform_rows`) instead of one generator call per request, and a
  request's draws do not depend on the rows beside it.

Invariant: distinct (key, counter) pairs give independent U[0, 1) values (as far as splitmix64 scatters them);
a stream never hands out a counter twice, and its key is derived apart from its request's position keys
(`STREAM_TAG`), so no draw of the rejection rule reuses a value that keyed target-only sampling used.
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np
import torch
from torch import Tensor

_MASK64 = 2**64 - 1
STREAM_TAG = 0x5EED_57E4  # derive_seed(seed, STREAM_TAG): a CounterStream's key, apart from the position keys


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def signed64(c: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    c &= _MASK64
    return c - 2**64 if c >= 2**63 else c


def _mix64_tensor(x: Tensor) -> Tensor:
    """`_mix64` on int64 tensors (two's-complement wrap-around is arithmetic mod 2**64; `>>` on int64 is
    arithmetic, so the shifted-in sign bits are masked off to make it the logical shift)."""
    def lsr(v: Tensor, k: int) -> Tensor:
        return (v >> k) & ((1 << (64 - k)) - 1)
    x = x + signed64(0x9E3779B97F4A7C15)
    x = (x ^ lsr(x, 30)) * signed64(0xBF58476D1CE4E5B9)
    x = (x ^ lsr(x, 27)) * signed64(0x94D049BB133111EB)
    return x ^ lsr(x, 31)


def derive_seed(seed: int, *keys: int) -> int:
    """A seed in [0, 2**63) that is a function of (seed, keys) alone (e.g. (request seed, position))."""
    x = _mix64(seed & _MASK64)
    for key in keys:
        x = _mix64(x ^ (key & _MASK64))
    return x >> 1


def keyed_gumbel(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Counter-based Gumbel noise on the device: g [N, V] float64, g[i, x] a function of (seeds[i],
    positions[i], x) alone: u = the top 53 bits of splitmix64(splitmix64(splitmix64(seed) ^ position) ^ x),
    g = -log(-log u) (u = 0 gives -inf: never chosen). The noise of every row of a step in one call."""
    row = _mix64_tensor(_mix64_tensor(seeds.long().reshape(-1, 1)) ^ positions.long().reshape(-1, 1))
    bits = _mix64_tensor(row ^ torch.arange(vocab_size, device=row.device))
    u = ((bits >> 11) & ((1 << 53) - 1)).double() * 2.0**-53
    return -torch.log(-torch.log(u))


def keyed_uniform(seeds: Tensor, positions: Tensor) -> Tensor:
    """Counter-based uniforms on the device: u [N] float64 in [0, 1), u[i] a function of (seeds[i],
    positions[i]) alone (the top 53 bits of splitmix64(splitmix64(seed) ^ position))."""
    x = _mix64_tensor(_mix64_tensor(seeds.long()) ^ positions.long())
    return ((x >> 11) & ((1 << 53) - 1)).double() * 2.0**-53


class CounterStream:
    """A request's stream of uniforms (module doc): draw i is keyed_uniform(key, i), key derived from the
    request's seed. `take(n)` hands out the next n counters; get_state/set_state rewind it like a torch.Generator."""

    def __init__(self, seed: int, device):
        self.key, self.device, self.counter = derive_seed(seed, STREAM_TAG), torch.device(device), 0

    def take(self, n: int) -> int:
        """The first of the next n counters (they are never handed out again)."""
        start, self.counter = self.counter, self.counter + int(n)
        return start

    def get_state(self) -> int:
        return self.counter

    def set_state(self, counter: int) -> None:
        self.counter = int(counter)


Stream = Union[torch.Generator, CounterStream, None]


_U64 = [np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 30, 27, 31, 11)]
_PYTHON_HASH_MAX = 64  # up to this many draws the hash runs on Python ints (numpy's per-call overhead is larger)


def _mix64_host(x: np.ndarray) -> np.ndarray:
    """`_mix64` on uint64 arrays (numpy wraps uint64 arithmetic mod 2**64 and shifts logically). A third copy of
    the hash on purpose: on CPU tensors (`_mix64_tensor`) a step's few hundred draws took ~1.6x longer
    (benchmarks/request_streams.py, 16 requests: 789 vs 480 us)."""
    c1, c2, c3, s30, s27, s31, _ = _U64
    x = x + c1
    x = (x ^ (x >> s30)) * c2
    x = (x ^ (x >> s27)) * c3
    return x ^ (x >> s31)


def stream_values(streams: Sequence[CounterStream | None], counts: Sequence[int]) -> np.ndarray:
    """Take counts[i] draws from streams[i], entries in list order (an entry with count 0 may be anything)
    -> their float64 values, entry after entry, computed on the host: the very values `keyed_uniform` gives
    for (key, counter). A step's draws are a few per request: one vectorised hash and one copy to the device
    cost less than the ~30 tiny device ops of hashing there."""
    keys, counters = [], []
    for stream, n in zip(streams, counts):
        if n:
            start = stream.take(n)
            keys += [stream.key] * n
            counters += range(start, start + n)
    if len(keys) <= _PYTHON_HASH_MAX:
        return np.array([(_mix64(_mix64(k) ^ c) >> 11) * 2.0**-53 for k, c in zip(keys, counters)], dtype=np.float64)
    x = _mix64_host(_mix64_host(np.array(keys, dtype=np.uint64)) ^ np.array(counters, dtype=np.uint64))
    return (x >> _U64[-1]).astype(np.float64) * 2.0**-53


def stream_table(streams: Sequence[CounterStream | None], counts: Sequence[int], width: int,
                 fill: float = 0.0) -> np.ndarray:
    """[len(streams), width] float64 on the host: row i = counts[i] draws from streams[i], then `fill`."""
    table = np.full((len(counts), width), fill)
    table[np.arange(width)[None, :] < np.asarray(counts)[:, None]] = stream_values(streams, counts)
    return table


def round_down(u: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float64 uniforms in [0, 1) on `dtype`'s grid, rounded down (to nearest could give 1.0); still float64,
    so the cast to `dtype` is exact."""
    if dtype == torch.float64:
        return u
    bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # significand bits (24 for float32)
    return np.floor(u * 2.0**bits) * 2.0**-bits


def on_device(values: np.ndarray, device) -> Tensor:
    """A host array on `device` in one copy, without waiting for the device (pinned and non-blocking on an
    accelerator: queued behind the work already issued)."""
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t if torch.device(device).type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def all_counter_streams(streams: Sequence) -> bool:
    return bool(streams) and all(isinstance(s, CounterStream) for s in streams)


def uniforms(stream: Stream, shape: Sequence[int], device, dtype: torch.dtype = torch.float64) -> Tensor:
    """U[0, 1) of `shape` on `device` from one stream: a CounterStream's next draws, a torch.Generator's (drawn
    on its own device), or None: torch's global generator."""
    return uniform_rows([stream], [int(torch.Size(shape).numel())], device, [dtype])[0].reshape(shape)


def uniform_rows(streams: Sequence[Stream], counts: Sequence[int], device,
                 dtypes: Sequence[torch.dtype] | None = None) -> list[Tensor]:
    """counts[i] uniforms from streams[i] (in list order: an entry's draws follow the stream's earlier entries)
    -> one 1-D tensor per entry on `device`, of dtypes[i] (float64 by default). Every CounterStream entry comes
    from one host hash and one copy (`stream_values`); a torch.Generator entry from its own call."""
    dtypes = list(dtypes) if dtypes is not None else [torch.float64] * len(streams)
    out: list[Tensor | None] = [None] * len(streams)
    counter = [i for i, s in enumerate(streams) if isinstance(s, CounterStream)]
    if counter:
        sizes = [counts[i] for i in counter]
        parts = np.split(stream_values([streams[i] for i in counter], sizes), np.cumsum(sizes)[:-1])
        drawn = on_device(np.concatenate([round_down(u, dtypes[i]) for i, u in zip(counter, parts)]), device)
        for i, u in zip(counter, drawn.split(sizes)):
            out[i] = u.to(dtypes[i])
    for i, s in enumerate(streams):
        if out[i] is None:  # a torch.Generator (or the global one): its own call, on its device
            on = device if s is None else s.device
            out[i] = torch.rand(counts[i], generator=s, device=on, dtype=dtypes[i]).to(device)
    return out


def host_values(values: Sequence[int], device) -> Tensor:
    """Host ints as a LongTensor on `device` without waiting for the device (see `on_device`)."""
    return on_device(np.asarray(list(values), dtype=np.int64), device)
