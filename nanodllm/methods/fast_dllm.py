"""Fast-dLLM's approximate KV caches for the masked engine: the prefix cache and the dual cache.

Paper: Wu et al. 2025, "Fast-dLLM: training-free acceleration of diffusion LLM by enabling KV cache
and parallel decoding", https://arxiv.org/abs/2505.22618, the baseline Sparse-dLLM is measured against.

Idea. While a block is being denoised, the K/V of the tokens outside it barely change. So at the
block's step `delay` (0: its first step) the whole canvas is forwarded, exactly as dense, and each
layer keeps the K/V outside the block:
    mode = "prefix"   the K/V before the block; later steps feed the block and everything after it
                      (the still-masked suffix);
    mode = "dual"     the K/V before and after the block; later steps feed only the block.
Fed tokens attend to the kept K/V plus their own fresh K/V. Steps before `delay` run in full without
a cache; a new block starts over. With the engine's threshold decoding (--threshold 0.9) this is
Fast-dLLM's whole recipe. The mechanism, which Sparse-dLLM prunes, is methods/outside_cache.py.

Hooks: begin_block (drop the cache), step (full or cached), step_kind (a cached step, per cache).
Equals dense: refresh = 1 (a full forward every step). A cached step on the canvas its cache was
built from gives the full forward's logits (test).
Knobs: mode = "dual" | "prefix" (default dual), delay = 0, refresh = 0 (0: the cache lives for the
whole block; n: a full forward every n steps from `delay` on).
"""

from __future__ import annotations

from .outside_cache import KeptKV, OutsideCache, outside_block


class FastDllm(OutsideCache):
    name = "fast_dllm"

    def __init__(self, mode: str = "dual", delay: int = 0, refresh: int = 0):
        super().__init__(mode, delay, refresh)

    def keep(self, layer: int, q, k, v, ctx) -> KeptKV:
        """Everything outside the fed range, padding hidden."""
        low, high = self.fed_range(ctx)
        valid, all_valid, count = self.outside
        mask = None if all_valid else valid[:, None, None, :]
        return KeptKV(outside_block(k, low, high, dim=2), outside_block(v, low, high, dim=2), mask, count)
