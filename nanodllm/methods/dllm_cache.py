"""dLLM-Cache: reuse each layer's features of the canvas across denoising steps (masked engine).

Paper: Liu et al. 2025, "dLLM-Cache: accelerating diffusion large language models with adaptive
caching", https://arxiv.org/abs/2506.06295, in the form MaskKV (https://arxiv.org/abs/2510.09309,
appendix A.9, Algorithms 4-7) restates and builds on.

Idea. Between two denoising steps most of the canvas barely changes. Per layer the method keeps the
K/V of the canvas and, for the response, what attention and the FFN added to each row's residual
stream. Every prompt_interval-th step the prompt is forwarded again, every response_interval-th step
the whole response; in between, each step computes every response row's value projection and gives
fresh attention and FFN only to the rho fraction of rows whose value moved most (cosine to the
cached value); the other rows add their cached outputs. The mechanism, which MaskKV and SnapKV evict
from, is methods/canvas_cache.py.

Hooks: begin_block (block 0 starts a new generation), step (the forward, from the layer
primitives), end_step (the step counter and rows_computed), step_kind (the steps between prompt
refreshes).
Equals dense token for token when prompt_interval = response_interval = 1.
Knobs (paper defaults): prompt_interval T_p = 50, response_interval T_r = 5, rho = 0.25. The paper
decodes LLaDA with block length 8, an engine setting (--block-length).
"""

from __future__ import annotations

from .canvas_cache import CanvasCache


class DllmCache(CanvasCache):
    name = "dllm_cache"

    def __init__(self, prompt_interval: int = 50, response_interval: int = 5, rho: float = 0.25):
        super().__init__(prompt_interval, response_interval, rho)
