"""What the GPU offers a launch, asked once per device: its SM count and the shared memory one program
may use. The kernels size their grids and pipelines by them."""

from __future__ import annotations

import functools

import torch
import triton


@functools.lru_cache
def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use on device, as Triton checks it at launch (None off
    CUDA: the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    return _device_shared_memory(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _device_shared_memory(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
