"""A request resumed with outputs it already has (Request.resumed_output_token_ids, what the
frontend sends a new engine after the old one died) goes on exactly as if it had never stopped:
greedy, seeded sampling (the sampler seeds by (seed, output position)), an n = 2 sample resumed
alone with its own seed, penalties over its outputs, min_tokens, a grammar whose matcher is
advanced over the outputs, logit_bias; with asynchronous scheduling off and on. A resumed
request that is not one sample with room left is refused."""

from __future__ import annotations

import dataclasses

import pytest

from raypaged import LLM, SamplingParams
from raypaged.core.errors import InvalidRequestError
from raypaged.core.request import Request
from raypaged.core.structured_output import StructuredOutput
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import random_prompts, vocab_of

NAME = "llama"
MAX_TOKENS = 14
CUT = 5  # outputs the first engine had streamed when it died


@pytest.fixture(scope="module", params=[pytest.param(False, marks=pytest.mark.slow), True],
                ids=["sync", "async"])
def llm(request):
    engine = LLM(str(checkpoint_dir(NAME)), async_scheduling=request.param, block_size=8,
                 num_gpu_blocks_override=64)
    yield engine
    engine.shutdown()


def run(llm: LLM, requests: list[Request]) -> dict[tuple[str, int], list[int]]:
    """Every sample's output tokens, by (group id, sample index), stepping the engine to the end."""
    tokens: dict[tuple[str, int], list[int]] = {}
    for request in requests:
        llm.engine.add_request(request)
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.error is None, out.error
            tokens.setdefault((out.group_id, out.sample_index), []).extend(out.new_token_ids)
    return tokens


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, seed=7, frequency_penalty=1.5, presence_penalty=0.5,
                                repetition_penalty=1.3, max_tokens=MAX_TOKENS, ignore_eos=True),
    "min_tokens_logit_bias": SamplingParams(temperature=0.7, seed=99, min_tokens=MAX_TOKENS - 2,
                                            max_tokens=MAX_TOKENS, logit_bias={3: 5.0, 11: -100.0}),
    "grammar": SamplingParams(temperature=0.9, seed=5, max_tokens=MAX_TOKENS,
                              structured_output=StructuredOutput(regex="a[b-e]{3}x[a-e]{2}y[a-e0-9]{20}")),
}


@pytest.mark.parametrize("kind", list(PARAMS))
def test_resumed_request_goes_on_as_if_nothing_happened(llm, kind):
    prompt = random_prompts([11], vocab_of(NAME), seed=61)[0]
    params = PARAMS[kind]
    whole = run(llm, [Request(f"{kind}-whole", prompt, params)])[(f"{kind}-whole", 0)]
    assert len(whole) > CUT
    resumed = Request(f"{kind}-resumed", prompt, params, resumed_output_token_ids=tuple(whole[:CUT]))
    rest = run(llm, [resumed])[(f"{kind}-resumed", 0)]
    assert whole[:CUT] + rest == whole
    assert llm.engine.scheduler.kv_cache_manager.usage == 0


def test_an_n2_sample_resumed_alone_goes_on_with_its_own_seed(llm):
    prompt = random_prompts([9], vocab_of(NAME), seed=62)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=42, max_tokens=MAX_TOKENS, ignore_eos=True)
    whole = run(llm, [Request("group", prompt, params)])
    assert whole[("group", 0)] != whole[("group", 1)]
    for index in (0, 1):
        resumed = Request(f"sample{index}", prompt, params.for_sample(index),
                          resumed_output_token_ids=tuple(whole[("group", index)][:CUT]))
        rest = run(llm, [resumed])[(f"sample{index}", 0)]
        assert whole[("group", index)] == whole[("group", index)][:CUT] + rest


@pytest.mark.parametrize("change, message", [
    (dict(sampling_params=SamplingParams(n=2, max_tokens=8)), "one sample"),
    (dict(resumed_output_token_ids=(1, 2, 3, 4, 5, 6, 7, 8)), "nothing to generate"),
    (dict(resumed_output_token_ids=(1, -1)), "non-negative"),
])
def test_a_resumed_request_that_cannot_go_on_is_refused(llm, change, message):
    request = Request("bad", [1, 2, 3], SamplingParams(max_tokens=8), resumed_output_token_ids=(4,))
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request(dataclasses.replace(request, **change))
    assert not llm.engine.has_unfinished_requests()
