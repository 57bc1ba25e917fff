"""Fast-dLLM v2's decoding (its model's generate(), without the sub-block cache): blocks of B = bd_size
tokens, each decoded in sub-blocks, with an exact KV cache and an autoregressive first token.

Blocks are aligned to position 0. The prompt's complete blocks are prefilled into the cache; when the
prompt ends exactly on a block boundary, the prefill's last logits (argmax) give the first token of
the next block. A row's active block is then [its decoded start (the prompt's tail, or that first
token), masks]. The block's sub-blocks of `sub_block` tokens are decoded in order: each step forwards
the whole block against the read-only cache (bidirectional inside the block), shifts its logits by
one position inside the block (position i reads the logits of i - 1; position 0, always decoded, its
own), and in the current sub-block unmasks every masked position whose probability exceeds
`threshold` and always the most probable one. A block with no mask left is committed: one forward of
the clean block appends its KV, and the argmax of its last logits is the next block's first token.
A row stops once a stop token stands in its current block with no mask before it (such a block is
not committed), when a block's first token is a stop token, or after gen_length // B blocks. Its tokens: everything generated up to its first stop token (kept), the
first token of the block after the last one included, as the reference returns them.

Sampling: temperature 0 takes the argmax and its softmax probability; T > 0 draws from softmax(logits
/ T) after the top-p filter (Dream's, nanodllm/dream.py), row by row (the reference draws for batch
row 0 only). [MASK] is never the chosen token (the reference has no such guard). Stop tokens: every id of cfg.eos_token_ids (the reference watches 151645 only).
The sub-block cache (use_block_cache) is an approximation the reference leaves off by default; not here.
Methods: any block-engine method (its hooks: prefill, begin_block, step / attend against the cache,
commit); a block's steps count from 0 and steps_per_block is B (the most a block can take), which
SparseD's exact fraction reads. One deliberate difference: a prompt
of exactly B tokens is prefilled like any other (the reference prefills only prompts longer than B,
so at exactly B its first block never sees the prompt).
"""

from __future__ import annotations

import torch

from .cache import KVCache
from .config import GenerationConfig
from .decoding import GenerationResult, check_prompts, prefill_complete_blocks, prompts_then_masks, without_token
from .dream import filtered
from .graphs import Steps
from .methods.base import Dense, Method, StepContext


def sample_with_top_p(logits: torch.Tensor, temperature: float, top_p: float, mask_id: int):
    """(tokens, their probability) per position of logits [batch, n, vocab]; [MASK] is never the token
    (the reference would leave such a position masked and, if it is the most probable, loop forever)."""
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
    return model.lm_head(model.norm(hidden[rows, last.clamp(min=0)])).argmax(dim=-1)


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
    if "block" not in method.engines:
        raise ValueError(f"method {method.name!r} runs on the {' and '.join(method.engines)} engine; Fast-dLLM v2 "
                         "models decode block by block against the KV cache")
    size = cfg.block_size
    sub_block = min(sub_block, size)  # a block smaller than the default sub-block is one sub-block
    if gen.block_length != size:
        raise ValueError(f"Fast-dLLM v2 decodes blocks of its bd_size: block_length ({gen.block_length}) must be {size}")
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
    cache = KVCache.for_model(cfg, batch, capacity + size, device, model.embed_tokens.weight.dtype)
    rows, offsets = torch.arange(batch, device=device), torch.arange(size, device=device)

    steps = Steps(method)
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
        ctx = StepContext(current, columns, torch.ones_like(current, dtype=torch.bool), lengths, block=block,
                          steps_per_block=size, mask_id=mask_id, cache=cache, block_length=size)
        method.begin_block(ctx)
        step = 0  # within the block (at most one step per masked position: steps_per_block = size)
        for sub in range(0, size, sub_block):
            while True:
                active &= ~stopped(current, begin, mask_id, stops)
                todo = (current == mask_id) & active[:, None] & (offsets >= sub) & (offsets < sub + sub_block)
                if not todo.any():
                    break
                ctx.tokens, ctx.step = current, step
                tokens, probs = sample_with_top_p(steps.step(model, ctx), gen.temperature, top_p, mask_id)
                forwards, taken, step = forwards + 1, taken + 1, step + 1
                confidence = torch.where(todo, probs, float("-inf"))
                best = torch.zeros_like(todo).scatter_(1, confidence.argmax(dim=1, keepdim=True), True)
                current = torch.where(((confidence > threshold) | best) & todo, tokens, current)
        x[rows[:, None], columns] = current
        ends = torch.where(live, starts + size, ends)
        committing = active & ~(current == mask_id).any(dim=1)
        if not committing.any():
            break
        ctx.tokens, ctx.counts, ctx.phase = current, torch.where(committing, size, 0), "commit"
        following = next_token(model, steps.commit(model, ctx), torch.full_like(starts, size - 1))
        cache.advance(ctx.counts)
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
    return GenerationResult(tokens, forwards, taken, cache, steps.replays)
