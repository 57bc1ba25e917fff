"""Fast-dLLM v2's decoding (its model's generate(), without the sub-block cache the reference leaves off).

Blocks of B = bd_size tokens, aligned to position 0, decoded in sub-blocks against an exact KV cache.
The prompt's complete blocks are prefilled; a prompt ending on a block boundary gets the next block's
first token from the prefill's last logits (argmax). Each step forwards the active block [decoded
start, masks] against the read-only cache, shifts its logits by one inside the block (position 0
keeps its own), and in the current sub-block unmasks every masked position above `threshold` and
always the most probable one. A finished block is committed (its KV appended; the argmax of its last
logits is the next block's first token). A row stops at a stop token with no mask before it in its
block (that block is not committed), at a block whose first token is a stop, or after gen_length // B
blocks; it returns what it generated up to and with its first stop token. Sampling: temperature 0 the
argmax; T > 0 draws after the top-p filter, row by row (the reference draws for row 0 only); [MASK]
never wins; every id of cfg.eos_token_ids stops (the reference watches 151645 only). A prompt of
exactly B tokens is prefilled like any other (the reference's first block would not see it).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .cache import KVCache
from .config import GenerationConfig
from .decoding import (GenerationResult, check_method, check_prompts, filtered, prefill_complete_blocks,
                       most_likely, prompts_then_masks, without_token)
from .methods.base import Dense, Method, StepContext
from .parallel import SINGLE, Group, group_of


def sample_with_top_p(logits: torch.Tensor, temperature: float, top_p: float, mask_id: int, group: Group = SINGLE):
    """(tokens, their probability) per position of logits [batch, n, vocab]; [MASK] is never the token
    (the reference would leave such a position masked and, if it is the most probable, loop forever).
    Under a split the logits are this rank's vocabulary columns (decoding.most_likely at T = 0)."""
    if group.world > 1:
        if temperature == 0:
            tokens, probs = most_likely(logits, mask_id, group)
            return tokens, probs.to(logits.dtype)
        logits = group.all_gather(logits)
    if temperature == 0:
        probs = logits.softmax(dim=-1)  # in the logits' dtype, as the reference
        tokens = without_token(probs, mask_id, 0.0).argmax(dim=-1)
    else:
        probs = filtered(logits / temperature, top_p, None).softmax(dim=-1)
        allowed = without_token(probs, mask_id, 0.0)
        tokens = torch.multinomial(allowed.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1)


