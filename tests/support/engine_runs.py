"""One LLM built, run over prompts and shut down: what the engine tests do most."""

from __future__ import annotations

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import checkpoint_dir


def generate_once(name: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                  **engine_kwargs):
    """(the shut-down LLM, its results) for test checkpoint `name` built with engine_kwargs."""
    llm = LLM(str(checkpoint_dir(name)), **engine_kwargs)
    try:
        return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
