"""Method registry: the --method flag's value -> class. Add a method by adding one line."""

from .base import Dense, Method, StepContext

METHODS: dict[str, type[Method]] = {
    "dense": Dense,
}


def get_method(name: str, **knobs) -> Method:
    """Instantiate a registered method; an unknown name lists the valid ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}")
    return METHODS[name](**knobs)


__all__ = ["METHODS", "Method", "Dense", "StepContext", "get_method"]
