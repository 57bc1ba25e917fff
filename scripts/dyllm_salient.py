"""DyLLM's salient tokens per layer across the denoising steps on tiny-llada (the paper's Fig. 7
analogue), written as JSON for scripts/plot_results.py, with a text table.

    python scripts/dyllm_salient.py [--length 1024] [--n 8] [--tau 0.99] [--out docs/results/dyllm_salient.json]

One generation over n passkey prompts (a batch; 32 tokens, one block of 32, 32 steps). For each sparse
step DyLLM records the fraction of the fed rows that are salient in each layer (the batch mean);
steps t % full_period == 0 feed the whole canvas, the others the response only, so their fractions
are of different row counts (both are recorded as fractions). The first full_steps steps are dense.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanodllm.cli import help_text, output_file, positive_int, run_main, write_whole  # noqa: E402
from nanodllm import tasks  # noqa: E402
from nanodllm.eval import Runner, resolve_model  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=positive_int, default=1024)
    parser.add_argument("--n", type=positive_int, default=8)
    parser.add_argument("--tau", type=float, default=0.99)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=output_file, default=Path(__file__).resolve().parents[1] / "docs" / "results"
                        / "dyllm_salient.json")
    args = parser.parse_args(argv)
    runner = Runner(resolve_model("tiny-llada"), "cpu", torch.float32, None)
    runner.knobs = {"tau": args.tau}
    samples = tasks.make_samples("passkey", args.length, args.n, seed=args.seed, count_tokens=runner.count_tokens)
    methods, history = [], []  # history: (step, each layer's salient fraction of the fed rows) per sparse step

    def record(method):
        """Keep what the method states after each sparse step (its rows_computed, which the meter reads)."""
        stated = method.rows_computed
        method.rows_computed = lambda ctx: noted(ctx, stated(ctx))
        methods.append(method)

    def noted(ctx, computed):
        if computed is not None:
            history.append((ctx.t, computed[0].tolist()))
        return computed

    outcome = runner.generate(samples, "dyllm", prepare=record)
    accuracy = sum(outcome.scores) / len(outcome.scores)
    result = {"model": "tiny-llada", "length": args.length, "n": args.n, "tau": args.tau, "accuracy": accuracy,
              "full_period": methods[0].full_period, "steps": [t for t, _ in history],
              "per_layer": [fractions for _, fractions in history]}
    write_whole(args.out, lambda partial: partial.write_text(json.dumps(result, indent=1) + "\n"))
    layers = len(result["per_layer"][0])
    print(f"tiny-llada, passkey {args.length}, n {args.n}, tau {args.tau}: accuracy {accuracy:.3f}\n")
    print("| step | fed | " + " | ".join(f"layer {i}" for i in range(layers)) + " |")
    print("|---|---|" + "---|" * layers)
    for t, fractions in history:
        fed = "canvas" if t % result["full_period"] == 0 else "response"
        print(f"| {t} | {fed} | " + " | ".join(f"{f:.2f}" for f in fractions) + " |")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
