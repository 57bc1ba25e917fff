"""Method registry: the --method flag's value -> class. Add a method by adding one line."""

import inspect

from .base import Dense, Method, StepContext
from .dllm_cache import DllmCache
from .dyllm import DyLLM
from .fast_dllm import FastDllm
from .mage import Mage
from .momo import Momo
from .maskkv import MaskKV
from .quest import Quest
from .snapkv import SnapKV
from .sparse_dllm import SparseDllm
from .sparsed import SparseD

METHODS: dict[str, type[Method]] = {
    "dense": Dense,
    "dllm_cache": DllmCache,
    "dyllm": DyLLM,
    "fast_dllm": FastDllm,
    "mage": Mage,
    "maskkv": MaskKV,
    "momo": Momo,
    "quest": Quest,
    "snapkv": SnapKV,
    "sparse_dllm": SparseDllm,
    "sparsed": SparseD,
}


def get_method(name: str, **knobs) -> Method:
    """Instantiate a registered method; an unknown name lists the valid ones, an unknown knob the
    method's knobs with their defaults."""
    defaults = knob_defaults(name)
    unknown = sorted(set(knobs) - set(defaults))
    if unknown:
        listed = ", ".join(f"{knob}={value}" for knob, value in defaults.items()) or "none"
        raise ValueError(f"method {name!r} has no knob {', '.join(map(repr, unknown))}; its knobs (defaults): {listed}")
    return METHODS[name](**knobs)


def knob_defaults(name: str) -> dict:
    """A registered method's knobs and their defaults (the paper's), read off its constructor."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}")
    parameters = list(inspect.signature(METHODS[name].__init__).parameters.values())[1:]  # past self
    return {p.name: p.default for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def parse_knobs(text: str | None) -> dict:
    """'k=64,exact_layers=2,sparse_commit=true' -> {'k': 64, 'exact_layers': 2, 'sparse_commit': True}."""
    knobs = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"knobs are name=value pairs separated by commas, got {item!r}")
        knobs[name.strip()] = parse_value(value)
    return knobs


def parse_value(text: str):
    """A knob's value from text: true/false, an int, a float, else the string itself."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


__all__ = ["METHODS", "Method", "Dense", "StepContext", "get_method", "knob_defaults", "parse_knobs", "parse_value"]
