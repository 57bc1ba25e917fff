"""LLaDA-style masked diffusion (LLaDA's generate): the whole canvas every step, semi-AR blocks.

canvas = prompt ++ [mask] * gen_length; each block of block_length tokens gets steps // num_blocks
steps, each unmasking a scheduled number of the block's masked positions by confidence
(low_confidence: the predicted token's softmax probability; random: uniform draws). Temperature adds
Gumbel noise in float64; cfg_scale > 0 also runs the canvas with the prompt masked and mixes the
logits. With `threshold` set this is Fast-dLLM's parallel decoding: each step unmasks every masked
position of the block at or above it (at least the best one) until the block is done. [MASK] itself
is never the predicted token (a guard the reference lacks). Ragged batches: prompts are left-padded
so the generated region is the same columns; pads are hidden keys, positions start at each row's
first prompt token. Only the active block's logits are asked for (the reference excludes the others
with -inf). At temperature 0 tokens equal the reference's; with T > 0 the noise is drawn for the
block only: the reference's distribution, not its random stream.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .attention import CanvasMask
from .config import GenerationConfig
from .decoding import (GenerationResult, check_method, check_prompts, left_padded_canvas, refuse_shifted_logits,
                       most_likely, split_evenly, threshold_transfer, top_confident, without_token)
from .methods.base import Dense, Method, StepContext
from .parallel import Group, group_of


def gumbel_max_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """exp(logits) / (-log u)^T in float64, whose argmax samples softmax(logits / T); T=0: logits."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits)
    return logits.exp() / (-torch.log(noise)) ** temperature


@torch.no_grad()
def generate(model, prompts, gen: GenerationConfig, method: Method | None = None,
             mask_id: int | None = None, pad_id: int | None = None) -> GenerationResult:
    cfg = model.cfg
    method = method or Dense()
    group = group_of(model)
    check_method(method, cfg, "masked")
    mask_id = cfg.mask_token_id if mask_id is None else mask_id
    pad_id = cfg.eos_token_ids[0] if pad_id is None else pad_id
    refuse_shifted_logits(cfg)
    block_causal = cfg.attention == "block_causal"
    if block_causal and method.needs_bidirectional:
        raise ValueError(f"{method.name} caches a bidirectional canvas; this model is block-causal "
                         "(decode it with the block engine)")
    if gen.gen_length % gen.block_length:
        raise ValueError(f"gen_length={gen.gen_length} is not a multiple of block_length={gen.block_length}")
    num_blocks = gen.gen_length // gen.block_length
    if gen.steps % num_blocks:
        raise ValueError(f"steps={gen.steps} is not a multiple of the number of blocks ({num_blocks})")
    if gen.remasking not in ("low_confidence", "random"):
        raise ValueError(f"remasking must be 'low_confidence' or 'random', got {gen.remasking!r}")
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.context_length, gen.gen_length)
    steps_per_block = gen.steps // num_blocks
    device = model.embed_tokens.weight.device

    canvas = left_padded_canvas(prompts, gen.gen_length, mask_id, pad_id, device)
    x, valid, positions, lengths, prompt_width = (canvas.tokens, canvas.valid, canvas.positions, canvas.lengths,
                                                  canvas.prompt_width)
    width, ragged = x.shape[1], canvas.ragged
    in_prompt = valid.clone()
    in_prompt[:, prompt_width:] = False
    attn_mask = CanvasMask(valid=valid if ragged else None, block_size=cfg.block_size if block_causal else None,
                           positions=positions if block_causal and ragged else None)

    # Each block starts as block_length masks in every row, so its schedule is known on the host: choosing
    # by it never waits for the GPU.
    schedule = split_evenly(torch.full((len(prompts),), gen.block_length), steps_per_block).T.tolist()  # [step][row]
    forwards = total_steps = 0
    for block in range(num_blocks):
        start = prompt_width + block * gen.block_length
        stop = start + gen.block_length
        method.begin_block(StepContext(x, positions, valid, lengths, prompt_width=prompt_width, block=block,
                                       t=total_steps, mask_id=mask_id))
        step = 0
        while True:
            block_masked = x[:, start:stop] == mask_id
            if gen.threshold is None and step == steps_per_block:
                break
            if gen.threshold is not None and not block_masked.any():
                break
            ctx = StepContext(x, positions, valid, lengths, prompt_width=prompt_width, block=block, step=step,
                              steps_per_block=steps_per_block, t=total_steps + step, mask_id=mask_id,
                              attn_mask=attn_mask, logits_start=start, logits_stop=stop, block_length=gen.block_length)
            logits = guided_logits(model, method, ctx, gen.cfg_scale, in_prompt)
            forwards += 1
            x0, x0_conf = predicted(logits, gen.temperature, mask_id, group, gen.remasking == "low_confidence")
            if gen.remasking == "random":
                x0_conf = torch.rand((x.shape[0], width), device=device)[:, start:stop]
            confidence = torch.where(block_masked, x0_conf, float("-inf"))
            if gen.threshold is None:
                transfer = top_confident(confidence, schedule[step])
            else:
                transfer = threshold_transfer(confidence, gen.threshold)
            x[:, start:stop] = torch.where(transfer, x0, x[:, start:stop])
            step += 1
        total_steps += step
    tokens = [x[row, prompt_width:].tolist() for row in range(len(prompts))]
    return GenerationResult(tokens, forwards, total_steps)


def predicted(logits: torch.Tensor, temperature: float, mask_id: int, group: Group, confidence: bool):
    """(x0, its float64 softmax probability if `confidence` else None) per position: what low-confidence
    remasking ranks by. Under a split the logits are this rank's vocabulary columns: at T = 0 reduced over
    the ranks (decoding.most_likely), else gathered whole."""
    if group.world > 1 and temperature == 0 and confidence:
        return most_likely(logits.to(torch.float64), mask_id, group)
    logits = group.all_gather(logits)
    x0 = without_token(gumbel_max_scores(logits, temperature), mask_id).argmax(dim=-1)
    if not confidence:
        return x0, None
    return x0, logits.to(torch.float64).softmax(dim=-1).gather(-1, x0[..., None]).squeeze(-1)


def guided_logits(model, method: Method, ctx: StepContext, cfg_scale: float, in_prompt) -> torch.Tensor:
    """The method's logits for the block; with classifier-free guidance, mixed with the logits of the
    canvas whose prompt is masked: un + (scale + 1) * (cond - un)."""
    if cfg_scale > 0:
        unconditional = torch.where(in_prompt, ctx.mask_id, ctx.tokens)
        twice = lambda x: torch.cat([x, x])
        ctx = replace(ctx, tokens=torch.cat([ctx.tokens, unconditional]), positions=twice(ctx.positions),
                      valid=twice(ctx.valid), prompt_lengths=twice(ctx.prompt_lengths),
                      attn_mask=ctx.attn_mask.repeat(2))
    logits = method.logits(model, method.step(model, ctx), ctx)
    if cfg_scale <= 0:
        return logits
    cond, uncond = logits.chunk(2)
    return uncond + (cfg_scale + 1) * (cond - uncond)
