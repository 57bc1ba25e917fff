"""Run dense decoding and one training-free method side by side on the same prompt.

    python -m nanodllm demo --method maskkv      (in a checkout also: python train_free_demo.py ...)
    python -m nanodllm demo --method maskkv --knobs budget=64
    python -m nanodllm demo --model DIR --method dense --prompt "..."

Prints both outputs, how many generated tokens agree, tokens/s of each run, the share of the prompt's
KV it kept (and of canvas rows it computed, where counted) and, on a GPU, its peak memory. Where a
method's default budget would keep most of the prompt, the demo sets it to about a quarter of the
prompt and says so (--knobs overrides). On the block engine the tokens fill whole blocks, at least
--gen-length; DiffusionGemma fills whole canvases, its sampler in the deterministic mode, and reports
its denoising steps per canvas and tokens per step. Without --model the demo uses the tiny trained
model in nanodllm/assets of the method's first engine (tiny-llada: masked diffusion, tiny-sdar: block
diffusion; MOMO, which serves both, is shown on the block engine's prefill) and, without --prompt, a
built-in long-context passkey prompt whose answer it prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from . import tasks
from .cli import (HelpFormatter, available_device, check_fits, check_steps, positive_int, read_text, run_main,
                  tensor_parallel)
from .config import GenerationConfig, ModelConfig, default_block_length, default_threshold
from .decoding import check_method, engine_of, until_stop
from .eval import with_profile
from .gemma_loop import RELEASED_STEPS, GemmaSampling
from .generation import generate
from .loader import CheckpointError, load_model
from .methods import METHODS, get_method, knob_defaults, parse_knobs
from .tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parent / "assets"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_LENGTH = 1024
BUDGETS = {"maskkv": "budget", "snapkv": "budget", "mage": "k", "quest": "k", "sparsed": "k"}  # prompt keys kept
UNCOUNTED = {"momo": "momo sparsifies the prefill's attention, which 'KV kept' (what the denoising steps read) "
                     "leaves out; it selects only in prompts longer than k x beta tokens"}


def parse_args(argv, prog=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (config.json, safetensors, tokenizer.json); "
                        "default: tiny-llada or tiny-sdar, by the method's engine")
    parser.add_argument("--method", default="dense", help=f"one of: {', '.join(sorted(METHODS))}")
    parser.add_argument("--knobs", help="the method's knobs, e.g. budget=64 or k=64,exact_layers=2 (default: the "
                        "paper's; the docstring of nanodllm/methods/<method>.py says what each does)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="default: a built-in passkey retrieval prompt")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from this text file (a long context)")
    parser.add_argument("--length", "--context", dest="length", type=positive_int,
                        help=f"length of the built-in prompt in tokens (default {DEFAULT_LENGTH}; 2048 for the "
                        "long version); not with --prompt or --prompt-file")
    parser.add_argument("--no-chat", action="store_true", help="encode the prompt as raw text, no chat template")
    parser.add_argument("--gen-length", type=positive_int, default=32,
                        help="tokens to generate (the block engine fills whole blocks: at least this many)")
    parser.add_argument("--block-length", type=positive_int,
                        help="default: min(32, gen-length) (LLaDA) or the config's block_size (SDAR)")
    parser.add_argument("--steps", type=positive_int,
                        help="default: gen-length (LLaDA) or block-length (SDAR, per block)")
    parser.add_argument("--threshold", type=float, help="confidence-threshold parallel decoding")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: the most probable token")
    parser.add_argument("--device", type=available_device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the weights' and activations' type")
    parser.add_argument("--tp", type=positive_int, default=1, help="split the model over this many GPUs (tensor and "
                        "expert parallelism), one process each: torchrun --nproc-per-node N -m nanodllm demo --tp N")
    args = parser.parse_args(argv)
    if args.length is not None and (args.prompt is not None or args.prompt_file is not None):
        parser.error("--length sets the built-in prompt's length; with --prompt or --prompt-file it does nothing")
    args.length = args.length or DEFAULT_LENGTH
    return args


def run(model, prompt_ids, gen, method, stop_ids, device):
    """Generate once; returns (tokens, seconds, what the run used: GPU memory, the share of KV kept and, for
    DiffusionGemma, what its sampler did). DiffusionGemma decodes in its deterministic mode (argmax tokens,
    seeded renoise), so that dense and the method differ only by what the method reads."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    options = {"sampling": GemmaSampling(sample=False)} if model.cfg.gemma is not None else {}
    result = generate(model, [prompt_ids], gen, method, stop_ids=stop_ids, **options)
    used = kv_summary(result.stats, len(prompt_ids))
    if options:
        steps = result.steps_per_canvas[0]
        canvases = f"{len(steps)} canvas{'es' if len(steps) > 1 else ''} ({', '.join(map(str, steps))})"
        used += (f"; sampler: {sum(steps)} denoising steps over {canvases}, "
                 f"{result.tokens_per_forward[0]:.2f} tokens per step")
    if device.type == "cuda":  # on a CPU only the process's peak is known, which one run cannot be told by
        torch.cuda.synchronize()
        used = f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB, {used}"
    return result.tokens[0], time.perf_counter() - start, used


