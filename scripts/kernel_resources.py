"""`python scripts/kernel_resources.py`: what the block-decode kernels compile to on an H100 (sm_90a),
without a GPU: registers per thread, local-memory stack (spills), shared memory, and the instruction
mix of the SASS (wgmma, cp.async, plain global loads, spill loads/stores, integer address math).

Each kernel is compiled ahead of time the way a real launch specialises it (bf16 SDAR-8B shapes: 32
query heads, 8 KV heads, d = 128, L = 32; head-dim strides equal to 1 become constants, pointers and
strides divisible by 16 are marked so), at its default launch settings and a few neighbours. The SASS
comes from the cuobjdump bundled with Triton. Prints a Markdown table; the numbers are for the Triton
version installed here, which may differ from the GPU machine's.
"""

from __future__ import annotations

import collections
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.decode_attention import decode_split_kernel  # noqa: E402
from kernels.sparse_decode_attention import sparse_decode_split_kernel  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "lengths_ptr": "*i32", "cache_lengths_ptr": "*i32",
            "indices_ptr": "*i32", "counts_ptr": "*i32", "part_out_ptr": "*bf16", "part_lse_ptr": "*fp32"}
UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_ik"}  # contiguous last dims: 1 at launch
ODD = {"num_kv_heads", "group", "stride_cb", "stride_ch", "qk_scale"}  # not divisible by 16 at these shapes
INSTRUCTIONS = ("HGMMA", "LDGSTS", "LDG", "LDL", "STL", "STS", "LDS", "IMAD", "MUFU")
CASES = [  # (kernel, label, constexprs, launch options); the first of each kernel is its default
    (decode_split_kernel, "decode (default)", {"BLOCK_M": 128, "BLOCK_N": 64}, {"num_warps": 8, "num_stages": 4}),
    (decode_split_kernel, "decode", {"BLOCK_M": 128, "BLOCK_N": 64}, {"num_warps": 8, "num_stages": 3}),
    (decode_split_kernel, "decode", {"BLOCK_M": 128, "BLOCK_N": 32}, {"num_warps": 8, "num_stages": 4}),
    (decode_split_kernel, "decode", {"BLOCK_M": 64, "BLOCK_N": 64}, {"num_warps": 4, "num_stages": 4}),
    (sparse_decode_split_kernel, "sparse decode, tokens",
     {"BLOCK_M": 128, "BLOCK_N": 64, "INDEX_BLOCK": 1, "WHOLE_TILES": False}, {"num_warps": 8, "num_stages": 3}),
    (sparse_decode_split_kernel, "sparse decode, 16-token pages",
     {"BLOCK_M": 128, "BLOCK_N": 64, "INDEX_BLOCK": 16, "WHOLE_TILES": False}, {"num_warps": 8, "num_stages": 3}),
    (sparse_decode_split_kernel, "sparse decode, 64-token blocks",
     {"BLOCK_M": 128, "BLOCK_N": 64, "INDEX_BLOCK": 64, "WHOLE_TILES": True}, {"num_warps": 8, "num_stages": 3}),
]


def compile_for_h100(kernel, constexprs: dict, options: dict):
    """The kernel compiled for sm_90 with a real launch's specialisation (see the module docstring)."""
    constexprs = {"HEAD_DIM": 128, "DOT_PRECISION": "tf32", **constexprs}
    signature, constants, attributes = {}, {}, {}
    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs or name in UNIT_STRIDES:
            signature[name] = "constexpr"
            constants[(i,)] = constexprs.get(name, 1)
            continue
        signature[name] = POINTERS.get(name, "fp32" if name == "qk_scale" else "i32")
        if name not in ODD:
            attributes[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attributes)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def resources(compiled) -> tuple[dict, collections.Counter]:
    """(REG / STACK / SHARED from cuobjdump's resource usage, SASS opcode counts)."""
    with tempfile.TemporaryDirectory() as directory:
        cubin = Path(directory) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(CUOBJDUMP), "--dump-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    opcodes = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*)", sass)
    return fields, collections.Counter(opcodes)


def main():
    print(f"triton {triton.__version__}, target sm_90a; bf16, d = 128\n")
    print("| kernel | tiles | warps, stages | registers / thread | stack (spills) B | dynamic shared KB | "
          + " | ".join(INSTRUCTIONS) + " |")
    print("|---" * (6 + len(INSTRUCTIONS)) + "|")
    for kernel, label, constexprs, options in CASES:
        compiled = compile_for_h100(kernel, constexprs, options)
        fields, opcodes = resources(compiled)
        tiles = " x ".join(str(constexprs[k]) for k in ("BLOCK_M", "BLOCK_N"))
        print(f"| {label} | {tiles} | {options['num_warps']}, {options['num_stages']} | {fields['REG']} | "
              f"{fields['STACK']} | {compiled.metadata.shared / 1024:.0f} | "
              + " | ".join(str(opcodes.get(name, 0)) for name in INSTRUCTIONS) + " |")


if __name__ == "__main__":
    main()
