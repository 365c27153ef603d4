"""Greedy continuations from Hugging Face transformers (fp32, CPU): the correctness oracle."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import torch

from tests.support.checkpoints import checkpoint_dir


@functools.cache
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    # Eager attention where the model's attention soft-caps its logits (Gemma 2): SDPA cannot
    # express the cap, and transformers 5.17 loads Gemma 2 with SDPA by default, silently
    # dropping it (later releases choose eager themselves).
    with open(Path(model_dir) / "config.json") as f:
        soft_capped = json.load(f).get("attn_logit_softcapping") is not None
    kwargs = {"attn_implementation": "eager"} if soft_capped else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    model.eval()
    return model


def hf_greedy(model_dir: str | Path, prompt: tuple[int, ...], max_new_tokens: int,
              stop_on_eos: bool = False, **generate_kwargs) -> list[int]:
    """transformers' own greedy generate; EOS ignored unless asked (as ignore_eos=True).
    generate_kwargs: more of generate's arguments (e.g. repetition_penalty)."""
    return list(_hf_greedy(str(model_dir), tuple(prompt), max_new_tokens, stop_on_eos,
                           tuple(sorted(generate_kwargs.items()))))


@functools.cache
def _hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int,
               stop_on_eos: bool, generate_kwargs: tuple = ()) -> tuple[int, ...]:
    model = _hf_model(model_dir)
    saved = model.generation_config.eos_token_id, model.config.eos_token_id
    if not stop_on_eos:
        # No EOS at all (not min_new_tokens, which would mask EOS and change the argmax).
        # transformers falls back to the model's own configs, so clear it there.
        model.generation_config.eos_token_id = model.config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0, **dict(generate_kwargs),
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    finally:
        model.generation_config.eos_token_id, model.config.eos_token_id = saved
    return tuple(out[0, len(prompt):].tolist())


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0,
                   prefix: list[int] | None = None) -> list[list[int]]:
    """Prompts of the given lengths from ids 3.. (0-2 are unk/bos/eos), after a shared prefix."""
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def vocab_of(name: str) -> int:
    return json.loads((checkpoint_dir(name) / "config.json").read_text())["vocab_size"]


def assert_matches_hf(name: str, prompts: list[list[int]], results, max_tokens: int):
    """Every sample of each result is transformers' greedy continuation of its prompt, cut by length."""
    for prompt, result in zip(prompts, results):
        expected = hf_greedy(checkpoint_dir(name), tuple(prompt), max_tokens)
        for sample in result.outputs:
            assert sample.token_ids == expected, f"prompt of {len(prompt)} tokens"
            assert sample.finish_reason == "length"


@functools.cache
def hf_prompt_logprobs(name: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[P - 1, V] float32: row i is log_softmax of transformers' logits predicting prompt token
    i + 1 (what prompt_logprobs must return)."""
    model = _hf_model(str(checkpoint_dir(name)))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]
