"""nanodllm: diffusion LLM inference (LLaDA, Dream, SDAR, LLaDA2, Fast-dLLM v2) with pluggable
training-free sparse attention and caching methods."""

from .config import GenerationConfig, ModelConfig, preset
from .generation import generate
from .loader import build_random, load_model
from .model import Model

__version__ = "0.1.0"
__all__ = ["GenerationConfig", "ModelConfig", "Model", "build_random", "generate", "load_model", "preset"]
