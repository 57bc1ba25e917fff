"""CUDA graphs for a method's repeated steps.

A cached step of an 8B model feeds a few dozen tokens through 32 layers: about 1,500 kernel
launches whose GPU time is ~11 ms on an H100, while launching them from Python took ~40 ms of host
time (torch.profiler, Fast-dLLM's dual-cache step of llada-8b at 512 + 256 tokens). Recording the
step once into a CUDA graph and replaying it costs one launch. A step may be graphed when, between
captures, it is a pure function of tensors that stay in place: the method's cached state (the same
tensor objects) and the step's inputs, which `StepGraphs` copies into static buffers before each
replay. Host syncs (`.item()`, `bool()` of a tensor, shapes that depend on values) are not allowed
inside.

Usage: `graphs(key, fn, *inputs)` returns fn(*inputs). The first call with a new key runs fn eagerly
(that call is the step; it also compiles and autotunes whatever the graph will hold) and then records
it (recording runs nothing, so a step that updates its cache is never applied twice); later calls
with that key replay the recording. The key must change whenever the state fn reads is replaced by
new tensors. Off on a CPU, and everywhere with NANODLLM_GRAPHS=0 (to compare), where it simply
calls fn.
"""

from __future__ import annotations

import os

import torch

GRAPHS_ENABLED = os.environ.get("NANODLLM_GRAPHS", "1") != "0"


class StepGraphs:
    """One live CUDA graph of a step function, keyed; see the module docstring."""

    def __init__(self):
        self.reset()

    def __call__(self, key, fn, *inputs: torch.Tensor) -> torch.Tensor:
        if not (GRAPHS_ENABLED and inputs[0].is_cuda):
            return fn(*inputs)
        if key != self.key:
            output = fn(*inputs)
            self.capture(key, fn, inputs)
            return output
        for buffer, value in zip(self.static_inputs, inputs):
            buffer.copy_(value)
        self.graph.replay()
        return self.output.clone()

    def capture(self, key, fn, inputs):
        self.reset()  # the old graph's memory goes first
        static_inputs = [x.clone() for x in inputs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = fn(*static_inputs)
        self.key, self.graph, self.static_inputs, self.output = key, graph, static_inputs, output

    def reset(self):
        self.key = None
        self.graph = self.static_inputs = self.output = None
