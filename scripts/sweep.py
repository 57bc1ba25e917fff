"""Accuracy of methods over a knob sweep on the same samples, next to dense, as Markdown tables.

    python scripts/sweep.py --model tiny-llada --methods dllm_cache,maskkv,snapkv --knob budget=16,32,64,128,256 \
        --lengths 2048,4096,8192 --n 40 --device cuda --dtype bfloat16 --out maskkv_sweep.md

Every method in --methods that takes the swept knob runs once per value; a method without it runs
once with its defaults. Prints (and writes with --out) one table of accuracy per context length,
with agreement with dense and KV kept alongside, and per variant a depth x length accuracy grid
(the NIAH heatmap, as a table: no plotting library needed; --plot FILE.png also draws them, with the
optional matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanodllm import tasks  # noqa: E402
from nanodllm.config import GenerationConfig  # noqa: E402
from nanodllm.eval import DTYPES, Runner, agreement, plot, require_matplotlib, resolve_model  # noqa: E402
from nanodllm.methods import knob_defaults, parse_knobs, parse_value  # noqa: E402


def variants(methods: list[str], knob: str, values: list, fixed: dict) -> list[tuple[str, dict]]:
    """dense, then each method once per value of the swept knob (once if it has no such knob), with
    the fixed knobs it accepts."""
    out = [("dense", {})]
    for name in methods:
        accepted = knob_defaults(name)  # an unknown name is an error listing the valid ones
        base = {k: v for k, v in fixed.items() if k in accepted}
        out += [(name, {**base, knob: v}) for v in values] if knob in accepted else [(name, base)]
    return out


def label(name: str, knobs: dict) -> str:
    return name + "".join(f" {k}={v}" for k, v in knobs.items())


def run(runner: Runner, samples, plan, batch: int):
    """({label: {(length, depth): [(score, tokens, kv_kept)]}}, {label: {length: [method stats per
    batch]}}), every variant on the same chunks (a batch's stats are filed under its first sample's length)."""
    results = {label(*v): defaultdict(list) for v in plan}
    stats = {label(*v): defaultdict(list) for v in plan}
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        for name, knobs in plan:
            runner.knobs = knobs
            outcome = runner.generate(chunk, name)
            for sample, score, tokens, kept in zip(chunk, outcome.scores, outcome.tokens, outcome.kv_kept):
                results[label(name, knobs)][(sample.length, sample.depth)].append((score, tokens, kept))
            stats[label(name, knobs)][chunk[0].length].append(outcome.stats)
        print(f"  {start + len(chunk)}/{len(samples)} samples", file=sys.stderr, flush=True)
    return results, stats


def per_layer_table(stats, key: str) -> str:
    """A method statistic that is a list per layer (e.g. dyllm's salient_per_layer), averaged over
    the batches of each context length; '' if no variant reports it."""
    rows = []
    for name, by_length in stats.items():
        for length, records in sorted(by_length.items()):
            lists = [r[key] for r in records if key in r]
            if lists:
                mean = [sum(values) / len(values) for values in zip(*lists)]
                rows.append(f"| {name} | {length} | " + " | ".join(f"{v:.3f}" for v in mean) + " |")
    if not rows:
        return ""
    layers = rows[0].count("|") - 3
    head = "| variant | length | " + " | ".join(f"layer {i}" for i in range(layers)) + " |"
    return "\n".join([f"{key} (mean over batches):\n", head, "|" + "---|" * (layers + 2), *rows])


def length_table(results, lengths) -> str:
    dense = results["dense"]
    head = ["variant", *(f"{l} acc" for l in lengths), "all acc", "agree with dense", "KV kept"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cells in results.items():
        by_length = defaultdict(list)
        for (length, _), records in cells.items():
            by_length[length] += [r[0] for r in records]
        everything = [r for records in cells.values() for r in records]
        ours = [r[1] for cell in sorted(cells) for r in cells[cell]]
        theirs = [r[1] for cell in sorted(cells) for r in dense[cell]]
        accs = [f"{sum(by_length[l]) / len(by_length[l]):.3f}" for l in lengths]
        rows.append("| " + " | ".join([name, *accs, f"{sum(r[0] for r in everything) / len(everything):.3f}",
                                       f"{agreement(ours, theirs):.3f}",
                                       f"{sum(r[2] for r in everything) / len(everything):.3f}"]) + " |")
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llada")
    parser.add_argument("--methods", required=True, help="comma-separated")
    parser.add_argument("--knob", required=True, help="name=v1,v2,... (numbers or words, as --knobs parses them)")
    parser.add_argument("--knobs", help="fixed knobs for every method that takes them, e.g. k_exact=1,chi=64")
    parser.add_argument("--task", default="passkey", choices=tasks.TASKS)
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--n", type=int, default=40, help="samples per length (spread over the depths)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--out", type=Path, help="also write the tables to this Markdown file")
    parser.add_argument("--plot", type=Path, help="also draw the depth x length heatmaps into this PNG")
    args = parser.parse_args(argv)
    knob, _, values = args.knob.partition("=")
    lengths = [int(x) for x in args.lengths.split(",")]
    try:
        plan = variants(args.methods.split(","), knob, [parse_value(v) for v in values.split(",")],
                        parse_knobs(args.knobs))
        if args.plot:
            require_matplotlib()
        runner = Runner(resolve_model(args.model), args.device, DTYPES[args.dtype], None, context=max(lengths) + 256)
        for name, _ in plan:
            runner.check_engine(name)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not runner.is_block:
        runner.gen = GenerationConfig(gen_length=32, block_length=32, steps=32)
    samples = [s for length in lengths
               for s in tasks.make_samples(args.task, length, args.n, args.seed + length, count_tokens=runner.count_tokens)]
    results, stats = run(runner, samples, plan, args.batch)
    text = [f"{args.model}, task {args.task}, {runner.gen}, {args.n} samples per length, {args.device} {args.dtype}\n",
            length_table(results, lengths), ""]
    for key in ("salient_per_layer",):
        table = per_layer_table(stats, key)
        text += [table, ""] if table else []
    text += ["Accuracy by needle depth x context length:\n"]
    text += [depth_grid(name, cells, lengths) + "\n" for name, cells in results.items()]
    print("\n".join(text))
    if args.out:
        args.out.write_text("\n".join(text) + "\n")
    if args.plot:
        grids = {name: {cell: sum(r[0] for r in records) / len(records) for cell, records in cells.items()}
                 for name, cells in results.items()}
        plot(grids, args.plot, f"{args.model}, {args.task}, {args.n} samples per length, {args.device} {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
