"""What every process pays at its first kernels, begun on a side thread while the model's weights load.

A process's first generation pays, besides its work, costs that no earlier process can carry over:
1. Triton's key for its disk cache of compiled kernels: a hash of Triton's own compiler, hundreds of
   megabytes read (triton.runtime.cache.triton_key, functools-cached, where this Triton has it);
2. the modules Triton's launcher imports at its first launch (LAUNCHER_IMPORTS);
3. cuBLAS's setup: the first matmul of a process loads the library's state and, as CUDA loads each
   kernel at its first use, a first GEMM kernel.
`start` does these on a daemon thread; the hash and the CUDA calls release the GIL (the imports hold
it, briefly), so the weights load meanwhile, and `wait`, at the end of the loading (load_model,
build_random), joins it: none of its CUDA work is left to run into a generation or a CUDA graph
capture, which CUDA work on another thread would break. Later first uses stay where they are: each
torch operator's first CUDA kernel, each Triton kernel's binary, which ones depending on the method.
"""

from __future__ import annotations

import importlib
import os
import threading

import torch
import triton

LAUNCHER_IMPORTS = ("triton.experimental.gluon",)
STARTED: list[threading.Thread] = []  # the threads `start` began that `wait` has not joined


def prepare(device: torch.device, dtype: torch.dtype):
    """Pay the three costs above in this thread (device: with its index)."""
    triton_key = getattr(triton.runtime.cache, "triton_key", None)
    if triton_key is not None and os.environ.get("TRITON_INTERPRET") != "1":
        triton_key()
    for name in LAUNCHER_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # a Triton without it does not import it either
            pass
    ones = torch.ones(8, 8, device=device, dtype=dtype)
    (ones @ ones).sum().item()


def start(device, dtype: torch.dtype):
    """On a GPU: `prepare` on a daemon thread named "first-use". A thread's current GPU is its own, so
    a device without an index is resolved here, to the caller's current one."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    thread = threading.Thread(target=prepare, args=(device, dtype), name="first-use", daemon=True)
    thread.start()
    STARTED.append(thread)


def wait():
    """Return once every thread `start` began has finished."""
    while STARTED:
        STARTED.pop().join()
