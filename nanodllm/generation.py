"""generate(): a batch of prompts decoded by the loop of the model's family, with any method.

    LLaDA (bidirectional)            the masked engine: the whole canvas, semi-AR blocks (masked.py)
    Dream                            its own loop over the whole response at once (dream.py)
    SDAR, LLaDA2 (block-causal)      the block engine: an exact KV cache, block by block (block.py)
    Fast-dLLM v2                     its own loop of sub-blocks against the KV cache (fast_dllm_v2.py)
    DiffusionGemma                   its own loop of canvases against its encoder's cache (gemma_loop.py)

A method runs in the loops of its engines (Method.engines: masked for the first two, block for the
next two, gemma for DiffusionGemma's, where MAGE, Quest and SparseD select on the full layers and MOMO
prefills them). Here, once for every other loop, its steps are wrapped to be replayed where they
repeat and to count what they read (nanodllm/graphs.py); the result carries those counts as stats.
"""

from __future__ import annotations

from dataclasses import replace

from . import block, dream, fast_dllm_v2, gemma_loop, masked
from .config import GenerationConfig
from .decoding import GenerationResult, engine_of
from .graphs import Replayed
from .methods.base import Dense, Method


def generate(model, prompts, gen: GenerationConfig, method: Method | None = None, *, mask_id: int | None = None,
             stop_ids=None, pad_id: int | None = None, **options) -> GenerationResult:
    """Decode gen.gen_length tokens per prompt (token-id lists). stop_ids: the block loops stop a row
    after them (the others decode gen_length; cut at a stop token); pad_id: the masked loops' left pad;
    options: a family loop's own knobs (Dream's and DiffusionGemma's sampling, Fast-dLLM v2's sub_block and
    top_p)."""
    cfg = model.cfg
    if cfg.gemma is not None:
        return gemma_loop.generate(model, prompts, gen, method, stop_ids=stop_ids, pad_id=pad_id, **options)
    steps = Replayed(method or Dense(), model)
    if cfg.model_type == "Dream":
        result = dream.generate(model, prompts, gen, steps, mask_id=mask_id, pad_id=pad_id, **options)
    elif cfg.model_type == "Fast_dLLM_Qwen":
        result = fast_dllm_v2.generate(model, prompts, gen, steps, mask_id=mask_id, stop_ids=stop_ids, **options)
    elif engine_of(cfg) == "block":
        result = block.generate(model, prompts, gen, steps, mask_id=mask_id, stop_ids=stop_ids, **options)
    else:
        result = masked.generate(model, prompts, gen, steps, mask_id=mask_id, pad_id=pad_id, **options)
    return replace(result, replays=steps.replays, stats=steps.meter.stats())
