"""Accuracy of dense decoding and of a method on long-context tasks, side by side.

    python -m nanodllm eval --model tiny-sdar --method mage --task passkey --lengths 1024,2048 --n 50

For every (context length, needle depth) cell it prints the accuracy of dense and of the method, how
many generated tokens the method shares with dense, tokens/s of each, and the fraction of KV entries
the method kept (1.0 = everything, as dense). `--method all` compares every registered method;
`--plot FILE.png` saves a length x depth accuracy heatmap per method (needs matplotlib);
`--task longbench --data FILE.jsonl` scores a LongBench-format file instead; `--calibrate` writes
MaskKV's layer profile next to the checkpoint (methods/maskkv.py), which MaskKV then reads there.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from . import recall, tasks
from .cli import (HelpFormatter, available_device, check_fits, check_steps, output_file, positive_int, positive_ints,
                  read_text, run_main, tensor_parallel, write_whole)
from .config import GenerationConfig, ModelConfig, default_block_length, default_threshold
from .decoding import check_method, engine_of, until_stop
from .gemma_loop import RELEASED_STEPS, GemmaSampling
from .generation import generate
from .loader import load_model
from .methods import METHODS, get_method, parse_knobs
from .methods.maskkv import PROFILE_NAME, layer_importance
from .parallel import SINGLE, Group
from .tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parent / "assets"
TINY_MODELS = ("tiny-llada", "tiny-sdar", "tiny-gemma")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_model(name: str) -> Path:
    """A tiny model's name or a checkpoint directory."""
    path = ASSETS / name if name in TINY_MODELS else Path(name)
    if not path.is_dir():
        raise FileNotFoundError(f"model not found: {name} (a directory, or one of {', '.join(TINY_MODELS)})")
    return path


def with_profile(method_name: str, knobs: dict, model_dir) -> dict:
    """knobs, plus the checkpoint's MaskKV profile (calibrate's) when it has one and knobs name none."""
    profile = Path(model_dir) / PROFILE_NAME
    if method_name == "maskkv" and "profile" not in knobs and profile.is_file():
        return {**knobs, "profile": str(profile)}
    return knobs


