"""The built-in demo model: what raypaged serves when no model is named.

A ~4M-parameter LlamaForCausalLM with its own byte-level BPE tokenizer, both trained offline on
Python's standard library by ``scripts/make_demo_model.py`` and committed under
``raypaged/demo_model/`` (installed as package data). It loads through the same loader as any
Hugging Face checkpoint; its greedy output looks like Python, which is all it is for.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent / "demo_model"

# What a loader and AutoTokenizer need; training_info.json is provenance only.
DEMO_MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_REBUILD_COMMAND = "python scripts/make_demo_model.py --out raypaged/demo_model"


def demo_model_path() -> str:
    """Directory of the built-in demo model, after checking that its files are all there."""
    missing = [name for name in DEMO_MODEL_FILES if not (DEMO_MODEL_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the built-in demo model at {DEMO_MODEL_DIR} is missing {', '.join(missing)}; "
            f"reinstall raypaged, or rebuild it from a source checkout with `{_REBUILD_COMMAND}`"
        )
    return str(DEMO_MODEL_DIR)