def warm_up_gpu(model, prompt_ids, gen, settings: dict, stop_ids, device) -> float | None:
    """On a GPU, each method's first generation in a process also loads (or, on a new machine,
    compiles) its Triton kernels: run each once untimed and return the seconds that took. None on a
    CPU, where nothing is compiled."""
    if device.type != "cuda":
        return None
    start = time.perf_counter()
    for name, knobs in settings.items():
        run(model, prompt_ids, gen, get_method(name, **knobs), stop_ids, device)
    return time.perf_counter() - start


def kv_summary(stats: dict, prompt_tokens: int) -> str:
    """What the method kept or read of the KV and, where it counts them, the canvas rows it computed:
    'KV kept 100%', or 'KV kept 25% (256 of 1042 prompt tokens per head on average), rows computed 9%'."""
    kept = stats.get("kv_kept", 1.0)
    text = f"KV kept {kept:.0%}"
    if kept < 1:
        text += f" ({kept * prompt_tokens:.0f} of {prompt_tokens} prompt tokens per head on average)"
    if "rows_computed" in stats:
        text += f", rows computed {stats['rows_computed']:.0%}"
    return text


def demo_budget(name: str, knobs: dict, prompt_tokens: int) -> tuple[dict, str | None]:
    """(knobs, a note): where the method's default budget (BUDGETS) keeps more than half the prompt,
    so that little or nothing is left out, the budget set to about a quarter of the prompt (whole
    pages of 16) and a note saying so; otherwise knobs as given (a budget in --knobs is kept), None."""
    knob = BUDGETS.get(name)
    default = knob_defaults(name)[knob] if knob else None
    if knob is None or knob in knobs or 2 * default <= prompt_tokens:
        return knobs, None
    budget = max(16, prompt_tokens // 4 // 16 * 16)
    return {**knobs, knob: budget}, (f"{knob}={budget} is the demo's, about a quarter of the prompt: the default "
                                     f"{knob}={default} keeps {min(default, prompt_tokens)} of its {prompt_tokens} "
                                     f"tokens (--knobs {knob}=N sets it)")


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    try:  # an unknown method or a bad knob fails here, before any checkpoint is read
        knobs = parse_knobs(args.knobs)
        get_method(args.method, **knobs)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model_dir = args.model or ASSETS / ("tiny-llada" if METHODS[args.method].engines[0] == "masked" else "tiny-sdar")
    knobs = with_profile(args.method, knobs, model_dir)  # MaskKV: the checkpoint's layer profile, if it has one
    try:
        cfg = ModelConfig.from_dir(model_dir)
        engine = engine_of(cfg)
        is_block = engine in ("block", "gemma")  # whole blocks (DiffusionGemma: canvases)
        block_length = args.block_length or default_block_length(cfg, args.gen_length)
        default_steps = RELEASED_STEPS if engine == "gemma" else block_length if is_block else args.gen_length
        gen = GenerationConfig(
            gen_length=args.gen_length,
            block_length=block_length,
            steps=args.steps or default_steps,
            temperature=args.temperature,
            threshold=default_threshold(cfg) if args.threshold is None else args.threshold,
        )
        if engine != "gemma":  # a canvas's steps renoise what they reject: more steps than tokens can help
            check_steps(gen, is_block)
        group = tensor_parallel(args.tp)[0]
        check_method(get_method(args.method, **knobs), cfg)
        tokenizer = Tokenizer.from_dir(model_dir, cfg.model_type)
        prompt, answer = args.prompt, None
        if args.prompt_file is not None:
            prompt = read_prompt(args.prompt_file)
        if prompt is None:
            sample = tasks.make_sample("passkey", args.length, 0.5, seed=7,
                                       count_tokens=lambda text: len(tokenizer.encode(text)))
            prompt, answer = sample.prompt, sample.answer
        prompt_ids = tokenizer.encode_prompt(prompt, chat=not args.no_chat)
        knobs, budget_note = demo_budget(args.method, knobs, len(prompt_ids))
        device, context = args.device, len(prompt_ids) + 2 * args.gen_length
        note = check_fits(cfg, context, 1, device, DTYPES[args.dtype], group.world)
        if note and group.rank == 0:
            print(note, file=sys.stderr)
        model = load_model(model_dir, device, DTYPES[args.dtype], context=context, group=group)
        to_run = {name: knobs if name == args.method else {} for name in ("dense", args.method)}
        warm_up = warm_up_gpu(model, prompt_ids, gen, to_run, tokenizer.stop_ids, device)
        runs = {}
        for name, method_knobs in to_run.items():
            method = get_method(name, **method_knobs)
            runs[name] = run(model, prompt_ids, gen, method, tokenizer.stop_ids, device)
    except (FileNotFoundError, ValueError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    if group.rank:  # every rank decoded the same tokens; rank 0 reports them
        return 0
    split = f", split over {group.world} ranks" if group.world > 1 else ""
    print(f"model: {model_dir} ({cfg.model_type}, {engine_of(cfg)} engine), "
          f"prompt {len(prompt_ids)} tokens, device {device}, {args.dtype}{split}")
    if engine == "gemma":
        print(f"decoding: {gen.gen_length} tokens or more (whole canvases of {gen.block_length}), at most "
              f"{gen.steps} denoising steps per canvas, the entropy-bound sampler in its deterministic mode "
              "(argmax, seeded renoise)")
    else:
        print(f"decoding: {gen.gen_length} tokens{' or more (whole blocks)' if is_block else ''}, blocks of "
              f"{gen.block_length}, {gen.steps} steps{' per block' if is_block else ''}, "
              f"temperature {gen.temperature}, threshold {gen.threshold}")
    if warm_up is not None:
        print(f"warm-up, not timed below (kernels compiled or loaded, launch settings looked up): {warm_up:.1f}s")
    defaults = knob_defaults(args.method)
    if defaults:
        settings = (f"{knob}={knobs.get(knob, default)}" for knob, default in defaults.items())
        print(f"{args.method} knobs: " + ", ".join(settings))
    for note in (budget_note, UNCOUNTED.get(args.method)):
        if note:
            print(f"  {note}")
    if answer is not None:
        print(f"built-in prompt: find the pass key hidden halfway through {args.length} tokens; the answer is {answer}")
    answers = {}
    for name, (tokens, seconds, used) in runs.items():
        answers[name] = tokenizer.decode(until_stop(tokens, tokenizer.stop_ids))
        print(f"\n[{name}] {len(tokens)} tokens in {seconds:.2f}s = {len(tokens) / seconds:.1f} tokens/s, {used}")
        print(answers[name])
    if args.method != "dense":
        dense, other = runs["dense"][0], runs[args.method][0]
        same = sum(a == b for a, b in zip(dense, other))
        verdict = ("the same answer as dense" if answers[args.method] == answers["dense"]
                   else "an answer that differs from dense")
        print(f"\n{args.method} gave {verdict}: {same} of {max(len(dense), len(other))} tokens agree, "
              f"{runs['dense'][1] / runs[args.method][1]:.1f}x dense's speed")
    return 0


def read_prompt(path: Path) -> str:
    """The text of a prompt file (UTF-8), refused if missing or empty."""
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-file {path}: no such file")
    text = read_text(path, "--prompt-file")
    if not text.strip():
        raise ValueError(f"--prompt-file {path}: the file is empty")
    return text


if __name__ == "__main__":
    sys.exit(run_main(main))
