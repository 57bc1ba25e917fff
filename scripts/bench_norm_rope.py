"""`python scripts/bench_norm_rope.py` (GPU): the fused RMSNorm and RoPE kernels against the model's torch
form at 8B shapes (llada-8b, batch 16 x 768 rows, bf16): microseconds, GB/s of the bytes that must move
(input, output, weight or tables once), and how many output elements are bit-equal. Prints a
Markdown table (docs/results/bench_kernels.md, "Fused RMSNorm and RoPE").

    python scripts/bench_norm_rope.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402
from kernels.rope import apply_rope, apply_rope_reference  # noqa: E402
from nanodllm.cli import help_text, run_main  # noqa: E402
from nanodllm.model import Rope  # noqa: E402


def mean_ms(fn, *args, iters: int = 50) -> float:
    """Mean milliseconds per call over iters back-to-back calls, after 5 warm-ups (CUDA events)."""
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def compare(label: str, nbytes: int, fused, reference, *args):
    out, expected = fused(*args), reference(*args)
    diff = (out.float() - expected.float()).abs().max().item()
    equal = (out == expected).float().mean().item()
    for name, fn in (("fused", fused), ("torch", reference)):
        ms = mean_ms(fn, *args)
        print(f"| {label} | {name} | {ms * 1e3:.1f} | {nbytes / ms / 1e6:.0f} |")
    print(f"| {label} | max abs diff {diff:.3g}, exactly equal {equal:.4%} | | |")


@torch.no_grad()
def main():
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}\n")
    print("| op | path | us | GB/s |\n|---|---|---|---|")
    x = torch.randn(16 * 768, 4096, device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(4096, device=device)).to(dtype)
    compare("rms_norm [12288, 4096]", 2 * x.numel() * 2 + weight.numel() * 2, rms_norm, rms_norm_reference,
            x, weight, 1e-6)
    q = torch.randn(16, 768, 32, 128, device=device, dtype=dtype).transpose(1, 2)  # a projection's view
    head_weight = (1 + 0.1 * torch.randn(128, device=device)).to(dtype)
    compare("rms_norm q/k [16, 32, 768, 128] view", 2 * q.numel() * 2 + head_weight.numel() * 2, rms_norm,
            rms_norm_reference, q, head_weight, 1e-6)
    rope = Rope(torch.arange(768, device=device)[None].expand(16, -1), 128, 1e6)
    compare("apply_rope [16, 32, 768, 128] view", 2 * q.numel() * 2 + 2 * rope.cos.numel() * 4, apply_rope,
            apply_rope_reference, q, rope.cos, rope.sin)


if __name__ == "__main__":
    argparse.ArgumentParser(description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_norm_rope.py times CUDA kernels: it needs a GPU")
    sys.exit(run_main(main))
