"""Every architecture raypaged serves, by the name config.json's "architectures" gives it."""

from __future__ import annotations

from . import gemma, llama
from .config import SUPPORTED_ARCHITECTURES
from .phi3 import Phi3ForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[llama.LlamaForCausalLM]] = {
    **llama.MODEL_REGISTRY,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    **gemma.MODEL_REGISTRY,
}
assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES
