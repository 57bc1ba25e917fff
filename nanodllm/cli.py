"""What the command lines (demo, eval, scripts/sweep.py) share: flag types that refuse a bad value
with the flag's name before anything loads, and the checks of a device and a step count."""

from __future__ import annotations

import argparse

import torch

from .config import GenerationConfig


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1, e.g. 1024,2048."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, e.g. 1024,2048; got {text!r}")


def device(name: str) -> torch.device:
    """argparse type: a torch device this machine has."""
    try:
        chosen = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a device (cpu, cuda, cuda:1, ...)")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name!r}: torch sees no CUDA GPU here (its CPU build, or no driver); use cpu")
    return chosen


def check_steps(gen: GenerationConfig, is_block: bool):
    """Each step unmasks at least one token: more steps than the tokens they decode (per block on the
    block engine) would run forwards that change nothing, so they are refused."""
    most = gen.block_length if is_block else gen.gen_length
    if gen.steps > most:
        what = f"--block-length {gen.block_length} (steps are per block)" if is_block else f"--gen-length {gen.gen_length}"
        raise ValueError(f"--steps {gen.steps} exceeds {what}: at most {most} steps unmask anything")
