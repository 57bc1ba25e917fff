"""MAGE: each block's important prefix keys, selected once from its all-[MASK] first step, are the
only prefix keys its later denoising steps attend to (block engine: SDAR, Fast-dLLM v2).

Paper: "MAGE: All-[MASK] Block Already Knows Where to Look in Block Diffusion LLM" (Kwon et al.).
Idea: at the first denoising step of a block every query is [MASK] (except decoded tokens an engine
puts in the block: the prompt's tail in SDAR's first block, Fast-dLLM v2's first position), and the
keys those queries attend to are the ones the whole block keeps attending to (the paper's Fig. 3: the
step-1 top-k estimates later steps' top-k well). So step 1 runs exact attention and, per layer and KV
head, keeps the k prefix keys of highest eq. 3 score (the attention probability averaged over the
block's queries and the group's heads, softmax over the prefix alone); steps 2..T attend to those
keys plus the block's own. The mechanism, shared with SparseD, is methods/block_selection.py.

Hooks: begin_block (the block has no selection yet), attend (exact + select at step 1, sparse
afterwards; the commit exact unless sparse_commit), step (joins the side stream), end_step (kv_kept),
step_kind (the selecting step, and the sparse steps after it).
Equals dense: when k >= every row's prefix the selection is the whole prefix, so every step attends
to every key: the same outputs up to float rounding (the gathered keys are a copy of the cache,
multiplied in another memory layout), the same tokens.
Knobs (paper defaults): k = 1024 keys per KV head (256 / 512 in the accuracy tables; scale it to the
context), exact_layers = 2 (the first two layers always attend exactly), sparse_commit = False,
side_stream = True (on CUDA the scoring and top-k overlap the rest of the step, Algorithm 1).
"""

from __future__ import annotations

from .base import StepContext
from .block_selection import BlockSelection


class Mage(BlockSelection):
    name = "mage"

    def __init__(self, k: int = 1024, exact_layers: int = 2, sparse_commit: bool = False, side_stream: bool = True):
        super().__init__(k, exact_layers, sparse_commit, side_stream)

    def capture_step(self, ctx: StepContext) -> int:
        """The first denoising step, whose queries are all [MASK]."""
        return 0
