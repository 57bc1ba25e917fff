"""DiffusionGemma's decoding (transformers' DiffusionGemmaGenerationMixin.generate): canvas by canvas.

The prompt is encoded (causal; its K/V join the cache, nanodllm/gemma_cache.py). Each canvas of
canvas_length tokens starts as uniform noise and is denoised against the cache for at most N =
gen.steps steps, n = N .. 1 counting the steps left: z = logits / T with T = t_min + (t_max - t_min)
n / N; each position draws a token from softmax(z); the lowest-entropy positions whose summed entropy,
less the largest, stays within entropy_bound keep their draws and the others take fresh noise
(https://arxiv.org/abs/2505.24857); z self-conditions the next step. A row is done with the canvas
once its argmax canvas equals the last stability_threshold ones and its mean entropy is below
confidence_threshold; its argmax stays while the others go on. The argmax canvas is committed: encoded
where it stood. A stop token finishes a row: pads after it and in its later canvases, which it still
computes, as transformers does. Left-padded prompts: pads are keys no token reads. The random calls are
transformers', in its order: under torch.manual_seed on the CPU the tokens equal its generate()'s;
sample=False is deterministic (argmax, seeded noise). A method (engine "gemma") sees each canvas as a
block: begin_block, then attend on the full layers (with sparse_prefill, the prompt's pass too: MOMO)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import torch

from nanodllm.kernels.softmax_stats import softmax_stats, softmax_stats_reference

from .attention import CanvasMask, use_kernels
from .config import GenerationConfig
from .decoding import GenerationResult, check_method, check_prompts, left_padded_canvas, until_stop
from .graphs import GRAPHS_ENABLED, remembering
from .meter import Meter
from .methods.base import Dense, Method, StepContext


RELEASED_STEPS = 48  # the released generation_config.json's max_denoising_steps: gen.steps' default


@dataclass
class GemmaSampling:
    """The sampler's knobs beyond GenerationConfig's (gen_length, steps = the most denoising steps per
    canvas); defaults as the released generation_config.json."""

    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    sample: bool = True  # False: argmax tokens and noise from torch.Generator().manual_seed(seed)
    seed: int = 0

    def __post_init__(self):
        if not self.t_max > self.t_min >= 0:
            raise ValueError(f"need t_max > t_min >= 0, got t_min={self.t_min}, t_max={self.t_max}")
        if self.entropy_bound <= 0 or self.confidence_threshold <= 0:
            raise ValueError(f"entropy_bound ({self.entropy_bound}) and confidence_threshold "
                             f"({self.confidence_threshold}) must be > 0")
        if self.stability_threshold < 0:
            raise ValueError(f"stability_threshold must be >= 0, got {self.stability_threshold}")


@dataclass
class CanvasResult(GenerationResult):
    steps_per_canvas: list[list[int]] = field(default_factory=list)  # per row, its denoising steps per canvas
    tokens_per_forward: list[float] = field(default_factory=list)  # per row, its tokens / its denoising steps


def temperature(left: int, steps: int, sampling: GemmaSampling) -> torch.Tensor:
    """T with `left` of `steps` steps to go: t_max at the first, just above t_min at the last. A float32
    tensor, as transformers computes it (the bits of z depend on it)."""
    return sampling.t_min + (sampling.t_max - sampling.t_min) * (torch.tensor(left, dtype=torch.int32) / steps)


def accepted(entropies: torch.Tensor, bound: float) -> torch.Tensor:
    """Bool [b, t]: the lowest-entropy positions whose entropies, all but the largest, sum to at most
    bound (the lowest is always among them)."""
    ascending, order = torch.sort(entropies, dim=-1)
    kept = ascending.cumsum(dim=-1) - ascending <= bound
    return torch.zeros_like(kept).scatter(-1, order, kept)


def stopping(history: torch.Tensor, argmax: torch.Tensor, entropies: torch.Tensor, sampling: GemmaSampling):
    """(bool [b]: argmax [b, t] equals every canvas of history [k, b, t] (-1: none yet) and the mean of
    entropies [b, t] is below confidence_threshold; the history with argmax in place of its oldest)."""
    stable = (history == argmax[None]).all(dim=-1).all(dim=0)
    confident = entropies.mean(dim=-1) < sampling.confidence_threshold
    return stable & confident, torch.cat([history, argmax[None]])[1:]


def finish(canvas: torch.Tensor, finished: torch.Tensor, stops: torch.Tensor, pad_id: int):
    """(canvas [b, t] with pads after each row's first stop token and in rows finished before, the
    rows finished now or before)."""
    is_stop = torch.isin(canvas, stops)
    after_stop = is_stop.cumsum(dim=-1) - is_stop.long() > 0
    padded = canvas.masked_fill(after_stop | finished[:, None], pad_id)
    return padded, finished | is_stop.any(dim=-1)


def prompt_context(model, cache, tokens: torch.Tensor, valid: torch.Tensor,
                   prompt_lengths: torch.Tensor) -> StepContext:
    """What a sparse_prefill method reads of the prompt's encoder pass into the empty cache: causal, pads hidden."""
    positions = model.positions(cache, tokens.shape[1]).expand(tokens.shape[0], -1)
    return StepContext(tokens, positions, valid, prompt_lengths, attn_mask=CanvasMask(valid, block_size=1),
                       cache=cache.full, phase="prefill")


