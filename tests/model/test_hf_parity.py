"""The paged decoder's logits equal transformers' on the same checkpoint (fp32, CPU).

A batch of prompts of mixed lengths is prefilled through the paged cache in one step (one prompt
in two chunks, its second half attending to the cached first), then decoded greedily for several
steps, decodes and the remaining prefill chunk sharing a step. Every position's logits are
compared with a plain transformers forward over the same tokens, and the greedy tokens with
transformers' argmax.
"""

from __future__ import annotations

import functools

import pytest
import torch

from raypaged.kernels import ops
from raypaged.model.config import ModelConfig
from raypaged.model.loader import load_model
from tests.support.checkpoints import CHECKPOINTS, checkpoint_dir
from tests.support.model_harness import PagedHarness, run_mixed_schedule

PROMPT_LENGTHS = (5, 17, 1, 30)
DECODE_STEPS = 4


@functools.cache
def hf_model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        checkpoint_dir(name), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@functools.cache
def our_model(name: str) -> tuple[torch.nn.Module, ModelConfig]:
    config = ModelConfig.from_pretrained(checkpoint_dir(name), CHECKPOINTS[name].max_model_len)
    return load_model(config, dtype=torch.float32, progress=False), config


def random_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"req{i}": torch.randint(3, vocab_size, (n,), generator=generator).tolist()
        for i, n in enumerate(lengths)
    }


def assert_matches_transformers(
    name: str, harness: PagedHarness, prompts: dict[str, list[int]], generated: dict[str, list[int]]
) -> None:
    hf = hf_model(name)
    for req, prompt in prompts.items():
        computed = harness.tokens[req][: harness.num_computed[req]]
        with torch.no_grad():
            expected = hf(torch.tensor([computed])).logits[0].float()
        torch.testing.assert_close(harness.logits_of(req), expected, rtol=1e-5, atol=2e-5)
        hf_greedy = expected[len(prompt) - 1 :].argmax(-1).tolist()
        assert generated[req] == hf_greedy[: len(generated[req])], req
        assert len(generated[req]) >= DECODE_STEPS


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_paged_prefill_chunk_and_decode_match_transformers(name: str, block_size: int) -> None:
    model, config = our_model(name)
    harness = PagedHarness(model, config, block_size=block_size, num_blocks=48, seed=block_size)
    prompts = random_prompts(config.vocab_size, PROMPT_LENGTHS, seed=len(name))
    generated = run_mixed_schedule(harness, prompts, DECODE_STEPS, chunk="req3")
    assert_matches_transformers(name, harness, prompts, generated)


def test_prompt_prefilled_one_token_per_step_matches_transformers() -> None:
    """Extreme chunking: every prompt token is its own step, i.e. the decode kernel's path."""
    model, config = our_model("llama")
    harness = PagedHarness(model, config, block_size=8, num_blocks=16, seed=3)
    prompt = random_prompts(config.vocab_size, (11,), seed=7)["req0"]
    harness.add_tokens("req0", prompt)
    for _ in prompt:
        harness.step({"req0": 1})
    with torch.no_grad():
        expected = hf_model("llama")(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(harness.logits_of("req0"), expected, rtol=1e-5, atol=2e-5)


# qwen3-tied: head norms and yarn's attention factor on the kernels' tables; phi3-partial: the
# kernel rotating each head's leading dims in place.
@pytest.mark.parametrize("name", ["llama", "qwen3-tied", "phi3-partial"])
def test_triton_kernels_under_interpreter_match_transformers(name: str) -> None:
    """The same model path through the Triton kernels (TRITON_INTERPRET=1 on CPU)."""
    model, config = our_model(name)
    harness = PagedHarness(model, config, block_size=16, num_blocks=12, seed=5)
    prompts = random_prompts(config.vocab_size, (3, 9, 20), seed=11)
    ops.set_backend("triton")
    try:
        generated = run_mixed_schedule(harness, prompts, decode_steps=2, chunk="req2")
    finally:
        ops.set_backend("auto")
    for req, prompt in prompts.items():
        computed = harness.tokens[req][: harness.num_computed[req]]
        with torch.no_grad():
            expected = hf_model(name)(torch.tensor([computed])).logits[0]
        torch.testing.assert_close(harness.logits_of(req), expected, rtol=1e-4, atol=1e-4)
        assert generated[req] == expected[len(prompt) - 1 :].argmax(-1).tolist()[: len(generated[req])]
