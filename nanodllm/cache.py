"""Preallocated exact KV cache for the block engine.

Per layer, keys and values live in one buffer [batch, capacity, kv_heads, head_dim] (token-major,
post-RoPE keys). Each row has its own length: rows of a ragged batch fill at their own pace, and a
row's cache holds exactly what one block-causal forward over its clean tokens so far would give.
Methods read it through `view(layer)`; only `append` writes, and only the engine's prefill and
commit hooks call it.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers, batch, capacity, num_kv_heads, head_dim, device, dtype):
        shape = (batch, capacity, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.capacity = capacity

    @classmethod
    def for_model(cls, cfg, batch: int, capacity: int, device, dtype) -> "KVCache":
        return cls(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, device, dtype)

    @property
    def max_length(self) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def view(self, layer: int):
        """(keys, values) [batch, kv_heads, max_length, head_dim] and valid [batch, max_length]:
        the filled part of every row, padded to the longest row."""
        n = self.max_length
        valid = torch.arange(n, device=self.lengths.device)[None, :] < self.lengths[:, None]
        return self.keys[layer][:, :n].transpose(1, 2), self.values[layer][:, :n].transpose(1, 2), valid

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor):
        """Write the first counts[row] tokens of k, v [batch, kv_heads, t, head_dim] after each row's
        current length. Lengths move only in `advance`, once every layer is written."""
        t = k.shape[2]
        offsets = torch.arange(t, device=k.device)
        if int((self.lengths + counts).max()) > self.capacity:
            raise ValueError(f"KV cache overflow: capacity {self.capacity}, need {int((self.lengths + counts).max())}")
        keep = offsets[None, :] < counts[:, None]  # [batch, t]
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand(-1, t)[keep]
        slots = (self.lengths[:, None] + offsets[None, :])[keep]
        self.keys[layer][rows, slots] = k.transpose(1, 2)[keep]
        self.values[layer][rows, slots] = v.transpose(1, 2)[keep]

    def advance(self, counts: torch.Tensor):
        self.lengths += counts
