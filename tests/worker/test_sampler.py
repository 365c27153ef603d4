"""The batched sampler: greedy rows, logprobs, and bad input refused. Filters and penalties
against transformers: test_sampler_filters.py; the draw and seeds: test_sampler_draws.py.
"""

from __future__ import annotations

import pytest
import torch

from raypaged.core.sampling_params import SamplingParams
from raypaged.worker.sampler import Sampler
from tests.support.sampler_references import build

# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_of_raw_logits(dtype):
    torch.manual_seed(6)
    logits = (torch.randn(9, 300) * 5).to(dtype)
    expected = logits.float().argmax(dim=-1)
    sampler = Sampler(seed=1)
    all_greedy = build([SamplingParams(temperature=0)] * 9, logits=logits)
    assert all_greedy.temperature is None and all_greedy.all_greedy
    assert torch.equal(sampler(logits, all_greedy).sampled_token_ids, expected)
    # In a mixed batch, greedy rows (including temperature below 1e-5) still get the argmax.
    params = [SamplingParams(temperature=0 if i % 3 == 0 else (1e-6 if i % 3 == 1 else 1.5), seed=i)
              for i in range(9)]
    mixed = sampler(logits, build(params, logits=logits)).sampled_token_ids
    greedy_rows = [i for i in range(9) if i % 3 != 2]
    assert torch.equal(mixed[greedy_rows], expected[greedy_rows])
    # With this flat a distribution at T = 1.5, the random rows are not all the argmax.
    assert not torch.equal(mixed[2::3], expected[2::3])


def test_top_k_one_is_greedy():
    torch.manual_seed(7)
    logits = torch.randn(6, 100)
    md = build([SamplingParams(top_k=1, temperature=2.0)] * 6, logits=logits)
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(dim=-1))


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_sampled_token_and_rank():
    torch.manual_seed(9)
    logits = torch.randn(4, 50) * 2
    params = [SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0.5, repetition_penalty=1.4, logprobs=5, seed=3),
              SamplingParams(temperature=1.0, logprobs=None),
              SamplingParams(temperature=2.0, top_p=0.9, logprobs=0, seed=4)]
    md = build(params, prompts=[[1, 2]] * 4, outputs=[[3]] * 4, logits=logits)
    assert md.max_num_logprobs == 5
    out = Sampler(seed=0)(logits, md)
    expected = torch.log_softmax(logits, dim=-1)  # raw: no penalty, no temperature
    sampled = out.sampled_token_ids.tolist()
    assert out.logprobs.shape == out.logprob_token_ids.shape == (4, 6)
    dicts = out.logprobs_as_dicts()
    for row, k in enumerate([3, 5, None, 0]):
        token = sampled[row]
        assert out.logprob_token_ids[row, 0] == token
        torch.testing.assert_close(out.logprobs[row, 0], expected[row, token])
        assert out.sampled_token_ranks[row] == 1 + int((expected[row] > expected[row, token]).sum())
        top_values, top_ids = expected[row].sort(descending=True)
        assert out.logprob_token_ids[row, 1:].tolist() == top_ids[:5].tolist()
        torch.testing.assert_close(out.logprobs[row, 1:], top_values[:5])
        if k is None:
            assert dicts[row] is None
            continue
        wanted = {token: expected[row, token].item()}
        wanted.update({t: expected[row, t].item() for t in top_ids[:k].tolist()})
        assert dicts[row].keys() == wanted.keys()
        for t, value in wanted.items():
            assert dicts[row][t] == pytest.approx(value, abs=1e-6)
    assert out.sampled_token_ranks[0] == 1  # greedy takes the most likely token


def test_greedy_fast_path_logprobs_from_half_precision():
    logits = torch.tensor([[0.5, 3.0, -1.0, 3.0]], dtype=torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0, logprobs=2)], logits=logits))
    assert out.sampled_token_ids.tolist() == [1]  # first of the tied maxima, like torch.argmax
    assert out.logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1)
    assert out.logprobs_as_dicts() == [{1: expected[0, 1].item(), 3: expected[0, 3].item()}]
    no_logprobs = Sampler()(logits, build([SamplingParams(temperature=0)], logits=logits))
    assert no_logprobs.logprobs is None and no_logprobs.logprobs_as_dicts() == [None]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prompts=[[0], [0]], outputs=[[]]), ValueError, "output_token_ids has 1 rows"),
    (dict(sample_indices=[1, 0]), ValueError, r"sample_indices\[0\] = 1 is outside \[0, n=1\)"),
    (dict(outputs=[[], [3, 10]]), ValueError, r"output_token_ids\[1\] holds a token id outside"),
    (dict(prompts=[[0], [-1]]), ValueError, r"prompt_token_ids\[1\] holds a token id outside"),
    (dict(outputs=[[], [1.5]]), ValueError, "output_token_ids must hold integer token ids"),
    (dict(vocab_size=0), ValueError, "vocab_size must be a positive integer"),
])
def test_bad_metadata_input_raises(kwargs, error, match):
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.2)]
    kwargs.setdefault("vocab_size", 10)
    with pytest.raises(error, match=match):
        build(params, **kwargs)
    with pytest.raises(TypeError, match="not SamplingParams"):
        build([{"temperature": 1.0}], vocab_size=10)
    with pytest.raises(ValueError, match="at least one row"):
        build([], vocab_size=10)


def test_bad_logits_raise_and_change_nothing():
    sampler = Sampler(seed=3)
    params = [SamplingParams(top_k=3, repetition_penalty=1.3), SamplingParams()]
    logits = torch.randn(2, 10)
    md = build(params, logits=logits)
    before = logits.clone()
    first = sampler(logits, md).sampled_token_ids
    assert torch.equal(logits, before)  # the caller's logits are never modified
    state = sampler._shared_generator(logits.device).get_state()
    with pytest.raises(ValueError, match=r"logits have shape \(2, 11\)"):
        sampler(torch.randn(2, 11), md)
    with pytest.raises(TypeError, match="floating-point"):
        sampler(torch.zeros(2, 10, dtype=torch.int64), md)
    assert torch.equal(sampler._shared_generator(logits.device).get_state(), state)
    # The metadata is reusable: its per-row generators were not advanced by the failures...
    md_again = build(params, logits=logits)
    assert torch.equal(Sampler(seed=3)(logits, md_again).sampled_token_ids, first)