def calibrate(model_dir, lengths=(1024, 2048), n: int = 4, gen_length: int = 32, seed: int = 99,
              device="cpu", dtype=torch.float32) -> Path:
    """Write MODEL_DIR/maskkv_profile.json: MaskKV's layer importance (eq. 8) averaged over n canvases
    (prompt + gen_length masks) per task and length, drawn with a seed the evaluation does not use."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.attention == "block_causal":
        raise ValueError(f"--calibrate writes MaskKV's profile, and MaskKV runs on the masked engine; {model_dir} is a "
                         f"{cfg.model_type} model (block engine)")
    model = load_model(model_dir, device, dtype, context=max(lengths) + 2 * gen_length)
    cfg = model.cfg
    tokenizer = Tokenizer.from_dir(model_dir, cfg.model_type)
    count = lambda text: len(tokenizer.encode(text))
    profiles = []
    for task in ("passkey", "multikey", "kv"):
        for length in lengths:
            for sample in tasks.make_samples(task, length, n, seed, count_tokens=count):
                ids = tokenizer.chat([{"role": "user", "content": sample.prompt}]) + [cfg.mask_token_id] * gen_length
                tokens = torch.tensor([ids], device=device)
                positions = torch.arange(len(ids), device=device)[None]
                valid = torch.ones_like(tokens, dtype=torch.bool)
                profiles.append(layer_importance(model, tokens, positions, valid)[0])
    importance = torch.tensor(profiles).mean(dim=0).tolist()
    record = {"layer_importance": importance, "calibration": {
        "tasks": ["passkey", "multikey", "kv"], "lengths": list(lengths), "samples_per_cell": n,
        "gen_length": gen_length, "seed": seed, "canvases": len(profiles)}}
    path = model_dir / PROFILE_NAME
    write_whole(path, lambda partial: partial.write_text(json.dumps(record, indent=1) + "\n"))
    return path


@dataclass
class Outcome:
    """What one method produced on one batch of samples."""

    scores: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    kv_kept: list[float] = field(default_factory=list)
    tokens_per_step: list[float] = field(default_factory=list)  # DiffusionGemma's sampler, per sample
    stats: dict = field(default_factory=dict)  # what its steps kept, read and computed (nanodllm/meter.py)


class Runner:
    """A loaded model, its tokenizer and engine, and the generation settings."""

    def __init__(self, model_dir: Path, device: str, dtype: torch.dtype, gen: GenerationConfig | None, context=None,
                 group: Group = SINGLE, replica: int = 0, replicas: int = 1):
        self.model_dir, self.replica, self.replicas = model_dir, replica, replicas  # chunks i % replicas == replica
        self.model = load_model(model_dir, device, dtype, context=context, group=group)
        cfg = self.model.cfg
        self.tokenizer = Tokenizer.from_dir(model_dir, cfg.model_type)
        self.is_block = engine_of(cfg) == "block"
        self.gen = gen or GenerationConfig(gen_length=32, block_length=default_block_length(cfg, 32), steps=32)
        # DiffusionGemma decodes in its deterministic mode: a rerun (or a resumed journal) scores the same
        self.options = {"sampling": GemmaSampling(sample=False)} if cfg.gemma is not None else {}
        self.device = torch.device(device)
        self.knobs: dict = {}  # the evaluated method's knobs (dense takes none)

    @property
    def engine_name(self) -> str:
        return engine_of(self.model.cfg)

    def check_engine(self, method_name: str):
        """A clear error when the method does not run on this model's engine."""
        check_method(METHODS[method_name], self.model.cfg)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def generate(self, samples: list[tasks.Sample], method_name: str, prepare=None) -> Outcome:
        """Decode samples with the method; prepare(method), if given, runs first (e.g. recall.attach)."""
        method = get_method(method_name, **with_profile(method_name, {} if method_name == "dense" else self.knobs,
                                                        self.model_dir))
        if prepare is not None:
            prepare(method)
        prompts = [self.tokenizer.chat([{"role": "user", "content": s.prompt}]) for s in samples]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = generate(self.model, prompts, self.gen, method, stop_ids=self.tokenizer.stop_ids, **self.options)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        outcome = Outcome(seconds=time.perf_counter() - start)
        for sample, tokens in zip(samples, result.tokens):
            text = self.tokenizer.decode(until_stop(tokens, self.tokenizer.stop_ids)).strip()
            outcome.scores.append(tasks.score(sample, text))
            outcome.tokens.append(tokens)
            outcome.kv_kept.append(result.stats.get("kv_kept", 1.0))
        outcome.tokens_per_step = list(getattr(result, "tokens_per_forward", []))
        outcome.stats = result.stats
        return outcome


class Journal:
    """The finished (variant, batch) runs of an interrupted eval or sweep, a JSON line each, appended as
    each finishes and deleted when the whole run completes. The first line holds the run's settings;
    a journal of other settings is refused, and a last line cut short by an interruption is dropped."""

    def __init__(self, path: Path, settings: dict, writes: bool = True):
        self.path, self.done, self.writes = path, {}, writes  # writes: False on every rank but the first
        lines = read_text(path).splitlines() if path.exists() else []
        try:
            held = json.loads(lines[0])["settings"] if lines else settings
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path} is not a journal (its first line holds no settings); remove it or pass "
                             "another --journal") from None
        if held != settings:
            differing = sorted(k for k in held.keys() | settings.keys() if held.get(k) != settings.get(k))
            raise ValueError(f"{path} holds a run with other settings ({', '.join(differing)}); remove it or pass "
                             "another --journal")
        for line in lines[1:]:
            try:
                record = json.loads(line)
            except ValueError:
                break
            self.done[record["key"]] = record
        self.made_folder = writes and not path.parent.exists()  # removed with the journal when left empty
        if writes:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = [json.dumps({"settings": settings})] + [json.dumps(record) for record in self.done.values()]
            path.write_text("\n".join(kept) + "\n")

    def add(self, record: dict):
        if self.writes:
            with self.path.open("a") as file:
                file.write(json.dumps(record, default=str) + "\n")

    def forget_unless_resumable(self):
        """A run refused midway leaves nothing behind unless its journal holds finished runs to resume."""
        if self.writes and self.path.exists() and len(self.path.read_text().splitlines()) <= 1:
            self.finish()

    def finish(self):
        """The run completed and its results are out: a rerun starts afresh (the code may have changed)."""
        if self.writes:
            self.path.unlink(missing_ok=True)
            if self.made_folder and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()


