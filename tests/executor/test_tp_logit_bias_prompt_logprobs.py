"""logit_bias and prompt logprobs under tensor parallelism (TP = 2 over Ray, gloo on CPU): the
prompt positions' logits are gathered over the vocabulary shards on every rank (a collective
both ranks join) and rank 0 scores them; the bias applies on rank 0's sampler, whose tokens the
other rank's placeholder inputs take (asynchronous scheduling on)."""

from __future__ import annotations

import pytest
import ray

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import hf_greedy, hf_prompt_logprobs, random_prompts, vocab_of

pytestmark = pytest.mark.integration

NAME = "llama"


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_prompt_logprobs_and_logit_bias_under_tp2():
    prompts = random_prompts([21, 6], vocab_of(NAME), seed=61)
    plain = [hf_greedy(checkpoint_dir(NAME), tuple(p), 6) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                             logit_bias={plain[1][0]: -100.0})]
    llm = LLM(str(checkpoint_dir(NAME)), tensor_parallel_size=2, block_size=8,
              max_num_batched_tokens=16, async_scheduling=True)
    try:
        scored, biased = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert scored.outputs[0].token_ids == plain[0]
    assert biased.outputs[0].token_ids[0] != plain[1][0]
    expected = hf_prompt_logprobs(NAME, tuple(prompts[0]))
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    for i, entry in enumerate(scored.prompt_logprobs[1:]):
        assert entry is not None
        token = prompts[0][i + 1]
        assert abs(entry[token] - expected[i, token].item()) < 1e-4
        assert set(entry) == set(expected[i].topk(2).indices.tolist()) | {token}
