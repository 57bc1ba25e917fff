"""Method registry: the --method flag's value -> class. Add a method by adding one line."""

from .base import Dense, Method, StepContext
from .dllm_cache import DllmCache
from .mage import Mage
from .maskkv import MaskKV
from .quest import Quest
from .snapkv import SnapKV
from .sparsed import SparseD

METHODS: dict[str, type[Method]] = {
    "dense": Dense,
    "dllm_cache": DllmCache,
    "mage": Mage,
    "maskkv": MaskKV,
    "quest": Quest,
    "snapkv": SnapKV,
    "sparsed": SparseD,
}


def get_method(name: str, **knobs) -> Method:
    """Instantiate a registered method; an unknown name lists the valid ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}")
    return METHODS[name](**knobs)


def parse_knobs(text: str | None) -> dict:
    """'k=64,exact_layers=2,sparse_commit=true' -> {'k': 64, 'exact_layers': 2, 'sparse_commit': True}."""
    knobs = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"knobs are name=value pairs separated by commas, got {item!r}")
        value = value.strip()
        if value.lower() in ("true", "false"):
            knobs[name.strip()] = value.lower() == "true"
            continue
        for convert in (int, float):
            try:
                knobs[name.strip()] = convert(value)
                break
            except ValueError:
                pass
        else:
            knobs[name.strip()] = value
    return knobs


__all__ = ["METHODS", "Method", "Dense", "StepContext", "get_method", "parse_knobs"]
