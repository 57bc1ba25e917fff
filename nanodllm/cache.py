"""Preallocated exact KV cache for the block engine.

Per layer, keys and values live in one buffer [batch, capacity, kv_heads, head_dim] (token-major,
post-RoPE keys). Each row has its own length: rows of a ragged batch fill at their own pace, and a
row's first `length` slots hold exactly what one block-causal forward over its clean tokens so far
would give. The slots after a row's length are scratch: a denoising step writes the active block's
K/V there (so attention reads cache and block as one contiguous range, no copy), and the commit
makes them permanent by advancing the length.

What the GPU does with the cache must not depend on host numbers that change every block, so that a
CUDA graph recorded in one block replays in the next (nanodllm/graphs.py): `write` places keys by
the device-side lengths, and the attention kernels size their launch by `launch_length`, a bound
that moves only when the longest row crosses one of eight steps per doubling.
"""

from __future__ import annotations

import copy

import torch

from nanodllm.kernels.cache_write import cache_write, cache_write_reference

from .attention import attention_on_kernels, cache_attention


class KVCache:
    def __init__(self, num_layers, batch, capacity, num_kv_heads, head_dim, device, dtype, held=None, scale=None):
        """held: the layers it keeps (default all; the others' entries are None); scale: the attention's
        score scale (None: head_dim^-1/2)."""
        shape = (batch, capacity, num_kv_heads, head_dim)
        held = range(num_layers) if held is None else held
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) if i in held else None for i in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) if i in held else None for i in range(num_layers)]
        self.scale = scale
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.host_lengths = [0] * batch  # the same numbers on the host: no device sync per layer
        self.capacity = capacity

    @classmethod
    def for_model(cls, cfg, batch: int, capacity: int, device, dtype) -> "KVCache":
        return cls(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, device, dtype)

    @property
    def max_length(self) -> int:
        return max(self.host_lengths)

    def launch_length(self, extra: int = 0) -> int:
        """An upper bound of max_length + extra for kernel launch shapes: rounded up to a multiple of
        1/8 of its power of two (so at most 12.5% over, and the same for many blocks), capped at the
        capacity."""
        n = self.max_length + extra
        step = 1 << max(n.bit_length() - 4, 0)
        return min(-(-n // step) * step, self.capacity)

    @property
    def uniform(self) -> bool:
        """All rows have the same length (no padding to hide)."""
        return min(self.host_lengths) == max(self.host_lengths)

    def view(self, layer: int, extra: int = 0):
        """(keys, values) [batch, kv_heads, max_length + extra, head_dim]: every row's filled part
        plus `extra` scratch slots, padded to the longest row (slots past a row's length hold stale values)."""
        n = self.max_length + extra
        return self.keys[layer][:, :n].transpose(1, 2), self.values[layer][:, :n].transpose(1, 2)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor | None = None):
        """Write k, v [batch, kv_heads, t, head_dim] into the slots right after each row's length
        (the first counts[row] tokens of each row when counts is given). Lengths do not move. Without
        counts the slots come from the device-side lengths (kernels/cache_write.py on CUDA): no host
        number, so a graph can replay it."""
        t = k.shape[2]
        if self.max_length + t > self.capacity:
            raise ValueError(f"KV cache overflow: capacity {self.capacity}, need {self.max_length + t}")
        if counts is None:
            write = cache_write if attention_on_kernels(k) else cache_write_reference
            write(self.keys[layer], self.values[layer], k, v, self.lengths)
            return
        # only the first counts[row] tokens of each row: a value-dependent shape (a device sync)
        offsets = torch.arange(t, device=k.device)
        keep = offsets[None, :] < counts[:, None]
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand(-1, t)[keep]
        slots = (self.lengths[:, None] + offsets[None, :])[keep]
        self.keys[layer][rows, slots] = k.transpose(1, 2)[keep]
        self.values[layer][rows, slots] = v.transpose(1, 2)[keep]

    def rows(self, first: int, stop: int) -> "KVCache":
        """Rows [first, stop) of this cache: its storage (what the part writes lands here), lengths as they are."""
        part = copy.copy(self)
        part.keys = [None if keys is None else keys[first:stop] for keys in self.keys]
        part.values = [None if values is None else values[first:stop] for values in self.values]
        part.lengths, part.host_lengths = self.lengths[first:stop], self.host_lengths[first:stop]
        return part

    def advance(self, counts: torch.Tensor):
        """Make the next counts[row] slots of each row part of the cache."""
        self.lengths += counts
        self.host_lengths = self.lengths.tolist()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The active block's queries against each row's cache plus the whole block (no mask inside the
        block). The block's K/V go to the scratch slots after each row's cache, so keys are read in
        place; slots past a row's own cache and block are not attended."""
        self.write(layer, k, v)
        block = k.shape[2]
        return cache_attention(q, self.keys[layer], self.values[layer], self.lengths + block, self.max_length + block,
                               ragged=not self.uniform, launch_length=self.launch_length(block), scale=self.scale)