@torch.no_grad()
def generate(model, prompts, gen: GenerationConfig, method: Method | None = None, stop_ids=None,
             pad_id: int | None = None, sampling: GemmaSampling | None = None) -> CanvasResult:
    """Decode ceil(gen.gen_length / canvas_length) canvases per prompt, at most gen.steps steps each."""
    cfg, sampling, method = model.cfg, sampling or GemmaSampling(), method or Dense()
    check_method(method, cfg)
    if getattr(method, "sparse_commit", False):  # MAGE's, Quest's and SparseD's knob
        raise ValueError(f"{method.name}: sparse_commit has no {cfg.model_type} counterpart (a canvas is committed "
                         "by the encoder pass, which attends exactly)")
    # a method whose steps attend exactly reads the model's own attention, which adds in transformers' order
    exact = type(method).attend is Method.attend or method.sparse_prefill
    if gen.threshold is not None or gen.cfg_scale > 0 or gen.temperature > 0:
        raise ValueError(f"{cfg.model_type}'s loop has no threshold, guidance or fixed temperature (its schedule "
                         "is GemmaSampling's t_max .. t_min); leave them unset")
    size = cfg.gemma.canvas_length
    if gen.block_length != size:
        raise ValueError(f"{cfg.model_type} decodes canvases of {size} tokens: block_length ({gen.block_length}) "
                         f"must be {size}")
    canvases = -(-gen.gen_length // size)
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.context_length, canvases * size)
    pad_id = cfg.gemma.pad_token_id if pad_id is None else pad_id
    device, batch = model.embed_tokens.weight.device, len(prompts)
    stops = torch.tensor(cfg.eos_token_ids if stop_ids is None else tuple(stop_ids), dtype=torch.long, device=device)
    generator = None if sampling.sample else torch.Generator(device).manual_seed(sampling.seed)
    noise = lambda: torch.randint(0, cfg.vocab_size, (batch, size), device=device, generator=generator)

    prompt = left_padded_canvas(prompts, 0, pad_id, pad_id, device)  # no masks: the prompt alone
    cache = model.empty_cache(batch, prompt.tokens.shape[1] + canvases * size)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    context = lambda canvas, step, x: StepContext(  # what a method's hooks read of a denoising step
        x, model.positions(cache, size).expand(batch, -1), torch.ones_like(x, dtype=torch.bool), prompt_lengths,
        block=canvas, step=step, steps_per_block=gen.steps, t=steps, logits_stop=size, block_length=size,
        cache=cache.full)
    to_encode, valid = prompt.tokens, prompt.valid
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # a stop token in an earlier canvas
    committed, steps_per_canvas, passes, forwards, steps = [], [[] for _ in prompts], 0, 0, 0
    meter = Meter()  # what the method's steps read of the full layers' cache
    # a denoising step only reads the cache, which keeps what steps read in place from commit to commit: where
    # the model allows, a step of a kind (the method's step_kind; None: eager) and a launch (model.launch_key)
    # is recorded as a CUDA graph (nanodllm/graphs.py) and later ones replay it, in this canvas and the next
    # ones; a canvas's first step (no self-conditioning) is a kind of its own. Exact steps go to the recordings
    # from the first, a method's where its kind repeats the step before's (a kind that does not, a selecting
    # step, runs eagerly); so do commits (the encoder's pass over a canvas); the sampler reads a step's logits
    # before the next replay
    recordings = remembering(model, method, copy_outputs=False) if GRAPHS_ENABLED and model.replayable else None
    dtype = model.embed_tokens.weight.dtype
    sampler_stats = softmax_stats if use_kernels(model.embed_tokens.weight) else softmax_stats_reference
    prefill = prompt_context(model, cache, prompt.tokens, prompt.valid, prompt_lengths)
    prefill_full = partial(method.attend, ctx=prefill) if method.sparse_prefill else None
    for canvas in range(canvases):
        if canvas and recordings is not None:  # a commit's layers as a graph too, the cache's length moved after
            recordings(("commit", *model.launch_key(cache, size)), partial(model.encoded, cache=cache), to_encode)
            cache.advance(torch.ones_like(to_encode, dtype=torch.bool))
        else:
            model.encode(to_encode, cache, valid, prefill_full if canvas == 0 else None)
        forwards += 1
        x = argmax = noise()  # [b, size]
        self_conditioning = None
        history = torch.full((sampling.stability_threshold, batch, size), -1, dtype=torch.long, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)  # this canvas needs no more steps
        counted = torch.zeros(batch, dtype=torch.long, device=device)
        method.begin_block(context(canvas, 0, x))
        last_kind = None
        for step, left in enumerate(range(gen.steps, 0, -1)):
            counted += ~(done | finished)
            ctx = context(canvas, step, x)
            kind = () if exact else method.step_kind(ctx)

            def step_logits(tokens, positions, *last_logits, ctx=ctx):  # a recording's inputs where it replays
                ctx = replace(ctx, tokens=tokens, positions=positions)
                attend_full = None if exact else partial(method.attend, ctx=ctx)
                hidden = model.denoised(tokens, cache, last_logits[0] if last_logits else None, attend_full)
                return method.logits(model, hidden, ctx)

            inputs = (x, ctx.positions) + (() if self_conditioning is None else (self_conditioning,))
            # a method sizes its launches by the full layers' launch bound (KVCache.launch_length), which moves as
            # the cache grows; the model's own attention reads the whole cache, a shape that lasts the generation
            method_bound = () if exact else (cache.full.launch_length(size),)
            key = (kind, self_conditioning is None, *model.launch_key(cache, size), *method_bound)
            if recordings is not None and kind is not None and (exact or kind == last_kind or key in recordings):
                logits = recordings(key, step_logits, *inputs)
            else:
                logits = step_logits(*inputs)
            last_kind = kind
            # z = logits / T: z in the weights' dtype (the next step's self-conditioning), argmax z, the
            # entropies and a token drawn from softmax(z) (or its argmax), [b, size, V] floats read a few times
            # on the kernels, some twenty in torch
            stats = sampler_stats(logits, temperature(left, gen.steps, sampling), dtype, sampling.sample, generator)
            meter.count(method, ctx)
            argmax = torch.where(done[:, None], argmax, stats.argmax)
            x = torch.where(accepted(stats.entropy, sampling.entropy_bound), stats.drawn, noise())
            stop, history = stopping(history, argmax, stats.entropy, sampling)
            done |= stop
            self_conditioning = stats.scaled
            forwards, steps = forwards + 1, steps + 1
            if done.all():
                break
        for row in range(batch):
            if not finished[row]:
                steps_per_canvas[row].append(int(counted[row]))
        passes = passes + counted
        to_encode, finished = finish(argmax, finished, stops, pad_id)
        valid = None  # a committed canvas has no pads
        committed.append(to_encode)
        if finished.all():
            break

    sequences = torch.cat(committed, dim=1).tolist()
    tokens = [row[: len(until_stop(row, stops.tolist())) + 1] for row in sequences]  # with the stop token
    per_forward = [len(row) / max(int(n), 1) for row, n in zip(tokens, passes.tolist())]
    return CanvasResult(tokens, forwards, steps, cache, replays=recordings.replays if recordings else 0,
                        stats=meter.stats(), steps_per_canvas=steps_per_canvas, tokens_per_forward=per_forward)
