"""Pieces the decoding loops share: prompt checks, the result type, canvases, the prefill, transfer
schedules and selection."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import CanvasMask
from .cache import KVCache
from .methods.base import Method, StepContext
from .parallel import Group

# A prefill forwards at most about this many tokens at once, whole rows at a time: its activations (a few
# [tokens, hidden] tensors) stay within a few GiB however many long prompts a batch holds.
PREFILL_TOKENS = 1 << 17


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per row (prompt excluded)
    forwards: int  # model forwards the engine asked for (cfg counts once)
    steps: int  # denoising steps taken (max over rows)
    cache: object = None  # block engine: the final KV cache (for inspection and tests)
    replays: int = 0  # steps and commits replayed from CUDA graphs (nanodllm/graphs.py)
    stats: dict = field(default_factory=dict)  # what the steps kept, read and computed (nanodllm/meter.py)


def until_stop(tokens: list[int], stop_ids) -> list[int]:
    """The tokens before the first stop token."""
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:index]
    return tokens


def engine_of(cfg) -> str:
    """'block' for block-causal models (SDAR, LLaDA2, Fast-dLLM v2), 'gemma' for DiffusionGemma's loop of
    canvases, else 'masked' (LLaDA, Dream)."""
    return {"block_causal": "block", "encoder_decoder": "gemma"}.get(cfg.attention, "masked")


def check_method(method: Method, cfg, engine: str | None = None):
    """A clear error where the method does not run on the engine (by default, the model's)."""
    engine = engine or engine_of(cfg)
    if engine not in method.engines:
        engines = " and ".join(method.engines) + " engine" + "s" * (len(method.engines) > 1)
        masks = engine == "gemma" and engines == "masked engine"
        why = " (it needs a [MASK] token, which DiffusionGemma has not)" if masks else ""
        raise ValueError(f"method {method.name!r} runs on the {engines}{why}; this {cfg.model_type} model decodes with "
                         f"the {engine} engine")


def refuse_shifted_logits(cfg):
    """Shifted-logit checkpoints (Dream, Fast-dLLM v2) predict token i from position i - 1 and decode
    with their own loops (nanodllm/dream.py, fast_dllm_v2.py); the engines would silently differ from
    the reference: a clear error instead."""
    if cfg.logit_shift:
        raise NotImplementedError(
            f"{cfg.model_type} checkpoints predict each token from the previous position (shifted logits) and "
            "decode with their family's own loop: call nanodllm.generate, which picks it")


def check_prompts(prompts, vocab_size: int, context_length: int, extra: int) -> list[list[int]]:
    """Validate a batch of token-id prompts before anything runs; returns plain int lists.

    `extra` is how many positions the engine adds after the longest prompt."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(isinstance(t, int) for t in prompts):
        prompts = [prompts]
    rows = []
    for row, prompt in enumerate(prompts):
        prompt = list(prompt)
        if not prompt:
            raise ValueError(f"prompt {row} is empty")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {row} has token ids outside [0, {vocab_size}): {bad[:5]}")
        if len(prompt) + extra > context_length:
            raise ValueError(
                f"prompt {row} has {len(prompt)} tokens; with {extra} more the sequence exceeds the "
                f"model's context of {context_length} (pass a larger context to stretch RoPE)"
            )
        rows.append(prompt)
    return rows


@dataclass
class Canvas:
    """Left-padded prompts followed by gen_length masks, so every row's generated region is the same
    columns: tokens [batch, width], valid [batch, width] (False at pads), positions [batch, width]
    (from 0 at each row's first prompt token), lengths [batch], prompt_width, ragged (any pads)."""

    tokens: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    prompt_width: int
    ragged: bool


def left_padded_canvas(prompts: list[list[int]], gen_length: int, mask_id: int, pad_id: int, device) -> Canvas:
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    prompt_width = int(lengths.max())
    columns = torch.arange(prompt_width + gen_length, device=device)[None, :]
    pads = (prompt_width - lengths)[:, None]
    tokens = torch.full((len(prompts), columns.shape[1]), mask_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : prompt_width - len(prompt)] = pad_id
        tokens[row, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt, device=device)
    return Canvas(tokens, columns >= pads, (columns - pads).clamp(min=0), lengths, prompt_width,
                  bool((pads > 0).any()))


def prompts_then_masks(prompts: list[list[int]], capacity: int, mask_id: int, device) -> torch.Tensor:
    """[batch, capacity]: each prompt from column 0, masks after it (blocks align to column 0)."""
    x = torch.full((len(prompts), capacity), mask_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        x[row, : len(prompt)] = torch.tensor(prompt, device=device)
    return x


def prefill_complete_blocks(model, method: Method, x, lengths, cache: KVCache, size: int, mask_id: int):
    """Each row's complete prompt blocks into the cache (method.prefill, block-causal), PREFILL_TOKENS
    at a time in whole rows. Returns (starts [batch]: the first column of each row's active block, the
    prefill's hidden states or None if no row has a complete block)."""
    starts = lengths // size * size
    if int(starts.max()) == 0:
        return starts, None
    batch, width = x.shape[0], int(starts.max())
    at_once = max(1, PREFILL_TOKENS // width)  # rows
    whole = at_once >= batch
    hidden, counts = None, []
    for first in range(0, batch, at_once):
        rows = slice(first, first + at_once)
        positions = torch.arange(width, device=x.device)[None, :].expand(x[rows].shape[0], -1)
        valid = positions < starts[rows, None]
        ctx = StepContext(x[rows, :width], positions, valid, lengths[rows], counts=starts[rows].clone(),
                          cache=cache if whole else cache.rows(first, first + at_once), block_length=size,
                          mask_id=mask_id, attn_mask=CanvasMask(valid=valid, block_size=size), phase="prefill")
        out = method.prefill(model, ctx)
        if whole:
            hidden = out
        else:  # the whole batch's, its rows filled as they come
            hidden = out.new_empty(batch, *out.shape[1:]) if hidden is None else hidden
            hidden[rows] = out
        counts.append(ctx.counts)
    cache.advance(torch.cat(counts))
    return starts, hidden


class MasksLeft:
    """How many positions of its active block each row has left to decode. Where every step unmasks
    exactly its scheduled count (no threshold) the host follows the numbers, since asking the device
    each step would wait for the GPU each step."""

    def __init__(self, masked: torch.Tensor, followed: bool):
        self.host = masked.sum(dim=-1).tolist() if followed else None

    def any(self, masked: torch.Tensor) -> bool:
        return any(self.host) if self.host is not None else bool(masked.any())

    def capped(self, scheduled: int) -> list[int] | None:
        """This step's scheduled count per row, capped at what the row has left (None: not followed)."""
        return None if self.host is None else [min(scheduled, n) for n in self.host]

    def take(self, counts: list[int] | None):
        if self.host is not None:
            self.host = [n - c for n, c in zip(self.host, counts)]


def split_evenly(total: torch.Tensor, steps: int) -> torch.Tensor:
    """How many tokens to unmask at each step: total // steps each, +1 for the first total % steps.

    total [batch] -> [batch, steps] (LLaDA's get_num_transfer_tokens; SDAR's with batch of one)."""
    base = total[:, None] // steps
    remainder = total[:, None] % steps
    return base + (torch.arange(steps, device=total.device)[None, :] < remainder).long()


def top_confident(confidence: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """Bool [batch, n]: per row the counts[row] positions of highest confidence (torch.topk per row, as
    the references do). counts: a host list where the host knows them, else a device tensor (read with a
    sync per row). index_fill_ takes True as an argument, where `transfer[row, indices] = True` copies it
    from pageable host memory to the GPU, which waits for the device every step."""
    transfer = torch.zeros_like(confidence, dtype=torch.bool)
    for row in range(confidence.shape[0]):
        k = int(counts[row])
        if k > 0:
            transfer[row].index_fill_(0, torch.topk(confidence[row], k).indices, True)
    return transfer


def threshold_transfer(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Fast-dLLM parallel decoding: every position with confidence >= threshold, and always the most
    confident one. Rows whose confidence is all -inf (nothing masked) transfer nothing."""
    transfer = confidence >= threshold
    best = confidence.argmax(dim=-1, keepdim=True)
    has_candidate = torch.isfinite(confidence).any(dim=-1, keepdim=True)
    return transfer.scatter(-1, best, has_candidate) | transfer & has_candidate


def filtered(logits: torch.Tensor, top_p: float | None, top_k: int | None) -> torch.Tensor:
    """Dream's top-p then top-k filters (Fast-dLLM v2 takes its top-p): removed entries get the dtype's
    lowest value."""
    lowest = torch.finfo(logits.dtype).min
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        beyond = sorted_logits.softmax(dim=-1).cumsum(dim=-1) > top_p
        beyond[..., 1:] = beyond[..., :-1].clone()  # keep the token that crosses top_p
        beyond[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond), lowest)
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, lowest)
    return logits


def without_token(scores: torch.Tensor, token_id: int, fill: float = float("-inf")) -> torch.Tensor:
    """A copy of scores [..., vocab] where `token_id` can never win (used to keep [MASK] from being
    predicted; the references would leave such a position masked, real models never do it). A plain
    index, not a tensor built from a list: copying that to the GPU would wait for the device every step."""
    scores = scores.clone()
    scores[..., token_id] = fill
    return scores


def most_likely(logits: torch.Tensor, mask_id: int, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its softmax probability) per position, the token the argmax other than [MASK], of logits
    [..., vocab / world]: this rank's vocabulary columns (parallel.VocabParallelHead). Each rank's best and
    log-sum-exp are gathered, three numbers a position instead of whole rows; the first rank's best wins a
    tie, as argmax takes the first index. Greedy decoding under a split; one process computes the same.
    In float32 or wider (the index travels as one of the numbers)."""
    logits = logits if logits.dtype.itemsize >= 4 else logits.float()
    first = group.rank * logits.shape[-1]
    scores = logits
    if first <= mask_id < first + logits.shape[-1]:
        scores = without_token(logits, mask_id - first)
    best, index = scores.max(dim=-1)
    local = torch.stack([best, (index + first).to(logits.dtype), logits.logsumexp(dim=-1)])
    ranks = group.all_gather(local[None], dim=0)  # [world, 3, ...]
    winner = ranks[:, 0].argmax(dim=0, keepdim=True)
    best, token = (ranks[:, part].gather(0, winner)[0] for part in (0, 1))
    return token.long(), (best - ranks[:, 2].logsumexp(dim=0)).exp()