def next_token(model, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[batch] argmax of the (unshifted) logits of hidden [batch, t, H] at columns last [batch]."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return group_of(model).all_gather(model.lm_head(model.norm(hidden[rows, last.clamp(min=0)]))).argmax(dim=-1)


def stopped(block: torch.Tensor, begin: torch.Tensor, mask_id: int, stops: torch.Tensor) -> torch.Tensor:
    """[batch] bool: a stop token (one of stops) at or after column begin[b] of the block with no mask
    before it."""
    columns = torch.arange(block.shape[1], device=block.device)[None, :]
    generated = columns >= begin[:, None]
    is_stop = generated & torch.isin(block, stops)
    first_stop = torch.where(is_stop, columns, block.shape[1]).min(dim=1).values
    masks_before = ((block == mask_id) & (columns < first_stop[:, None])).any(dim=1)
    return is_stop.any(dim=1) & ~masks_before


@torch.no_grad()
def generate(model, prompts, gen: GenerationConfig, method: Method | None = None, mask_id: int | None = None,
             stop_ids=None, sub_block: int = 8, top_p: float = 0.95) -> GenerationResult:
    cfg, method = model.cfg, method or Dense()
    group = group_of(model)
    check_method(method, cfg, "block")
    size = cfg.block_size
    sub_block = min(sub_block, size)  # a block smaller than the default sub-block is one sub-block
    if gen.block_length != size:
        raise ValueError(f"Fast-dLLM v2 decodes blocks of its bd_size: block_length ({gen.block_length}) "
                         f"must be {size}")
    if size % sub_block:
        raise ValueError(f"sub_block ({sub_block}) must divide the block size ({size})")
    if gen.cfg_scale > 0 or gen.remasking not in ("low_confidence", "low_confidence_dynamic"):
        raise ValueError("Fast-dLLM v2's loop unmasks by threshold (gen.threshold; unset = 1, one token per step); "
                         "leave cfg_scale and remasking at their defaults")
    threshold = 1.0 if gen.threshold is None else gen.threshold
    mask_id = cfg.mask_token_id if mask_id is None else mask_id
    stop_ids = tuple(cfg.eos_token_ids if stop_ids is None else stop_ids)
    num_blocks = gen.gen_length // size
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.context_length, (num_blocks + 1) * size)
    device = model.embed_tokens.weight.device
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    capacity = int((lengths // size).max() + num_blocks + 2) * size
    x = prompts_then_masks(prompts, capacity, mask_id, device)
    layer_cfg = model.layers[0].cfg  # a layer's config: this rank's share of the KV heads
    cache = KVCache.for_model(layer_cfg, batch, capacity + size, device, model.embed_tokens.weight.dtype)
    rows, offsets = torch.arange(batch, device=device), torch.arange(size, device=device)

    starts, hidden = prefill_complete_blocks(model, method, x, lengths, cache, size, mask_id)
    on_boundary = lengths % size == 0  # the prompt fills its last block: the prefill gives the next token
    forwards = taken = 0
    if hidden is not None:
        first = next_token(model, hidden, starts - 1)
        x[rows[on_boundary], starts[on_boundary]] = first[on_boundary]
        forwards += 1
    ends = torch.where(on_boundary, starts + 1, starts)  # one past each row's last written token
    begin = torch.where(on_boundary, 1, lengths - starts)  # where the active block's masks start
    active = torch.ones(batch, dtype=torch.bool, device=device)
    stops = torch.tensor(stop_ids, device=device)
    for block in range(num_blocks):
        active &= ~(torch.isin(x[rows, starts], stops) & (starts >= lengths))  # it begins with a generated stop
        if not active.any():
            break
        live = active.clone()
        columns = starts[:, None] + offsets
        current = x[rows[:, None], columns]
        at_block = StepContext(current, columns, torch.ones_like(current, dtype=torch.bool), lengths, block=block,
                               steps_per_block=size, t=taken, mask_id=mask_id, cache=cache, block_length=size)
        method.begin_block(at_block)
        step = 0  # within the block (at most one step per masked position: steps_per_block = size)
        for sub in range(0, size, sub_block):
            while True:
                active &= ~stopped(current, begin, mask_id, stops)
                todo = (current == mask_id) & active[:, None] & (offsets >= sub) & (offsets < sub + sub_block)
                if not todo.any():
                    break
                ctx = replace(at_block, tokens=current, step=step, t=taken)
                logits = method.logits(model, method.step(model, ctx), ctx)
                tokens, probs = sample_with_top_p(logits, gen.temperature, top_p, mask_id, group)
                forwards, taken, step = forwards + 1, taken + 1, step + 1
                confidence = torch.where(todo, probs, float("-inf"))
                best = torch.zeros_like(todo).scatter_(1, confidence.argmax(dim=1, keepdim=True), True)
                current = torch.where(((confidence > threshold) | best) & todo, tokens, current)
        x[rows[:, None], columns] = current
        ends = torch.where(live, starts + size, ends)
        committing = active & ~(current == mask_id).any(dim=1)
        if not committing.any():
            break
        committed = replace(at_block, tokens=current, step=step, t=taken, counts=torch.where(committing, size, 0),
                            phase="commit")
        following = next_token(model, method.commit(model, committed), torch.full_like(starts, size - 1))
        cache.advance(committed.counts)
        forwards += 1
        x[rows[committing], starts[committing] + size] = following[committing]
        ends = torch.where(committing, starts + size + 1, ends)
        starts = torch.where(committing, starts + size, starts)
        begin = torch.ones_like(begin)
        active &= committing
    tokens = []
    for row in range(batch):
        generated = x[row, int(lengths[row]) : int(ends[row])].tolist()
        stop_at = next((i for i, token in enumerate(generated) if token in stop_ids), None)
        tokens.append(generated if stop_at is None else generated[: stop_at + 1])
    return GenerationResult(tokens, forwards, taken, cache)
