"""CUDA graphs of the engines' repeated steps: the one place a step is recorded and replayed.

A cached step of an 8B model feeds a few dozen tokens through 32 layers, hundreds to thousands of
small kernels, and launching them from Python takes longer than running them. Recording a step into a
CUDA graph once and replaying it costs one launch. The engines run every denoising step and commit
through `Steps`, which replays where a step repeats:

- Steps of one key compute the same function of the same tensors: the fed tokens and positions,
  copied into the recording's own buffers before each replay, and the method's state, which the
  method keeps in tensors it overwrites in place. The key is the method's `step_kind(ctx)` (None: the
  step runs eagerly, its Python every time) plus what the engine's shapes add: the phase, the fed
  tokens' shape and, on the block engine, the KV cache's launch bound, which moves only when the
  context crosses one of eight sizes per doubling (KVCache.launch_length). What is recorded is the
  method's step (its forward), not its logits, whose span moves from block to block.
- The first step of a key runs eagerly (it also compiles and tunes its kernels) and is then recorded;
  recording runs nothing, so state is never updated twice. Its Python runs twice and never again, so
  a recorded step has no host syncs (`.item()`, `bool(tensor)`, shapes from values) and keeps its
  host-side bookkeeping in `end_step`, which runs after every step.
- Recordings live for one generation, the `size` most recently used kept, in one memory pool (they
  never run at the same time, and each replay's outputs are copied out).

Off on a CPU, and everywhere with NANODLLM_GRAPHS=0 (to compare).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from .attention import attention_on_kernels

GRAPHS_ENABLED = os.environ.get("NANODLLM_GRAPHS", "1") != "0"


class Recordings:
    """Up to `size` live CUDA graphs of functions of tensors, keyed; __call__(key, fn, *inputs) gives
    fn(*inputs) (a tensor or a tuple of tensors), replayed where the key was recorded."""

    def __init__(self, size: int = 4):
        self.size = size
        self.recorded: dict = {}  # key -> (graph, static inputs, static output), least recently used first
        self.replays = 0
        self.pool = None

    def __call__(self, key, fn, *inputs: torch.Tensor):
        recording = self.recorded.pop(key, None)
        if recording is None:
            output = fn(*inputs)
            self.capture(key, fn, inputs)
            return output
        self.recorded[key] = recording  # now the most recently used
        graph, static_inputs, output = recording
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        graph.replay()
        self.replays += 1
        return tuple(x.clone() for x in output) if isinstance(output, tuple) else output.clone()

    def capture(self, key, fn, inputs):
        while len(self.recorded) >= self.size:  # the least recently used goes first, with its memory
            del self.recorded[next(iter(self.recorded))]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static_inputs = [x.clone() for x in inputs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn(*static_inputs)
        self.recorded[key] = (graph, static_inputs, output)


class Steps:
    """A method's steps and commits for one generation, each replayed where its key was recorded."""

    def __init__(self, method, size: int = 4):
        self.method = method
        self.recordings = Recordings(size)

    @property
    def replays(self) -> int:
        return self.recordings.replays

    def step(self, model, ctx) -> torch.Tensor:
        """A denoising step's logits: method.step (replayed where it repeats), method.logits of its
        hidden states, then method.end_step."""
        logits = self.method.logits(model, self.run(self.method.step, model, ctx), ctx)
        self.method.end_step(ctx)
        return logits

    def commit(self, model, ctx) -> torch.Tensor:
        """method.commit's hidden states (ctx.phase "commit")."""
        return self.run(self.method.commit, model, ctx)

    def run(self, hook, model, ctx):
        ctx.kind = self.method.step_kind(ctx)
        if ctx.kind is None or not recordable(ctx):
            return hook(model, ctx)
        recorded = lambda tokens, positions: hook(model, replace(ctx, tokens=tokens, positions=positions))
        return self.recordings(step_key(ctx), recorded, ctx.tokens, ctx.positions)


def recordable(ctx) -> bool:
    """Graphs on, a GPU, and on the block engine a cache the kernels read (torch's cache attention
    sizes its reads by host lengths)."""
    if not (GRAPHS_ENABLED and ctx.tokens.is_cuda):
        return False
    return ctx.cache is None or attention_on_kernels(ctx.cache.keys[0])


def step_key(ctx):
    """The recording a step of kind ctx.kind may replay."""
    key = (ctx.phase, tuple(ctx.tokens.shape), ctx.kind)
    cache = ctx.cache
    if cache is None:
        return key
    # an empty cache takes other branches (no prefix to select from); the launch bound alone tells it
    # apart only while caches grow by whole blocks
    return key + (cache.launch_length(ctx.tokens.shape[1]), cache.max_length == 0)
