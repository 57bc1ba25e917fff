"""PNG figures from the benchmark tables committed in docs/results/ (the papers' figures, redrawn from
our measurements). Needs matplotlib, an optional dependency (pip install matplotlib); reads only the
files `scripts/bench.py` and `scripts/sweep.py` wrote, so it runs anywhere, no GPU.

    python scripts/plot_results.py [--results docs/results]

momo_latency_vs_k.png (MOMO's Fig. 4: bench_momo.json), sparse_dllm_scaling.png (Sparse-dLLM's Fig. 5:
bench_sparse_dllm.json), dyllm_salient.png (DyLLM's Fig. 7: dyllm_salient.json), tiny_models_heatmap.png
(the tiny models' dense accuracy: tiny_models.json) and mage_baselines_2k_8k_tiny.png (MAGE's Fig. 4:
the depth grids at the end of mage_accuracy.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # the parsing below still imports; main() says what is missing
    plt = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanodllm.cli import help_text, run_main, write_whole  # noqa: E402
from nanodllm.eval import plot  # noqa: E402
from sweep import read_depth_grids  # noqa: E402


def section(results: dict, title_start: str) -> list[dict]:
    """The rows of the first table whose title starts with title_start."""
    for table in results["sections"]:
        if table["title"].startswith(title_start):
            return table["rows"]
    raise ValueError(f"no table titled {title_start!r}... in the results")


def save(fig, out: Path):
    fig.tight_layout()
    write_whole(out, lambda partial: fig.savefig(partial, dpi=120))
    plt.close(fig)


def momo_latency_vs_k(results: dict, out: Path):
    rows = section(results, "MOMO latency vs k")
    ks = [row["k blocks"] for row in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for variant in ("exact", "tree", "estimated"):
        ax.plot(ks, [row[f"{variant} ms"] for row in rows], marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set(xlabel="k (key blocks of 64 per sampled query)", ylabel="prefill attention ms")
    ax.set_title(f"MOMO at 64K causal, 32 heads, d 128 ({results['meta']['device']})", fontsize=9)
    ax.legend()
    save(fig, out)


def sparse_dllm_scaling(results: dict, out: Path):
    rows = [row for row in section(results, "Per generation") if "real generation" not in row["method"]]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(9, 3.5))
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        for ax, column in ((speed, "tokens/s"), (memory, "peak GiB")):
            ax.plot([row["length"] for row in mine], [row[column] for row in mine], marker="o", label=method)
    for ax, label in ((speed, "tokens/s"), (memory, "peak GiB (weights included)")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="sequence length", ylabel=label)
    speed.set_yscale("log")
    speed.legend(fontsize=8)
    fig.suptitle(f"llada-8b shapes, 256 generated tokens ({results['meta']['device']})", fontsize=9)
    save(fig, out)


def dyllm_salient(results: dict, out: Path):
    steps, per_layer = results["steps"], results["per_layer"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for layer in range(len(per_layer[0])):
        ax.plot(steps, [fractions[layer] for fractions in per_layer], marker=".", label=f"layer {layer}")
    for t in steps:
        if t % results["full_period"] == 0:
            ax.axvline(t, color="0.85", linewidth=0.8, zorder=0)
    ax.set(xlabel="denoising step (grey: steps that feed the whole canvas)", ylabel="salient fraction of the fed rows")
    ax.set_title(f"DyLLM on {results['model']}, passkey {results['length']}, tau {results['tau']} "
                 f"(accuracy {results['accuracy']:.2f})", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, out)


def tiny_models_heatmap(results: dict, out: Path):
    grids = {f"{model}: {task}": {(cell["length"], cell["depth"]): cell["accuracy"] for cell in cells}
             for model, by_task in results["models"].items() for task, cells in by_task.items()}
    per_cell = next(iter(next(iter(results["models"].values())).values()))[0]["n"]
    plot(grids, out, f"tiny models, dense, temperature 0, {per_cell} samples per cell ({results['device']})",
         columns=len(next(iter(results["models"].values()))))


def mage_baselines_heatmaps(markdown: str, out: Path):
    variants = ("dense", "mage exact_layers=1 k=64", "quest exact_layers=1 k=64", "sparsed exact_layers=1 k=64")
    # a cell holds 8 prompts, so the tables' two decimals (0.12, 0.38, ...) are eighths
    grids = {f"{task}: {variant.split(' exact_layers')[0]}": {cell: round(accuracy * 8) / 8
                                                              for cell, accuracy in by_variant[variant].items()}
             for task, by_variant in read_depth_grids(markdown).items() for variant in variants}
    plot(grids, out, "tiny-sdar, k = 64 keys per KV head (one exact layer of four), 8 prompts per cell, bf16",
         columns=len(variants))


FIGURES = {"momo_latency_vs_k.png": ("bench_momo.json", momo_latency_vs_k),
           "sparse_dllm_scaling.png": ("bench_sparse_dllm.json", sparse_dllm_scaling),
           "dyllm_salient.png": ("dyllm_salient.json", dyllm_salient),
           "tiny_models_heatmap.png": ("tiny_models.json", tiny_models_heatmap),
           "mage_baselines_2k_8k_tiny.png": ("mage_accuracy.md", mage_baselines_heatmaps)}


def main():
    parser = argparse.ArgumentParser(description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results")
    args = parser.parse_args()
    if missing := [source for source, _ in FIGURES.values() if not (args.results / source).is_file()]:
        sys.exit(f"plot_results.py: {args.results} lacks {', '.join(missing)} (--results names the folder "
                 "scripts/bench.py wrote)")
    if plt is None:
        sys.exit("plot_results.py needs matplotlib, an optional dependency: pip install matplotlib")
    for name, (source, draw) in FIGURES.items():
        text = (args.results / source).read_text()
        try:
            draw(json.loads(text) if source.endswith(".json") else text, args.results / name)
        except (ValueError, KeyError, IndexError) as error:
            sys.exit(f"plot_results.py: {name} not drawn: {source} is not in the format bench.py writes ({error!r})")
        print(f"wrote {args.results / name} from {source}")


if __name__ == "__main__":
    sys.exit(run_main(main))
