"""CUDA graphs and side streams around a method's steps: the one place a step is recorded and replayed.

A cached step of an 8B model feeds a few dozen tokens through 32 layers, hundreds of small kernels,
and launching them from Python takes longer than running them. `Replayed` wraps a method for one
generation (nanodllm/generation.py): the first step of a key runs eagerly (building and tuning its
kernels), is recorded into a CUDA graph, and later steps of that key replay it with one launch, after
copying their tokens and positions into the recording's buffers; a key that ran so before (this process,
model and method class: EAGER_RUNS) is recorded at once. The key is the method's step_kind (the contract
in methods/base.py) plus the engine's shapes: the phase, the fed tokens' shape and, on the block engine,
the KV cache's launch bound (KVCache.launch_length). What a step hands to ctx.aside runs on a second
stream, joined at the step's end, and is recorded with it. After each step the meter counts what it
read (nanodllm/meter.py). Graphs are off on a CPU and with NANODLLM_GRAPHS=0, side streams with
NANODLLM_STREAMS=0.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from .attention import attention_on_kernels
from .kernels.tuning import MeasuringWhileRecording
from .meter import Meter
from .methods.base import run_now

GRAPHS_ENABLED = os.environ.get("NANODLLM_GRAPHS", "1") != "0"
STREAMS_ENABLED = os.environ.get("NANODLLM_STREAMS", "1") != "0"


EAGER_RUNS: set = set()  # (scope, key) of the steps that ran eagerly in this process: their kernels built, tuned


class Recordings:
    """Up to `size` live CUDA graphs of functions of tensors, keyed; __call__(key, fn, *inputs) gives
    fn(*inputs) (a tensor or a tuple of tensors), replayed where the key was recorded. They share one
    memory pool (they never run at the same time) and each replay's outputs are copied out, unless
    copy_outputs=False: then a replay returns the recording's own outputs, which the next call may
    overwrite (for a caller that reads them first, such as a sampler of each step's logits). A new key
    runs eagerly and is then recorded, unless (scope, key) is in `ran`: then it is recorded first and
    replayed, and runs eagerly first only where a kernel's launch setting is still to measure."""

    def __init__(self, size: int = 4, copy_outputs: bool = True, ran: set | None = None, scope=()):
        self.size, self.copy_outputs, self.scope = size, copy_outputs, scope
        self.ran = set() if ran is None else ran  # (scope, key) pairs whose fn ran eagerly
        self.recorded: dict = {}  # key -> (graph, static inputs, static output), least recently used first
        self.replays = 0
        self.pool = None

    def __contains__(self, key) -> bool:
        return key in self.recorded

    def __call__(self, key, fn, *inputs: torch.Tensor):
        recording = self.recorded.pop(key, None)
        if recording is None and (self.scope, key) in self.ran:
            recording = self.capture(key, fn, inputs, may_fail=True)
        if recording is None:
            output = fn(*inputs)
            self.ran.add((self.scope, key))
            self.recorded[key] = self.capture(key, fn, inputs)
            return output
        self.recorded[key] = recording  # now the most recently used
        graph, static_inputs, output = recording
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        graph.replay()
        self.replays += 1
        if not self.copy_outputs:
            return output
        return tuple(x.clone() for x in output) if isinstance(output, tuple) else output.clone()

    def capture(self, key, fn, inputs, may_fail: bool = False):
        """fn recorded on copies of inputs: (graph, those copies, its outputs); None where may_fail and the
        recording raised."""
        while len(self.recorded) >= self.size:  # the least recently used goes first, with its memory
            del self.recorded[next(iter(self.recorded))]
        if not self.recorded:  # the pool went with its last graph: a capture into it would fail
            self.pool = None
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static_inputs = [x.clone() for x in inputs]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                output = fn(*static_inputs)
        except MeasuringWhileRecording:
            if not may_fail:
                raise
            return None
        return graph, static_inputs, output


def remembering(model, method, size: int = 4, copy_outputs: bool = True) -> Recordings:
    """Recordings for one generation of `model` with `method` that record at once the keys this process
    ran eagerly for the same model and method class (EAGER_RUNS)."""
    return Recordings(size, copy_outputs, ran=EAGER_RUNS, scope=(id(model), type(method)))


class SideStream:
    """ctx.aside on a GPU: fn() on a second stream that waits for the step's work so far; `join` makes
    the step's stream wait for it. Memory crossing the streams is marked so neither reuses it early."""

    def __init__(self):
        self.stream, self.forked = None, False

    def __call__(self, fn, *inputs: torch.Tensor):
        main = torch.cuda.current_stream()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(main)
        self.forked = True
        with torch.cuda.stream(self.stream):
            outputs = fn()
        for tensor in inputs:
            tensor.record_stream(self.stream)
        for tensor in outputs:
            tensor.record_stream(main)
        return outputs

    def join(self):
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False


class Replayed:
    """A method for one generation of `model`: its steps and commits replayed where their key repeats, its
    side work on a second stream, what its steps read counted. Every other attribute is the method's."""

    def __init__(self, method, model, size: int = 4):
        self.method, self.meter, self.side = method, Meter(), SideStream()
        self.recordings = remembering(model, method, size)

    def __getattr__(self, name):
        return getattr(self.method, name)

    @property
    def replays(self) -> int:
        return self.recordings.replays

    def step(self, model, ctx) -> torch.Tensor:
        hidden = self.run(self.method.step, model, ctx)
        self.meter.count(self.method, ctx)
        return hidden

    def commit(self, model, ctx) -> torch.Tensor:
        return self.run(self.method.commit, model, ctx)

    def run(self, hook, model, ctx):
        if STREAMS_ENABLED and ctx.tokens.is_cuda:
            ctx = replace(ctx, aside=self.side)
        ctx = replace(ctx, kind=self.method.step_kind(ctx))
        if ctx.kind is None or not recordable(ctx):
            return self.joined(hook, model, ctx)
        recorded = lambda tokens, positions: self.joined(hook, model, replace(ctx, tokens=tokens, positions=positions))
        return self.recordings(step_key(ctx), recorded, ctx.tokens, ctx.positions)

    def joined(self, hook, model, ctx):
        output = hook(model, ctx)
        if ctx.aside is not run_now:
            self.side.join()
        return output


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
