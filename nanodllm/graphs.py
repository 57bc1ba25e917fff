"""CUDA graphs for a method's repeated steps.

A cached step of an 8B model feeds a few dozen tokens through 32 layers: about 1,500 kernel
launches whose GPU time is ~11 ms on an H100, while launching them from Python took ~40 ms of host
time (torch.profiler, Fast-dLLM's dual-cache step of llada-8b at 512 + 256 tokens). Recording the
step once into a CUDA graph and replaying it costs one launch. A step may be graphed when, between
captures, it is a pure function of tensors that stay in place: the method's cached state (the same
tensor objects) and the step's inputs, which `StepGraphs` copies into static buffers before each
replay. Host syncs (`.item()`, `bool()` of a tensor, shapes that depend on values) are not allowed
inside.

Usage: `graphs(key, fn, *inputs)` returns fn(*inputs) (a tensor or a tuple of tensors). The first
call with a new key runs fn eagerly (that call is the step; it also compiles and autotunes whatever
the graph will hold) and then records it (recording runs nothing, so a step that updates its cache is
never applied twice); later calls with that key replay the recording. The key must change whenever
the state fn reads is replaced by new tensors. `StepGraphs(size)` keeps the `size` most recently
used recordings (a method with several kinds of step keeps one per kind); they share one memory pool,
which is safe because they never run at the same time and each replay's outputs are copied out.
Off on a CPU, and everywhere with NANODLLM_GRAPHS=0 (to compare), where it simply calls fn.
"""

from __future__ import annotations

import os

import torch

GRAPHS_ENABLED = os.environ.get("NANODLLM_GRAPHS", "1") != "0"


class StepGraphs:
    """Up to `size` live CUDA graphs of step functions, keyed; see the module docstring."""

    def __init__(self, size: int = 1):
        self.size = size
        self.reset()

    def __call__(self, key, fn, *inputs: torch.Tensor):
        if not (GRAPHS_ENABLED and inputs[0].is_cuda):
            return fn(*inputs)
        recording = self.recordings.pop(key, None)
        if recording is None:
            output = fn(*inputs)
            self.capture(key, fn, inputs)
            return output
        self.recordings[key] = recording  # now the most recently used
        graph, static_inputs, output = recording
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        graph.replay()
        self.replays += 1
        return tuple(x.clone() for x in output) if isinstance(output, tuple) else output.clone()

    def capture(self, key, fn, inputs):
        while len(self.recordings) >= self.size:  # the least recently used goes first, with its memory
            del self.recordings[next(iter(self.recordings))]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static_inputs = [x.clone() for x in inputs]
        graph = torch.cuda.CUDAGraph()
        self.capturing = True
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                output = fn(*static_inputs)
        finally:
            self.capturing = False
        self.recordings[key] = (graph, static_inputs, output)

    def reset(self):
        self.recordings: dict = {}
        self.replays = 0  # since the last reset
        self.pool = None
        self.capturing = False  # True while fn runs for a recording (its host-side effects already happened)
