"""Accuracy of methods over a knob sweep on the same samples, next to dense, as Markdown tables.

    python scripts/sweep.py --model tiny-llada --methods dllm_cache,maskkv,snapkv --knob budget=16,32,64,128,256 \
        --lengths 2048,4096,8192 --n 40 --device cuda --dtype bfloat16 --out maskkv_sweep.md

Every method that takes the swept knob runs once per value, the others once with their defaults.
Prints (and writes with --out) a table of accuracy per context length, agreement with dense and KV
kept, and per variant a depth x length accuracy grid (--plot FILE.png also draws them: matplotlib).
Progress goes to stderr after every batch. Each finished (variant, batch) run is journaled (--journal,
default runs/sweep-<hash of the flags>.jsonl, deleted when the sweep completes): the same command
resumes there. Every flag is checked before the model loads.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanodllm import tasks  # noqa: E402
from nanodllm.cli import (available_device, check_fits, output_file, positive_int, positive_ints,  # noqa: E402
                          run_main, write_whole)
from nanodllm.config import GenerationConfig, ModelConfig  # noqa: E402
from nanodllm.eval import (DTYPES, Journal, Runner, agreement, journal_path, label, plot,  # noqa: E402
                           require_matplotlib, resolve_model, time_left)
from nanodllm.methods import get_method, knob_defaults, parse_knobs, parse_value  # noqa: E402


def variants(methods: list[str], sweep: str, fixed: dict) -> list[tuple[str, dict]]:
    """dense, then each method once per value of the swept knob (--knob 'name=v1,v2'; once if it has no
    such knob), with the fixed knobs it accepts. Every variant is built once here, so a bad value fails
    before any model loads; a knob no method takes is an error listing theirs."""
    knob, equals, values = sweep.partition("=")
    if not equals or not knob or not values or "" in values.split(","):
        raise ValueError(f"--knob must be name=v1,v2,... (e.g. budget=16,64), got {sweep!r}")
    accepted = {name: knob_defaults(name) for name in methods}  # an unknown name is an error listing the valid ones
    if not any(knob in knobs for knobs in accepted.values()):
        listed = "; ".join(f"{name}: {', '.join(knobs) or 'none'}" for name, knobs in accepted.items())
        raise ValueError(f"--knob {knob}: no method in --methods takes it ({listed})")
    out = [("dense", {})]
    for name in methods:
        base = {k: v for k, v in fixed.items() if k in accepted[name]}
        swept = [{**base, knob: parse_value(v)} for v in values.split(",")] if knob in accepted[name] else [base]
        out += [(name, knobs) for knobs in swept]
    for name, knobs in out:
        try:
            get_method(name, **knobs)
        except (ValueError, TypeError) as error:
            raise ValueError(f"--knob / --knobs give {label(name, knobs)}: {error}")
    return out


def run(runner: Runner, samples, plan, batch: int, journal: Journal):
    """{label: {(length, depth): [(score, tokens, kv_kept)]}}, every variant on the same chunks. Runs in
    the journal are read back, not run again."""
    results = {label(*v): defaultdict(list) for v in plan}
    starts = range(0, len(samples), batch)
    if journal.done:
        print(f"resuming from {journal.path}: {len(journal.done)} of {len(starts) * len(plan)} runs done",
              file=sys.stderr)
    clock, computed = time.perf_counter(), 0
    for start in starts:
        chunk = samples[start : start + batch]
        for name, knobs in plan:
            key = f"{label(name, knobs)} @ {start}"
            record = journal.done.get(key)
            if record is None:
                runner.knobs = knobs
                outcome = runner.generate(chunk, name)
                record = {"key": key, "scores": outcome.scores, "tokens": outcome.tokens, "kv_kept": outcome.kv_kept}
                journal.add(record)
                computed += 1
            for sample, *kept in zip(chunk, record["scores"], record["tokens"], record["kv_kept"]):
                results[label(name, knobs)][(sample.length, sample.depth)].append(tuple(kept))
        done = start + len(chunk)
        left = time_left(clock, computed, (len(samples) - done + batch - 1) // batch * len(plan))
        accuracy = ", ".join(f"{name} {mean(cells, 0):.2f}" for name, cells in results.items())
        print(f"  {done}/{len(samples)} samples, accuracy so far: {accuracy}{left}", file=sys.stderr, flush=True)
    return results


def mean(cells, field: int) -> float:
    """The mean of one field (0: score, 2: KV kept) of every record in the cells."""
    values = [record[field] for records in cells.values() for record in records]
    return sum(values) / len(values)


def length_table(results, lengths) -> str:
    head = ["variant", *(f"{length} acc" for length in lengths), "all acc", "agree with dense", "KV kept"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cells in results.items():
        accs = [mean({cell: records for cell, records in cells.items() if cell[0] == length}, 0) for length in lengths]
        tokens = lambda of: [r[1] for cell in sorted(cells) for r in of[cell]]
        rows.append("| " + " | ".join([name, *(f"{a:.3f}" for a in accs), f"{mean(cells, 0):.3f}",
                                       f"{agreement(tokens(cells), tokens(results['dense'])):.3f}",
                                       f"{mean(cells, 2):.3f}"]) + " |")
    return "\n".join(rows)


def depth_grid(name, cells, lengths) -> str:
    depths = sorted({d for _, d in cells})
    rows = [f"{name}:\n", "| depth | " + " | ".join(str(l) for l in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
    for d in depths:
        accs = [sum(r[0] for r in cells[(l, d)]) / max(len(cells[(l, d)]), 1) for l in lengths]
        rows.append(f"| {d:.2f} | " + " | ".join(f"{a:.2f}" for a in accs) + " |")
    return "\n".join(rows)


def read_depth_grids(markdown: str) -> dict[str, dict[str, dict[tuple, float]]]:
    """depth_grid read back: {task: {variant: {(length, depth): accuracy}}} from a file of --out
    sections, each under a '## Task <task>' heading (docs/results/mage_accuracy.md), for plots."""
    grids, task, name, grid, lengths = {}, None, None, None, []
    for line in markdown.splitlines():
        if not line.startswith("|"):
            grid = None
        if line.startswith("## "):
            task = line.removeprefix("## Task ").strip() if line.startswith("## Task ") else None
            name = None
            if task:
                grids[task] = {}
        elif task and line.endswith(":") and not line.startswith("|"):
            name = line[:-1]
        elif task and name and line.startswith("| depth |"):
            lengths = [int(cell) for cell in line.strip("|").split("|")[1:]]
            grid = grids[task][name] = {}
        elif grid is not None and not line.startswith("|-"):
            depth, *accuracies = (float(cell) for cell in line.strip("|").split("|"))
            grid.update({(length, depth): accuracy for length, accuracy in zip(lengths, accuracies)})
    return grids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llada")
    parser.add_argument("--methods", required=True, help="comma-separated")
    parser.add_argument("--knob", required=True, help="name=v1,v2,... (numbers or words, as --knobs parses them)")
    parser.add_argument("--knobs", help="fixed knobs for every method that takes them, e.g. k_exact=1,chi=64")
    parser.add_argument("--task", default="passkey", choices=tasks.TASKS)
    parser.add_argument("--lengths", type=positive_ints, default=[2048, 4096], help="comma-separated context lengths")
    parser.add_argument("--n", type=positive_int, default=40, help="samples per length (spread over the depths)")
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", type=available_device, default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--out", type=output_file, help="also write the tables to this Markdown file")
    parser.add_argument("--plot", type=output_file, help="also draw the depth x length heatmaps into this PNG")
    parser.add_argument("--journal", type=Path, help="finished runs, for resuming (default: runs/sweep-<hash>.jsonl)")
    args = parser.parse_args(argv)
    lengths, dtype, context = args.lengths, DTYPES[args.dtype], max(args.lengths) + 256
    settings = {name: str(value) for name, value in vars(args).items() if name not in ("out", "plot", "journal")}
    journal = None
    try:
        plan = variants(args.methods.split(","), args.knob, parse_knobs(args.knobs))
        if args.plot:
            require_matplotlib()
        model_dir = resolve_model(args.model)
        if note := check_fits(ModelConfig.from_dir(model_dir), context, args.batch, args.device, dtype):
            print(note, file=sys.stderr)
        journal = Journal(args.journal or journal_path("sweep", settings), settings)
        runner = Runner(model_dir, args.device, dtype, None, context=context)
        for name, _ in plan:
            runner.check_engine(name)
        print(f"finished runs are kept in {journal.path}: the same command resumes there", file=sys.stderr)
        if not runner.is_block:
            runner.gen = GenerationConfig(gen_length=32, block_length=32, steps=32)
        samples = [sample for length in lengths for sample in tasks.make_samples(
            args.task, length, args.n, args.seed + length, count_tokens=runner.count_tokens)]
        results = run(runner, samples, plan, args.batch, journal)
    except (ValueError, FileNotFoundError) as err:
        if journal is not None:
            journal.forget_unless_resumable()
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = [f"{args.model}, task {args.task}, {runner.gen}, {args.n} samples per length, {args.device} {args.dtype}\n",
            length_table(results, lengths), "", "Accuracy by needle depth x context length:\n"]
    text += [depth_grid(name, cells, lengths) + "\n" for name, cells in results.items()]
    print("\n".join(text))
    if args.out:
        write_whole(args.out, lambda partial: partial.write_text("\n".join(text) + "\n"))
    if args.plot:
        plot({name: {cell: sum(r[0] for r in records) / len(records) for cell, records in cells.items()}
              for name, cells in results.items()},
             args.plot, f"{args.model}, {args.task}, {args.n} samples per length, {args.device} {args.dtype}")
    journal.finish()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