def label(name: str, knobs: dict) -> str:
    return name + "".join(f" {k}={v}" for k, v in knobs.items())


def journal_path(kind: str, settings: dict) -> Path:
    """runs/<kind>-<hash of the settings>.jsonl in the working directory: a rerun of the same command
    after an interruption finds it."""
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    return Path("runs") / f"{kind}-{digest}.jsonl"


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of generated positions where two runs chose the same token."""
    same = total = 0
    for x, y in zip(a, b):
        same += sum(i == j for i, j in zip(x, y))
        total += max(len(x), len(y))
    return same / max(total, 1)


def evaluate(runner: Runner, samples: list[tasks.Sample], methods: list[str], batch: int,
             journal: Journal | None = None):
    """{method: {cell: Outcome}} where a cell is (length, depth) or (dataset, nan). Each (method,
    batch) run is added to the journal as it finishes, and read back from it instead of run again.
    Progress (samples, accuracy so far, time left) goes to stderr after every batch."""
    results = {m: defaultdict(Outcome) for m in methods}
    chunks = [samples[i : i + batch] for i in range(0, len(samples), batch)]
    done_before = journal.done if journal is not None else {}
    if runner.device.type == "cuda" and len(done_before) < len(chunks) * len(methods):
        start = time.perf_counter()  # load or compile each method's kernels outside the timings
        for name in methods:
            runner.generate(chunks[0], name)
        print(f"warm-up, not timed (kernels compiled or loaded, launch settings looked up): "
              f"{time.perf_counter() - start:.1f}s", file=sys.stderr)
    if done_before:
        print(f"resuming from {journal.path}: {len(done_before)} of {len(chunks) * len(methods)} runs done",
              file=sys.stderr)
    clock, computed = time.perf_counter(), 0
    for first in range(0, len(chunks), runner.replicas):  # a round: one chunk per replica
        mine, records = first + runner.replica, {}
        for name in methods if mine < len(chunks) else ():
            key = f"{name} @ {mine * batch}"
            records[key] = done_before.get(key) or run_record(runner, chunks[mine], name, key)
            if key not in done_before and journal is not None:
                journal.add(records[key])  # as it finishes: an interruption loses no finished run of this rank
        journaled = set(records)
        records = every_replicas(records, runner.replicas)
        for index in range(first, min(first + runner.replicas, len(chunks))):
            for name in methods:
                key = f"{name} @ {index * batch}"
                record = records[key]
                if key not in done_before:
                    computed += 1
                    if journal is not None and key not in journaled:
                        journal.add(record)
                for i, sample in enumerate(chunks[index]):
                    cell = results[name][(sample.length if sample.task in tasks.TASKS else sample.task, sample.depth)]
                    cell.scores.append(record["scores"][i])
                    cell.tokens.append(record["tokens"][i])
                    cell.kv_kept.append(record["kv_kept"][i])
                    cell.tokens_per_step += record.get("tokens_per_step", [])[i : i + 1]
                    cell.seconds += record["seconds"] / len(chunks[index])
            left = (len(chunks) - index - 1) * len(methods)
            eta = time_left(clock, computed, left)
            accuracy = ", ".join(f"{name} {accuracy_so_far(cells):.2f}" for name, cells in results.items())
            print(f"eval: {min((index + 1) * batch, len(samples))}/{len(samples)} samples, accuracy so far: "
                  f"{accuracy}{eta}", file=sys.stderr, flush=True)
    return results


def run_record(runner: Runner, chunk: list[tasks.Sample], name: str, key: str) -> dict:
    """A (method, batch) run as the journal keeps it."""
    outcome = runner.generate(chunk, name)
    return {"key": key, "scores": outcome.scores, "tokens": outcome.tokens, "kv_kept": outcome.kv_kept,
            "tokens_per_step": outcome.tokens_per_step, "seconds": outcome.seconds}


def every_replicas(records: dict, replicas: int) -> dict:
    """Every replica's records of a round, on every rank (one all-gather of Python objects)."""
    if replicas == 1:
        return records
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, records)
    return {key: record for part in parts for key, record in part.items()}


