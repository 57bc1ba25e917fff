"""SparseD adapted to block diffusion: exact attention for the first 20% of each block's steps, the
top-k prefix keys captured at the last exact step, reused for the rest of the block.

Paper: SparseD (Wang et al., ICLR 2026, https://arxiv.org/abs/2509.24014), as MAGE's paper adapts it
for its baseline. SparseD was built for fully bidirectional dLLMs: exact attention for the first 20%
of the denoising steps, then each token's top-k pattern from the final exact step, reused. On block
diffusion the block's queries share one key set per KV head, so the capture is MAGE's block-averaged
eq. 3 at the boundary step: MAGE's mechanism (methods/mage.py) with another capture step, after 20%
of the block's steps instead of its first, all-[MASK] one. That costs 20% of the steps at exact speed,
and the set comes from partly unmasked queries. Assumption: the phases are per block (MAGE's paper
describes a capture "across the trajectory"; per block is what serves a prefix growing every block).
The 20% is of the block's nominal steps (steps_per_block): a block that threshold decoding finishes
before its capture step runs exact throughout.

Hooks: MAGE's; capture_step is SparseD's.
Equals dense: k >= every row's prefix, or exact_fraction = 1 with sparse_commit off.
Heads split over ranks: each KV head selects its own keys, as MAGE's; nothing is communicated.
Knobs: k (1024), exact_fraction (0.2 of the block's steps, at least one exact step), exact_layers (2),
sparse_commit (False).
"""

from __future__ import annotations

from .base import StepContext
from .mage import Mage


class SparseD(Mage):
    """Builds on MAGE: its selection and sparse steps, captured after the block's first fifth."""

    name = "sparsed"

    def __init__(self, k: int = 1024, exact_fraction: float = 0.2, exact_layers: int = 2, sparse_commit: bool = False):
        super().__init__(k, exact_layers, sparse_commit)
        if not 0.0 <= exact_fraction <= 1.0:
            raise ValueError(f"exact_fraction must lie in [0, 1], got {exact_fraction!r}")
        self.exact_fraction = exact_fraction

    def capture_step(self, ctx: StepContext) -> int:
        """The last of the block's max(1, round(fraction * T)) exact steps."""
        return max(1, round(self.exact_fraction * ctx.steps_per_block)) - 1
