"""Kernel launch settings measured once per machine, not once per process.

A Triton kernel's best tiles depend on the GPU and on the shape. Finding them means running and
timing every candidate, seconds that triton.autotune pays again in every process. A `Tuner` looks
the setting for a key up, in this order:
1. the choices this process has made;
2. the user's cache, `tuning.json` in $NANODLLM_CACHE_DIR (default $XDG_CACHE_HOME/nanodllm, else
   ~/.cache/nanodllm), rewritten after each measurement;
3. the settings shipped in kernels/tuned.json (measured by `python scripts/bench.py tune`);
4. a measurement of every candidate (launch_ms: its device time, replayed from a CUDA graph), said
   once per process on stderr, then kept in 1 and 2.
Both files map GPU name -> kernel name -> key -> setting (the key is the caller's shape bucket as
"a,b,c"; a setting is the kernel's tile sizes plus num_warps and num_stages). A setting not among the
caller's current candidates is ignored: every candidate is correct, only speed depends on the choice.
What else a process pays at its first kernels, and how it overlaps the loading: kernels/first_use.py.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
import triton
from triton.runtime.errors import OutOfResources

SHIPPED = Path(__file__).with_name("tuned.json")
TOO_BIG = tuple(error for error in (OutOfResources, getattr(triton.runtime.errors, "PTXASError", None)) if error)


def cache_path() -> Path:
    root = os.environ.get("NANODLLM_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanodllm"
    return Path(root) / "tuning.json"


def read_settings(path: Path) -> dict:
    """{gpu: {kernel: {key: setting}}} from path; {} if it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_settings(path: Path, settings: dict):
    """Replace path's content at once: write a temporary file beside it, then rename it over (so a
    reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(handle, "w") as file:
        json.dump(settings, file, indent=1, sort_keys=True)
    os.replace(temporary, path)


def key_name(key: tuple) -> str:
    """A key as the files write it: (128, 1, 4096) -> "128,1,4096"."""
    return ",".join(str(part) for part in key)


def launch_ms(launch: Callable[[], object]) -> float:
    """ms of one launch as the GPU runs it: unrolled into a CUDA graph and replayed (triton.testing's
    do_bench_cudagraph). Timed from Python, a kernel shorter than its launch (a canvas's attention over a
    sliding window) takes the host's time whatever its setting, and the noise picks the setting."""
    torch.cuda.synchronize()  # it runs on a stream of its own: what this stream still writes must be done
    return triton.testing.do_bench_cudagraph(launch, rep=20)


class MeasuringWhileRecording(RuntimeError):
    """A setting to measure while a CUDA graph records: measuring waits for the device, which breaks a
    recording, so the caller runs the kernel outside one first (nanodllm/graphs.py)."""


class Tuner:
    """One kernel's settings per key (see the module docstring for where they come from)."""

    announced = False  # the once-per-process line, shared by every tuner

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.chosen: dict[tuple, dict] = {}  # by key: a call finds its setting without building a name
        self.known: dict[str, dict] | None = None  # the cache over the shipped table, read on first use
        self.measured = 0  # keys this process measured (the tests read it)

    def choose(self, key: tuple, candidates: list[dict], launch: Callable[[dict], object], device) -> dict:
        """The setting for key among candidates; launch(setting) runs the kernel once with it (only
        called if the setting has to be measured here). A stored setting that is not among the
        candidates (the kernel changed since it was measured) is measured again."""
        if key in self.chosen:
            return self.chosen[key]
        name = key_name(key)
        if self.known is None:
            gpu = torch.cuda.get_device_name(device)
            shipped = read_settings(SHIPPED).get(gpu, {}).get(self.kernel, {})
            self.known = {**shipped, **read_settings(cache_path()).get(gpu, {}).get(self.kernel, {})}
        setting = self.known.get(name)
        if setting not in candidates:
            setting = self.measure(name, candidates, launch, device)
        self.chosen[key] = setting
        return setting

    def measure(self, name: str, candidates: list[dict], launch, device) -> dict:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise MeasuringWhileRecording(f"{self.kernel}: key {name} is measured outside a CUDA graph recording")
        path, gpu = cache_path(), torch.cuda.get_device_name(device)
        if not Tuner.announced:
            print(f"nanodllm: measuring kernel launch settings for the {gpu} (once per machine, kept in {path})",
                  file=sys.stderr, flush=True)
            Tuner.announced = True
        times = {}
        for index, setting in enumerate(candidates):
            try:
                times[index] = launch_ms(lambda: launch(setting))
            except TOO_BIG:  # more shared memory or registers than the GPU has (float32 inputs)
                continue
        if not times:
            raise RuntimeError(f"{self.kernel}: no launch setting fits this GPU for key {name}")
        best = candidates[min(times, key=times.get)]
        self.measured += 1
        try:
            settings = read_settings(path)  # another process may have added keys meanwhile
            settings.setdefault(gpu, {}).setdefault(self.kernel, {})[name] = best
            write_settings(path, settings)
        except OSError as error:
            print(f"nanodllm: cannot write {path} ({error}); the settings last this process only", file=sys.stderr)
        return best