def time_left(started: float, computed: int, remaining: int) -> str:
    """', about 3.5 min left': the runs computed since `started` (perf_counter) timed the remaining
    ones ('' before the first, or when none remain)."""
    if not computed or not remaining:
        return ""
    return f", about {(time.perf_counter() - started) / computed * remaining / 60:.1f} min left"


def accuracy_so_far(cells: dict) -> float:
    scores = [score for outcome in cells.values() for score in outcome.scores]
    return sum(scores) / len(scores)


def table(results, methods: list[str]) -> str:
    """One row per cell; DiffusionGemma's adds each method's tokens per denoising step (its sampler's)."""
    dense = results["dense"]
    others = [m for m in methods if m != "dense"]
    sampled = any(outcome.tokens_per_step for outcome in dense.values())
    header = ["cell", "depth", "n", *(f"{m} acc" for m in methods),
              *(f"{m} {what}" for m in others for what in ("agree", "tok/s", "KV kept")), "dense tok/s",
              *(f"{m} tok/step" for m in methods if sampled)]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in sorted(dense, key=lambda c: (in_order(c[0]), c[1])):
        n = len(dense[cell].scores)
        columns = [str(cell[0]), f"{cell[1]:.2f}", str(n),
                   *(f"{sum(results[m][cell].scores) / n:.3f}" for m in methods)]
        for m in others:
            outcome = results[m][cell]
            columns += [f"{agreement(outcome.tokens, dense[cell].tokens):.3f}", f"{tokens_per_second(outcome):.1f}",
                        f"{sum(outcome.kv_kept) / n:.3f}"]
        columns.append(f"{tokens_per_second(dense[cell]):.1f}")
        if sampled:
            columns += [f"{sum(results[m][cell].tokens_per_step) / n:.2f}" for m in methods]
        rows.append("| " + " | ".join(columns) + " |")
    return "\n".join(rows)


def in_order(length) -> tuple:
    """A sort key: context lengths in numeric order, then named cells (LongBench's datasets) by name."""
    return (1, 0, length) if isinstance(length, str) else (0, length, "")


def tokens_per_second(outcome: Outcome) -> float:
    return sum(map(len, outcome.tokens)) / max(outcome.seconds, 1e-9)


def summary(results, methods: list[str]) -> dict:
    """Mean accuracy per (method, cell length)."""
    out = {}
    for m in methods:
        by_length = defaultdict(list)
        for (length, _), outcome in results[m].items():
            by_length[length].extend(outcome.scores)
        out[m] = {length: sum(s) / len(s) for length, s in by_length.items()}
    return out


