"""SDAR-style block diffusion with an exact KV cache (SDAR's block_diffusion_generate, LLaDA2's generate).

The canvas is the prompt followed by masks up to a whole number of blocks (aligned to position 0).
The prompt's complete blocks are prefilled into the cache; each following block (the first may begin
with the prompt's tail) is denoised for up to `steps` steps against the read-only cache, each step
unmasking the top schedule[step] masked positions by confidence or, with a threshold (dynamic), every
one above it when at least schedule[step] are; a finished block is committed (one forward of the clean
block appends its KV). A row stops after a block whose generated part holds a stop token, or when its
canvas is full. Temperature 0 takes the argmax and its softmax probability (float32), T > 0 samples
from softmax(logits / T); [MASK] is never the chosen token. Ragged batches: each row has its own
prompt length, blocks and cache length; rows move through blocks in lockstep, a finished row stops.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .cache import KVCache
from .config import GenerationConfig
from .decoding import (GenerationResult, MasksLeft, check_method, check_prompts, prefill_complete_blocks,
                       most_likely, prompts_then_masks, refuse_shifted_logits, split_evenly, top_confident,
                       without_token)
from .methods.base import Dense, Method, StepContext
from .model import fp32_or_wider
from .parallel import SINGLE, Group, group_of

REMASKING = ("low_confidence", "low_confidence_static", "low_confidence_dynamic", "sequential")


def sample(logits: torch.Tensor, temperature: float, mask_id: int, group: Group = SINGLE):
    """(token ids, their probability) per position; [MASK] is never the sampled token. Under a split the
    logits are this rank's vocabulary columns (decoding.most_likely)."""
    logits = fp32_or_wider(logits)
    if group.world > 1:
        if temperature == 0:
            return most_likely(logits, mask_id, group)
        logits = group.all_gather(logits)
    if temperature == 0:
        probs = logits.softmax(dim=-1)
        tokens = without_token(probs, mask_id, 0.0).argmax(dim=-1)
    else:
        probs = (logits / temperature).softmax(dim=-1)
        allowed = without_token(probs, mask_id, 0.0)
        tokens = torch.multinomial(allowed.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1)


def choose(confidence, masked, count, remasking: str, threshold: float | None,
           host_count: list[int] | None = None) -> torch.Tensor:
    """Which masked positions of the block to unmask this step. count [batch] is already capped
    (host_count: the same numbers on the host, if known)."""
    if remasking == "sequential":
        order = masked.long().cumsum(dim=-1)
        return masked & (order <= count[:, None])
    transfer = top_confident(confidence, count if host_count is None else host_count)
    if threshold is not None and remasking != "low_confidence_static":
        confident = confidence > threshold
        enough = confident.sum(dim=-1) >= count
        transfer = torch.where(enough[:, None], confident, transfer)
    return transfer


@torch.no_grad()
def generate(model, prompts, gen: GenerationConfig, method: Method | None = None,
             mask_id: int | None = None, stop_ids=None) -> GenerationResult:
    cfg = model.cfg
    method = method or Dense()
    group = group_of(model)
    check_method(method, cfg, "block")
    mask_id = cfg.mask_token_id if mask_id is None else mask_id
    stop_ids = cfg.eos_token_ids if stop_ids is None else tuple(stop_ids)
    refuse_shifted_logits(cfg)
    if cfg.attention != "block_causal":
        raise ValueError(f"the block engine needs a block-causal model; {cfg.model_type} is {cfg.attention}")
    if gen.remasking not in REMASKING:
        raise ValueError(f"remasking must be one of {', '.join(REMASKING)}, got {gen.remasking!r}")
    if gen.remasking == "low_confidence_dynamic" and gen.threshold is None:
        raise ValueError("remasking 'low_confidence_dynamic' needs a threshold")
    size = gen.block_length
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.context_length, gen.gen_length + size)
    device = model.embed_tokens.weight.device
    batch = len(prompts)

    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ends = torch.tensor([math.ceil((len(p) + gen.gen_length) / size) * size for p in prompts], device=device)
    capacity = int(ends.max())
    x = prompts_then_masks(prompts, capacity, mask_id, device)
    layer_cfg = model.layers[0].cfg  # a layer's config: this rank's share of the KV heads
    cache = KVCache.for_model(layer_cfg, batch, capacity + size, device, model.embed_tokens.weight.dtype)
    offsets = torch.arange(size, device=device)
    rows = torch.arange(batch, device=device)[:, None]
    starts, _ = prefill_complete_blocks(model, method, x, lengths, cache, size, mask_id)
    schedule = split_evenly(torch.tensor([size], device=device), gen.steps)[0]
    host_schedule = schedule.tolist()
    # sample never returns [MASK] while another token has a nonzero probability, so without a threshold
    # every step unmasks exactly its count
    followed = gen.threshold is None or gen.remasking == "low_confidence_static"

    active = starts < ends
    decoded_until = lengths.clone()  # end of each row's last committed block
    forwards = max_steps = block = t = 0
    while active.any():
        columns = starts[:, None] + offsets  # [batch, size]
        current = x[rows, columns.clamp(max=capacity - 1)]
        # The positions still to decode, tracked as such: a prompt token equal to the mask id (LLaDA2's
        # mask id is also a chat-template token) is never taken for a mask.
        masked = (columns >= lengths[:, None]) & active[:, None]
        left = MasksLeft(masked, followed)
        at_block = StepContext(current, columns, torch.ones_like(current, dtype=torch.bool), lengths, block=block,
                               steps_per_block=gen.steps, mask_id=mask_id, cache=cache, block_length=size)
        method.begin_block(at_block)
        ran = 0  # the block's steps so far
        for step in range(gen.steps + 1):
            if not left.any(masked):
                break
            ctx = replace(at_block, tokens=current, step=step, t=t)
            logits = method.logits(model, method.step(model, ctx), ctx)
            forwards, t = forwards + 1, t + 1
            x0, x0_prob = sample(logits, gen.temperature, mask_id, group)
            confidence = torch.where(masked, x0_prob, float("-inf"))
            scheduled = min(step, gen.steps - 1)
            count = torch.minimum(schedule[scheduled].expand(batch), masked.sum(dim=-1))
            host_count = left.capped(host_schedule[scheduled])
            transfer = choose(confidence, masked, count, gen.remasking, gen.threshold, host_count) & masked
            current = torch.where(transfer, x0, current)
            masked &= ~transfer
            left.take(host_count)
            ran = step + 1
        max_steps = max(max_steps, ran)
        committed = replace(at_block, tokens=current, step=ran, t=t, counts=torch.where(active, size, 0),
                            phase="commit")
        method.commit(model, committed)
        x[rows[active], columns[active]] = current[active]  # past the commit: a boolean index waits for the GPU
        cache.advance(committed.counts)
        forwards += 1
        decoded_until = torch.where(active, starts + size, decoded_until)
        for row in torch.nonzero(active).flatten().tolist():
            generated = x[row, int(lengths[row]) : int(starts[row]) + size]
            if any(token in stop_ids for token in generated.tolist()):
                active[row] = False
        starts = torch.where(active, starts + size, starts)
        active &= starts < ends
        block += 1
    tokens = [x[row, int(lengths[row]) : int(decoded_until[row])].tolist() for row in range(batch)]
    return GenerationResult(tokens, forwards, max_steps, cache)
