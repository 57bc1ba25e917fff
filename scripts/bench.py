"""The benchmark harness: each section measures the tables of the docs/results file it is named for
and writes them there as JSON + Markdown (scripts/bench_<module>.py says how; the results file says
what the numbers mean). Full runs need a GPU; --quick runs tiny shapes on any machine (a CPU runs the
Triton kernels through TRITON_INTERPRET=1): a smoke test whose numbers mean nothing.

    python scripts/bench.py kernels | mage | maskkv | sparse_dllm | dyllm | momo | momo_gemma | routing
        [--quick] [--out DIR]
    python scripts/bench.py moe [--generate llada2-mini | sdar-30b-a3b]
    python scripts/bench.py e2e [--settings paper | warm_start] [--repeats N] [--methods M ...]
    PYTHONPATH=<transformers 5.24> python scripts/bench.py diffusiongemma
    python scripts/bench.py dyllm_salient [--length 1024] [--n 8] [--tau 0.99]    # tiny-llada, on a CPU
    python scripts/bench.py tune [--out kernels/tuned.json]    # flash_attention's settings for this GPU
    python -m torch.distributed.run --nproc-per-node 4 scripts/bench.py parallel [--only flash | scaling | gemma]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # where the sections are, however this file is run
from harness import REPO, Setup  # noqa: E402
from nanodllm.cli import help_text, output_file, output_folder, positive_int, run_main, unit_fraction  # noqa: E402

SECTIONS = {  # name: (module, the title of its Markdown file, also what --help says of it)
    "kernels": ("bench_kernels", "Attention, norm and RoPE kernels against their floors and torch"),
    "mage": ("bench_mage", "MAGE, Quest and SparseD on the block engine (sdar-8b shapes)"),
    "maskkv": ("bench_maskkv", "MaskKV, dLLM-Cache and vanilla on the masked engine (llada-8b shapes)"),
    "sparse_dllm": ("bench_sparse_dllm", "Sparse-dLLM, Fast-dLLM's prefix and dual caches and vanilla on the "
                    "masked engine (llada-8b shapes)"),
    "dyllm": ("bench_dyllm", "DyLLM's sparse steps vs vanilla and Fast-dLLM's dual cache (llada-8b shapes)"),
    "dyllm_salient": ("bench_dyllm", "DyLLM's salient tokens per layer across the steps"),
    "momo": ("bench_momo", "MOMO's prefill attention vs SDPA and our dense kernel"),
    "momo_gemma": ("bench_momo", "MOMO's prefill attention on DiffusionGemma's full layers"),
    "moe": ("bench_moe", "The mixture-of-experts MLP"),
    "routing": ("bench_routing", "Which attention kernel nanodllm/attention.py picks"),
    "e2e": ("bench_e2e", "Generations as a user runs them"),
    "parallel": ("bench_parallel", "Tensor and expert parallelism"),
    "diffusiongemma": ("bench_gemma", "DiffusionGemma's denoising step against its floor and transformers"),
}


def parser_of_sections() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    command = {}
    for name, (_, title) in SECTIONS.items():
        command[name] = commands.add_parser(name, help=title)
        command[name].add_argument("--quick", action="store_true", help="tiny shapes or a tiny model, on any machine "
                                   "(a CPU runs the kernels through TRITON_INTERPRET=1): a smoke test")
        command[name].add_argument("--out", type=output_folder, help="the folder to write the results into "
                                   "(default: docs/results, or a new temporary folder with --quick)")
    command["dyllm"].add_argument("--fractions", type=unit_fraction, nargs="+", help="default 0.1 0.25 0.5")
    salient = command["dyllm_salient"]
    salient.add_argument("--length", type=positive_int, default=1024)
    salient.add_argument("--n", type=positive_int, default=8, help="passkey prompts (a batch)")
    salient.add_argument("--tau", type=float, default=0.99)
    command["momo"].add_argument("--lengths", type=positive_int, nargs="+", help="default 32768 65536 131072")
    command["moe"].add_argument("--generate", choices=("llada2-mini", "sdar-30b-a3b"),
                                help="time real generations on this preset instead (GPU), written to bench_moe_MODEL")
    command["parallel"].add_argument("--only", choices=("flash", "scaling", "gemma"), help="one of the tables")
    e2e = command["e2e"]
    e2e.add_argument("--settings", choices=("paper", "warm_start"), default="paper", help="paper: every method at "
                     "its paper's setting, beside transformers; warm_start: a first and later processes each")
    e2e.add_argument("--repeats", type=positive_int, default=3, help="warm_start: later processes per configuration")
    e2e.add_argument("--methods", nargs="+", help="warm_start: only these methods' rows, to bench_e2e_warm_start_M")
    e2e.add_argument("--timeout", type=float, default=900.0, help="seconds one configuration's process may take")
    e2e.add_argument("--journal", type=Path, help="the journal of finished rows (default: runs/e2e-<hash>.jsonl)")
    tune = commands.add_parser("tune", help="measure flash_attention's launch settings on this GPU")
    tune.add_argument("--out", type=output_file, default=REPO / "kernels" / "tuned.json",
                      help="the settings file to merge this GPU's choices into (default: kernels/tuned.json)")
    return parser


def main():
    parser = parser_of_sections()
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.command == "tune":
        if not cuda:
            sys.exit("bench.py tune measures launch settings on a GPU; there is none here")
        return importlib.import_module("bench_kernels").tune(args.out)
    if args.out is None:  # a smoke test never overwrites the committed results
        args.out = Path(tempfile.mkdtemp(prefix="nanodllm-bench-")) if args.quick else REPO / "docs" / "results"
    if getattr(args, "methods", None) and args.settings != "warm_start":
        parser.error("e2e --methods picks rows of --settings warm_start only")
    if getattr(args, "generate", None) and not cuda:
        parser.error(f"{args.command} --generate runs on a GPU only (CUDA events and graphs), and torch sees none here")
    if not (args.quick or cuda or args.command == "dyllm_salient"):
        sys.exit(f"bench.py {args.command}: the full run times 8B shapes on a GPU; on a CPU run it with --quick")
    module, title = SECTIONS[args.command]
    setup = Setup(args, f"Real generations on {args.generate}" if getattr(args, "generate", None) else title)
    if args.command not in ("e2e", "dyllm_salient", "parallel"):  # e2e's header follows its journal's machine record
        argv = sys.argv[1:]  # the command as the results file quotes it: without --out and its folder
        setup.header(" ".join(a for i, a in enumerate(argv) if a != "--out" and (i == 0 or argv[i - 1] != "--out")))
    stem = getattr(importlib.import_module(module), args.command)(setup)
    if stem:
        setup.report.write(args.out, f"{stem}_quick" if args.quick else stem, setup.meta)
    if failed := setup.report.failed:
        sys.exit(f"bench.py {args.command}: {len(failed)} part(s) failed: {'; '.join(failed)}. The tables that "
                 f"finished are written to {args.out}.")


if __name__ == "__main__":
    sys.exit(run_main(main))
