"""Every served family in bf16 on the GPU (issue 21): raypaged's prompt logprobs, with CUDA
graphs on, against transformers' fp32 ones — judged by how far transformers' own bf16 model on
the same GPU lands from them, since bf16 alone moves a random model's logits by an amount no
fixed bound knows in advance."""

from __future__ import annotations

import json

import pytest
import torch

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import CHECKPOINTS, checkpoint_dir
from tests.support.hf_oracle import hf_prompt_logprobs, random_prompts, vocab_of

FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mistral-window"]


def _hf_bf16_logprobs(name: str, prompt: list[int]) -> torch.Tensor:
    """[P - 1] transformers' bf16 model on CUDA: the logprob of each prompt token after the first."""
    from transformers import AutoModelForCausalLM

    directory = checkpoint_dir(name)
    config = json.loads((directory / "config.json").read_text())
    # The oracle's rule (tests/support/hf_oracle.py): SDPA cannot soft-cap.
    kwargs = {"attn_implementation": "eager"} if config.get("attn_logit_softcapping") else {}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, **kwargs).cuda().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device="cuda")).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:], device="cuda")[:, None])[:, 0].cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", FAMILIES)
def test_family_in_bf16_is_as_close_to_transformers_as_its_own_bf16(name):
    prompts = random_prompts([40, 17, 9], vocab_of(name), seed=61)
    llm = LLM(str(checkpoint_dir(name)), device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=8,
              max_model_len=CHECKPOINTS[name].max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    try:
        assert llm.engine.executor.worker.runner.decode_graphs is not None
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    for prompt, result in zip(prompts, results):
        truth = hf_prompt_logprobs(name, tuple(prompt)).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        scored = result.prompt_logprobs
        assert scored is not None and len(scored) == len(prompt)
        ours = torch.tensor([entry[token] for entry, token in zip(scored[1:], prompt[1:])])
        theirs = _hf_bf16_logprobs(name, prompt)
        our_error, their_error = (ours - truth).abs().max().item(), (theirs - truth).abs().max().item()
        assert our_error <= 1.5 * their_error + 0.02, (
            f"{name}, prompt of {len(prompt)}: raypaged bf16 {our_error:.4f} from fp32, transformers bf16 "
            f"{their_error:.4f}")
        assert len(result.outputs[0].token_ids) == 8
