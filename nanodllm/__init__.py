"""nanodllm: diffusion LLM inference (LLaDA masked diffusion, SDAR block diffusion) with pluggable
training-free sparse attention and caching methods."""

from .config import GenerationConfig, ModelConfig, preset
from .loader import build_random, load_model
from .model import Model

__all__ = ["GenerationConfig", "ModelConfig", "Model", "build_random", "load_model", "preset"]
