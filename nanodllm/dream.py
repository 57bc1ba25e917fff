"""Dream's decoding (diffusion_generate in Dream's generation_utils): the whole response at once.

Canvas = prompt ++ [mask] * gen_length, left-padded (pads are hidden keys; positions count from each
row's first prompt token), bidirectional attention, logits shifted by one position (cfg.logit_shift).
Timesteps linspace(1, eps, steps + 1); step i has t = ts[i], s = ts[i + 1] and, for every masked
position, a token drawn from the filtered logits (`sample_tokens`). By `alg`: origin unmasks each
with probability 1 - s / t (1 at the last step); maskgit_plus (the drawn token's probability),
topk_margin (top-1 minus top-2) and entropy (minus the entropy) rank the masked positions and the n
most confident of each row take their tokens, n = int(mean masked count per row (the batch mean, as
the reference computes it) * (1 - s / t)), all at the last step, or n drawn from softmax(confidence /
alg_temp). Temperature 0 takes the argmax: the reference's tokens for every alg but origin, whose
draws follow torch's generator in the reference's order. Every masked-engine method runs here (the
response is its one block); a method feeding part of the canvas takes the hidden state before it
from the column it feeds (Fast-dLLM, Sparse-dLLM) or from its last prompt refresh (dLLM-Cache, DyLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import CanvasMask
from .config import GenerationConfig
from .decoding import GenerationResult, check_method, check_prompts, filtered, left_padded_canvas
from .methods.base import Dense, Method, StepContext
from .parallel import group_of

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclass
class DreamSampling:
    """Dream's knobs beyond GenerationConfig's (gen_length, steps, temperature); defaults as Dream's
    README decodes (alg entropy, alg_temp 0), no top-p / top-k filter."""

    alg: str = "entropy"
    alg_temp: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    eps: float = 1e-3

    def __post_init__(self):
        if self.alg not in ALGORITHMS:
            raise ValueError(f"alg must be one of {', '.join(ALGORITHMS)}, got {self.alg!r}")
        if self.alg_temp < 0:
            raise ValueError(f"alg_temp must be >= 0, got {self.alg_temp}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0 < self.eps < 1:
            raise ValueError(f"eps must be in (0, 1), got {self.eps}")


def sample_tokens(logits: torch.Tensor, temperature: float, sampling: DreamSampling):
    """(confidence, token) per row of logits [n, vocab], the confidence by sampling.alg."""
    if temperature > 0:
        logits = logits / temperature
    probs = filtered(logits, sampling.top_p, sampling.top_k).softmax(dim=-1)
    if temperature > 0:
        tokens = torch.distributions.Categorical(probs=probs).sample()
        confidence = probs.gather(-1, tokens[:, None]).squeeze(-1)
    else:
        confidence, tokens = probs.max(dim=-1)
    if sampling.alg == "topk_margin":
        top2 = probs.topk(2, dim=-1).values
        confidence = top2[:, 0] - top2[:, 1]
    elif sampling.alg == "entropy":
        confidence = (probs * (probs + 1e-10).log()).sum(dim=-1)
    return confidence, tokens


def unmask(x, logits, start: int, fraction: float, last: bool, temperature: float, sampling: DreamSampling,
           mask_id: int):
    """One step: the canvas x [batch, width] updated in place from the logits [batch, width - start,
    vocab] of its response (columns start..); fraction = 1 - s / t. Scores span the whole canvas as
    the reference's do (alg_temp's draws then consume the same random numbers); identical to it
    whenever the prompt holds no mask token and every row has at least n masked positions."""
    masked = x == mask_id
    masked[:, :start] = False
    mask_logits = logits[masked[:, start:]]
    if sampling.alg == "origin":
        drafts = torch.full_like(x[masked], mask_id)
        taken = torch.rand(drafts.shape, device=x.device) < (1.0 if last else fraction)
        if bool(taken.any()):
            drafts[taken] = sample_tokens(mask_logits[taken], temperature, sampling)[1]
        x[masked] = drafts
        return
    confidence, tokens = sample_tokens(mask_logits, temperature, sampling)
    mean_masked = masked.sum() / masked.shape[0]
    count = int(mean_masked) if last else int(mean_masked * fraction)
    if count <= 0:
        return
    scores = torch.full(x.shape, float("-inf"), dtype=logits.dtype, device=x.device)
    scores[masked] = confidence
    if sampling.alg_temp:
        chosen = torch.multinomial(F.softmax(scores / sampling.alg_temp, dim=-1), num_samples=count)
    else:
        chosen = scores.topk(count, dim=-1).indices
    proposal = torch.full_like(x, mask_id)
    proposal[masked] = tokens
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    x[rows, chosen] = proposal[rows, chosen]


def generate(model, prompts, gen: GenerationConfig, method: Method | None = None, mask_id: int | None = None,
             pad_id: int | None = None, sampling: DreamSampling | None = None) -> GenerationResult:
    """Decode gen.gen_length tokens per prompt in gen.steps steps, as Dream's diffusion_generate."""
    cfg, method, sampling = model.cfg, method or Dense(), sampling or DreamSampling()
    group = group_of(model)
    check_method(method, cfg, "masked")
    if gen.block_length != gen.gen_length:
        raise ValueError(f"Dream decodes the whole response as one block: block_length ({gen.block_length}) "
                         f"must equal gen_length ({gen.gen_length})")
    if gen.threshold is not None or gen.cfg_scale > 0:
        raise ValueError("Dream's loop has no threshold or classifier-free guidance; leave them unset")
    mask_id = cfg.mask_token_id if mask_id is None else mask_id
    pad_id = cfg.eos_token_ids[0] if pad_id is None else pad_id
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.context_length, gen.gen_length)
    device = model.embed_tokens.weight.device
    canvas = left_padded_canvas(prompts, gen.gen_length, mask_id, pad_id, device)
    x, valid, positions, lengths, prompt_width = (canvas.tokens, canvas.valid, canvas.positions, canvas.lengths,
                                                  canvas.prompt_width)
    width = x.shape[1]
    attn_mask = CanvasMask(valid=valid if canvas.ragged else None)
    timesteps = torch.linspace(1, sampling.eps, gen.steps + 1, device=device)
    method.begin_block(StepContext(x, positions, valid, lengths, prompt_width=prompt_width, mask_id=mask_id))
    for step in range(gen.steps):
        ctx = StepContext(x, positions, valid, lengths, prompt_width=prompt_width, step=step, steps_per_block=gen.steps,
                          t=step, mask_id=mask_id, attn_mask=attn_mask, logits_start=prompt_width, logits_stop=width,
                          block_length=gen.gen_length)
        logits = group.all_gather(method.logits(model, method.step(model, ctx), ctx))  # whole rows (split vocabulary)
        t, s = timesteps[step], timesteps[step + 1]
        unmask(x, logits, prompt_width, float(1 - s / t), step == gen.steps - 1, gen.temperature, sampling, mask_id)
    tokens = [x[row, prompt_width:].tolist() for row in range(len(prompts))]
    return GenerationResult(tokens, gen.steps, gen.steps)
