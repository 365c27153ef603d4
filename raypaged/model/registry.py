"""Every architecture raypaged serves, by config.json's name, and the class that builds it."""

from __future__ import annotations

from . import gemma, llama
from .config import SUPPORTED_ARCHITECTURES

MODEL_REGISTRY: dict[str, type[llama.LlamaForCausalLM]] = {
    **llama.MODEL_REGISTRY,
    **gemma.MODEL_REGISTRY,
}
assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES
