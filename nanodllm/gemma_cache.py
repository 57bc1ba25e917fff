"""DiffusionGemma's KV cache, GemmaCache: what the encoder pass appends and every denoising step reads,
the sliding layers' in rings of sliding_window - 1 tokens, the full layers' in a KVCache."""

from __future__ import annotations

import torch

from .cache import KVCache
from .config import ModelConfig


class GemmaCache:
    """The encoder's K/V per layer (keys after k_norm and RoPE, values after v_norm). A sliding layer's are a
    ring [batch, kv_heads, sliding_window - 1, head_dim], the token at position p in slot p % (window - 1),
    and, between commits, `windows`: the ring in position order followed by a canvas' scratch slots, which
    every denoising step reads in place; the full layers' live in `full`, a KVCache of `capacity` tokens
    (token-major, each row its own tokens without its left pads, scale 1: the layout the methods select
    from). Rows share `length`, the tokens encoded, pads included (positions count from 0; `start` holds it on
    the device, for a step's graph to read); valid [batch, length] is False at left pads. What a denoising step
    reads stays where it is from commit to commit (the windows are refilled in place), so that a CUDA graph of
    a step replays in later canvases while the launch it was recorded with lasts (DiffusionGemma.launch_key)."""

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, device, dtype):
        g = cfg.gemma
        self.canvas_length, self.ring, self.length = g.canvas_length, g.sliding_window - 1, 0
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.slot_positions = torch.full((self.ring,), -1, dtype=torch.long, device=device)  # -1: empty
        self.valid = torch.ones(batch, 0, dtype=torch.bool, device=device)
        self.sliding = [g.is_sliding(layer) for layer in range(cfg.num_layers)]
        ring = lambda: torch.zeros(batch, cfg.num_kv_heads, self.ring, cfg.head_dim, device=device, dtype=dtype)
        self.keys = [ring() if sliding else None for sliding in self.sliding]
        self.values = [ring() if sliding else None for sliding in self.sliding]
        full_layers = [layer for layer, sliding in enumerate(self.sliding) if not sliding]
        self.full = KVCache(cfg.num_layers, batch, capacity, g.global_kv_heads, g.global_head_dim, device, dtype,
                            held=full_layers, scale=1.0)
        self.windows, self.window_width = None, -1
        self.order_windows()

    def ring_in_order(self, layer: int):
        """(keys, values, positions [n]) a sliding layer holds, by position: read from the oldest slot, so that
        attention adds its terms in transformers' order (the sampler needs the same bits)."""
        order = self.ring_order
        return self.keys[layer][:, :, order], self.values[layer][:, :, order], self.slot_positions[order]

    @property
    def has_pads(self) -> bool:
        """Some row holds left pads: fewer tokens in its full layers than were encoded (host numbers)."""
        return not (self.full.uniform and self.full.max_length == self.length)

    def full_in_place(self, layer: int, extra: int = 0):
        """(keys, values) [batch, kv_heads, length + extra, head_dim] of a full layer, by position, with the
        `extra` slots written after each row's tokens: a left-padded row's tokens where transformers holds
        them, so that attention adds its terms in its order (its pads' slots repeat a token none reads)."""
        keys, values = self.full.view(layer, extra)
        if not self.has_pads:
            return keys, values
        pads = self.length - self.full.lengths  # [batch]
        slots = (torch.arange(self.length + extra, device=pads.device)[None, :] - pads[:, None]).clamp(min=0)
        index = slots[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        return keys.gather(2, index), values.gather(2, index)

    def full_launch(self, layer: int, t: int, canvas: bool = True):
        """(keys, values, key_counts) of a full layer with t canvas tokens after each row's: every slot of the
        cache, row b seeing its first key_counts[b] (its tokens, and its canvas where `canvas`; a commit attends
        to its new tokens apart). The kernels visit no key tile past a row's last visible key, so the hidden
        tail costs nothing and the launch's shape lasts the whole generation. Keys in token order, not
        transformers'."""
        keys, values = (x[layer].transpose(1, 2) for x in (self.full.keys, self.full.values))
        return keys, values, self.full.lengths + t if canvas else self.full.lengths

    def in_order(self, layer: int):
        """(keys, values) [batch, kv_heads, n, head_dim] held for `layer`, by position."""
        return self.ring_in_order(layer)[:2] if self.sliding[layer] else self.full_in_place(layer)

    def tail(self, t: int, start):
        """(positions, slots) of what a ring keeps of t new tokens after position `start` (the host's length, or
        the device's `start` inside a step's graph): the last min(t, ring)."""
        kept = min(t, self.ring)
        positions = start + t - kept + torch.arange(kept, device=self.slot_positions.device)
        return positions, positions % self.ring

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None):
        """k, v [batch, kv_heads, t, head_dim] of the t tokens after `length` (which advance() then moves);
        valid [batch, t]: a full layer keeps each row's valid ones, in order (None: all, written where the
        device-side lengths say, with no sync)."""
        t = k.shape[2]
        if not self.sliding[layer]:
            if valid is None:
                self.full.write(layer, k, v)
            else:
                order = (~valid).long().argsort(dim=1, stable=True)[:, None, :, None].expand_as(k)  # valid first
                self.full.write(layer, k.gather(2, order), v.gather(2, order), valid.sum(dim=1))
            return
        positions, slots = self.tail(t, self.start)
        self.keys[layer].index_copy_(2, slots, k[:, :, t - len(positions):])
        self.values[layer].index_copy_(2, slots, v[:, :, t - len(positions):])

    def advance(self, valid: torch.Tensor):
        """valid [batch, t]: which of the t tokens just appended are not padding. The sliding layers' windows
        are laid out again, once for the denoising steps before the next commit."""
        t = valid.shape[1]
        self.valid = torch.cat([self.valid, valid], dim=1)
        positions, slots = self.tail(t, self.length)
        self.slot_positions[slots] = positions
        self.full.advance(valid.sum(dim=1))
        self.length += t
        self.start.fill_(self.length)
        self.order_windows()

    def order_windows(self):
        """Lay out `windows` from the rings (after the cache has changed: a commit), and ring_order: the filled
        slots oldest position first, the same for every ring until the next commit. Each window [b, kv_heads,
        filled + canvas, d] is refilled in place while its width stays (from the commit that fills the rings on)."""
        self.ring_order = order = self.slot_positions[: min(self.length, self.ring)].argsort()
        filled = len(order)
        if filled != self.window_width:
            room = lambda x: x.new_zeros(*x.shape[:2], filled + self.canvas_length, x.shape[3])
            self.windows = [(room(k), room(v)) if sliding else None
                            for k, v, sliding in zip(self.keys, self.values, self.sliding)]
            self.window_valid, self.window_width = self.valid.new_empty(len(self.valid), filled), filled
        for layer, window in enumerate(self.windows):
            if window is not None:
                window[0][:, :, :filled] = self.keys[layer][:, :, order]
                window[1][:, :, :filled] = self.values[layer][:, :, order]
        self.window_valid.copy_(self.valid[:, self.slot_positions[order]])

    def window(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """(keys, values) a sliding layer's denoising step reads: its window in position order, then the
        canvas' k, v [batch, kv_heads, t, head_dim], written into the scratch slots (t = canvas_length)."""
        keys, values = self.windows[layer]
        filled = keys.shape[2] - self.canvas_length
        if k.shape[2] != self.canvas_length:
            return torch.cat([keys[:, :, :filled], k], dim=2), torch.cat([values[:, :, :filled], v], dim=2)
        keys[:, :, filled:], values[:, :, filled:] = k, v
        return keys, values