def require_matplotlib():
    """A clear error before any work when the optional plotting dependency is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, an optional dependency: pip install matplotlib")


def plot(grids: dict[str, dict[tuple, float]], path, title: str, columns: int = 4):
    """One length x depth accuracy heatmap per entry of grids ({panel title: {(length, depth):
    accuracy}}), `columns` panels a row, each cell labelled with its accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(columns, len(grids))
    rows = -(-len(grids) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 3.0 * rows), squeeze=False, layout="constrained")
    for ax in axes.ravel()[len(grids):]:
        ax.axis("off")
    for ax, (name, accuracy) in zip(axes.ravel(), grids.items()):
        lengths = sorted({length for length, _ in accuracy})
        depths = sorted({depth for _, depth in accuracy})
        image = ax.imshow([[accuracy.get((length, depth), float("nan")) for length in lengths] for depth in depths],
                          vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (length, depth), value in accuracy.items():
            ax.text(lengths.index(length), depths.index(depth), f"{value:.3f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
        ax.set_yticks(range(len(depths)), [f"{depth:.2f}" for depth in depths])
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
        ax.set_title(name, fontsize=9)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="accuracy")
    fig.suptitle(title, fontsize=9)
    write_whole(path, lambda partial: fig.savefig(partial, dpi=120))
    plt.close(fig)


def parse_args(argv, prog=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help=f"a checkpoint directory or {' / '.join(TINY_MODELS)} (default: the tiny "
                        "model of the method's engine, tiny-llada for all)")
    parser.add_argument("--method", default="dense", help=f"one of: {', '.join(sorted(METHODS))}, or all")
    parser.add_argument("--knobs", help="the method's knobs, e.g. k=64,exact_layers=2 (see its file's docstring)")
    parser.add_argument("--recall", action="store_true",
                        help="block engine, selecting methods: estimation accuracy of the selected keys against "
                             "the oracle per-block top-k, per step and layer (nanodllm/recall.py), instead of accuracy")
    parser.add_argument("--calibrate", action="store_true",
                        help="write MaskKV's offline layer profile (maskkv_profile.json) into the --model directory "
                             "from --n canvases per task and length of --lengths, then exit")
    parser.add_argument("--task", default="passkey", choices=[*tasks.TASKS, "longbench"], help="what is asked")
    parser.add_argument("--lengths", type=positive_ints, default=[1024],
                        help="comma-separated context lengths in tokens")
    parser.add_argument("--n", type=positive_int, default=50, help="samples per length (spread over the depths)")
    parser.add_argument("--data", help="LongBench-format JSONL (with --task longbench)")
    parser.add_argument("--plot", type=output_file, help="save a length x depth accuracy heatmap to this PNG")
    parser.add_argument("--batch", type=positive_int, default=8, help="prompts decoded together")
    parser.add_argument("--seed", type=int, default=1234, help="task seed (training used other seeds)")
    parser.add_argument("--gen-length", type=positive_int, default=32, help="tokens generated per sample")
    parser.add_argument("--steps", type=positive_int,
                        help="default: gen-length (masked) or block length (block engine)")
    parser.add_argument("--threshold", type=float, help="confidence-threshold parallel decoding (default: the "
                        "model's, none for most)")
    parser.add_argument("--device", type=available_device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the weights' and activations' type")
    parser.add_argument("--journal", type=Path, help="finished runs, for resuming (default: runs/eval-<hash>.jsonl)")
    parser.add_argument("--tp", type=positive_int, default=1, help="split each model over this many GPUs; with more "
                        "torchrun processes the samples are shared out over world / tp replicas (torchrun "
                        "--nproc-per-node 4 -m nanodllm -- eval --tp 2 ...: the -- keeps --n from torchrun)")
    args = parser.parse_args(argv)
    engine = METHODS[args.method].engines[0] if args.method in METHODS else "masked"
    args.model = args.model or ("tiny-sdar" if engine == "block" else "tiny-llada")
    return args


def print_recall(runner: Runner, samples: list[tasks.Sample], methods: list[str], args) -> int:
    """--recall: one table per method of estimation accuracy per step bucket and layer."""
    selecting = [m for m in methods if hasattr(get_method(m), "k")]
    if runner.engine_name not in ("block", "gemma") or not selecting:
        raise ValueError("--recall needs the block engine (an SDAR-format model) or DiffusionGemma's and a "
                         "selecting method (mage, quest, sparsed, or all)")
    print(f"\n{args.model}: recall, task {args.task}, {runner.gen}, knobs {runner.knobs}, {len(samples)} prompts\n")
    for name in selecting:
        records = []
        for start in range(0, len(samples), args.batch):
            attached = []  # the records list of this chunk's method, filled while it decodes
            runner.generate(samples[start : start + args.batch], name,
                            prepare=lambda m: attached.append(recall.attach(m)))
            records.extend(attached[0])
            print(f"recall {name}: {min(start + args.batch, len(samples))}/{len(samples)} samples", file=sys.stderr,
                  flush=True)
        print(f"## {name}\n\n{recall.summarise(records)}\n")
    return 0


def print_calibration(model_dir, lengths, args) -> int:
    path = calibrate(model_dir, tuple(lengths), args.n, gen_length=args.gen_length, device=args.device,
                     dtype=DTYPES[args.dtype])
    importance = json.loads(path.read_text())["layer_importance"]
    print(f"wrote {path}: layer importance (eq. 8) {', '.join(f'{s:.4f}' for s in importance)}")
    return 0


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    methods = sorted(METHODS, key=lambda m: m != "dense") if args.method == "all" else ["dense", args.method]
    methods = list(dict.fromkeys(methods))
    journal = None
    try:
        if args.method != "all" and args.method not in METHODS:
            raise ValueError(f"unknown method {args.method!r}; valid methods: {', '.join(sorted(METHODS))}, all")
        knobs = parse_knobs(args.knobs)
        for name in methods[1:]:  # a bad knob fails before the model loads, for every method it goes to
            get_method(name, **knobs)
        if args.plot:
            require_matplotlib()
        if args.task == "longbench":  # read before the model loads: a bad file fails at once
            if not args.data:
                raise ValueError("--task longbench needs --data FILE.jsonl")
            if not Path(args.data).is_file():
                raise FileNotFoundError(f"--data {args.data}: no such file")
            samples = tasks.load_longbench(args.data)[: args.n]
            if not samples:
                raise ValueError(f"--data {args.data}: the file holds no samples")
        lengths = args.lengths
        model_dir = resolve_model(args.model)
        if args.calibrate:
            return print_calibration(model_dir, lengths, args)
        group, replica, replicas = tensor_parallel(args.tp, data_parallel=True)
        first_rank = group.rank == 0 and replica == 0
        if not first_rank:  # every rank computes its share; the first reports the whole
            sys.stdout = sys.stderr = open(os.devnull, "w")
        note = check_fits(ModelConfig.from_dir(model_dir), max(lengths) + 256, args.batch, args.device,
                          DTYPES[args.dtype], group.world)
        if note:
            print(note, file=sys.stderr)
        runner = Runner(model_dir, args.device, DTYPES[args.dtype], None, context=max(lengths) + 256, group=group,
                        replica=replica, replicas=replicas)
        runner.knobs = knobs
        if args.method == "all":
            methods = [m for m in methods if runner.engine_name in METHODS[m].engines]
        else:
            runner.check_engine(args.method)
        gemma = runner.engine_name == "gemma"
        steps = args.steps or (RELEASED_STEPS if gemma
                               else runner.gen.block_length if runner.is_block else args.gen_length)
        threshold = default_threshold(runner.model.cfg) if args.threshold is None else args.threshold
        runner.gen = GenerationConfig(gen_length=args.gen_length,
                                      block_length=default_block_length(runner.model.cfg, args.gen_length),
                                      steps=steps, threshold=threshold)
        if not gemma:  # a canvas's steps renoise what they reject: more steps than tokens can help
            check_steps(runner.gen, runner.is_block)
        if args.task != "longbench":
            samples = [s for length in lengths
                       for s in tasks.make_samples(args.task, length, args.n, args.seed + length,
                                                   count_tokens=runner.count_tokens)]
        if args.recall:
            return print_recall(runner, samples, [m for m in methods if m != "dense"], args)
        settings = {name: str(value) for name, value in vars(args).items() if name not in ("plot", "journal", "tp")}
        path = args.journal or journal_path("eval", settings)
        journal = Journal(path, settings) if first_rank else None
        if dist.is_initialized():
            dist.barrier()  # the first rank's journal is on disk
        journal = journal or Journal(path, settings, writes=False)
        print(f"finished runs are kept in {journal.path}: the same command resumes there", file=sys.stderr)
        results = evaluate(runner, samples, methods, args.batch, journal)
    except (FileNotFoundError, ValueError, TypeError) as err:
        if journal is not None:
            journal.forget_unless_resumable()
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"\n{args.model}: task {args.task}, {runner.gen}, device {args.device}, {args.dtype}\n")
    print(table(results, methods))
    for m, by_length in summary(results, methods).items():
        ordered = sorted(by_length.items(), key=lambda item: in_order(item[0]))
        print(f"{m}: " + ", ".join(f"{length}: {acc:.3f}" for length, acc in ordered))
    if args.plot:
        grids = {m: {cell: sum(o.scores) / len(o.scores) for cell, o in results[m].items()} for m in methods}
        plot(grids, args.plot, f"{args.model}, {args.task}, {args.device} {args.dtype}")
        print(f"heatmap written to {args.plot}")
    journal.finish()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
