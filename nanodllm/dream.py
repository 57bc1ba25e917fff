"""Dream's decoding (diffusion_generate in Dream's generation_utils): the whole response at once.

Canvas = prompt ++ [mask] * gen_length, prompts left-padded (pads are hidden keys; positions count
from each row's first prompt token), bidirectional attention, logits shifted by one position (the
model does that: cfg.logit_shift). Timesteps linspace(1, eps, steps + 1); step i has t = ts[i],
s = ts[i + 1] and, for every still-masked position, a token drawn from the filtered logits
(`sample_tokens`). Then, by `alg`:
    origin          every masked position takes its token with probability 1 - s / t (1 at the last step);
    maskgit_plus    confidence = the probability of the drawn token,
    topk_margin     confidence = top-1 minus top-2 probability,
    entropy         confidence = minus the entropy of the distribution;
                    the n most confident masked positions of each row take their tokens, with
                    n = int(mean masked count per row * (1 - s / t)) (all of them at the last step)
                    -- the mean over the batch, as the reference computes it -- or, with alg_temp > 0,
                    n positions drawn from softmax(confidence / alg_temp).
Sampling: logits / temperature, then the top_p and top_k filters; temperature 0 takes the argmax and
its probability. Token for token the reference's at temperature 0 for every alg but origin, whose
draws (like every temperature > 0 draw) follow torch's global generator in the reference's order.

Every masked-engine method runs here (the response is their one block); those that feed part of the
canvas take the hidden state just before it from the column they feed in addition (Fast-dLLM's
caches, Sparse-dLLM) or from the last step that computed the prompt (dLLM-Cache, MaskKV, DyLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import CanvasMask
from .config import GenerationConfig
from .decoding import GenerationResult, check_prompts, left_padded_canvas
from .graphs import Steps
from .methods.base import Dense, Method, StepContext

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


def filtered(logits: torch.Tensor, top_p: float | None, top_k: int | None) -> torch.Tensor:
    """Dream's top-p then top-k filters: removed entries get the dtype's lowest value."""
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
    if "masked" not in method.engines:
        raise ValueError(f"method {method.name!r} runs on the {' and '.join(method.engines)} engine; Dream decodes "
                         "the whole canvas (the masked engine)")
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
    method.begin_block(StepContext(x, positions, valid, lengths, block=0, mask_id=mask_id))
    steps = Steps(method)
    for step in range(gen.steps):
        ctx = StepContext(x, positions, valid, lengths, block=0, step=step, steps_per_block=gen.steps,
                          mask_id=mask_id, attn_mask=attn_mask, logits_start=prompt_width, logits_stop=width,
                          block_length=gen.gen_length)
        logits = steps.step(model, ctx)
        t, s = timesteps[step], timesteps[step + 1]
        unmask(x, logits, prompt_width, float(1 - s / t), step == gen.steps - 1, gen.temperature, sampling, mask_id)
    tokens = [x[row, prompt_width:].tolist() for row in range(len(prompts))]
    return GenerationResult(tokens, gen.steps, gen.steps, replays=steps.replays)
