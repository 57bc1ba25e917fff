"""Where the kernel tests run: compiled on a GPU when there is one, else in Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 there).

A float32 tl.dot is exact in the interpreter but TF32 on a GPU (inputs rounded to float16's 10 mantissa
bits). Tests that feed float32 to a kernel's dots draw their inputs on the float16 grid there, which
TF32 holds exactly (scores, LSEs and block choices stay exact), and compare float32 outputs that went
through a TF32 p.v at the float16 tolerance (FP32_OUT_TOLERANCE); CPU runs compare at 1e-4."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TF32_DOTS = DEVICE == "cuda"
FP32_OUT_TOLERANCE = 2e-3 if TF32_DOTS else 1e-4
