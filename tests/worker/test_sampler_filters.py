"""The sampler's filters (temperature, min-p, top-k, top-p) and penalties (repetition,
frequency, presence) against transformers' own logits processors, chained in the sampler's
(vLLM's) order (tests/support/sampler_references.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from raypaged.core.sampling_params import SamplingParams
from raypaged.worker.sampler import Sampler, apply_top_k_top_p, processed_logits
from tests.support.sampler_references import build, hf_reference


def assert_same_filtering(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # The allowed token set must be exactly the reference's; the surviving values equal.
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    torch.testing.assert_close(actual[kept], expected[kept], rtol=1e-6, atol=1e-6)


def random_params(rng: random.Random, vocab_size: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([-1, 0, 1, 5, 20, vocab_size, vocab_size + 10]),
        top_p=rng.choice([1.0, 0.3, 0.8, 0.95]),
        min_p=rng.choice([0.0, 0.05, 0.2]),
        repetition_penalty=rng.choice([1.0, 1.0, 0.8, 1.3]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.7]),
        presence_penalty=rng.choice([0.0, 0.0, 1.0, -0.4]),
        seed=rng.choice([None, rng.randrange(1000)]),
        logprobs=rng.choice([None, 0, 3]),
    )


# ----------------------------------------------------------------------------- filters


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_matches_transformers_row_by_row(seed):
    # Every row's processed logits equal transformers' chain for that row alone: per-row
    # parameters neither leak between rows nor depend on the batch.
    rng = random.Random(seed)
    vocab_size, rows = 50, 24
    torch.manual_seed(seed)
    logits = torch.randn(rows, vocab_size) * 3
    params = [random_params(rng, vocab_size) for _ in range(rows)]
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab_size) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    md = build(params, prompts, outputs, logits=logits)
    actual = processed_logits(logits, md)
    for row in range(rows):
        expected = hf_reference(logits[row], params[row], prompts[row], outputs[row])
        assert_same_filtering(actual[row], expected)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 7])
def test_top_k_keeps_ties_like_transformers(top_k):
    # Integer logits make ties at the k-th value: every tied token stays, as in transformers.
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0, 2.0, 0.0, 1.0]])
    p = SamplingParams(top_k=top_k)
    actual = processed_logits(logits, build([p], logits=logits))[0]
    assert_same_filtering(actual, hf_reference(logits[0], p, [0], []))


@pytest.mark.parametrize("top_k", [-1, 3])
def test_top_p_keeps_every_token_tied_with_the_last_one_kept(top_k):
    # The nucleus ends inside a tie group: transformers keeps whichever tied tokens its sort
    # put last; the sampler keeps them all, so the result does not depend on sort order.
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0, 2.0, 0.0, 1.0]])
    p = SamplingParams(top_p=0.25, top_k=top_k)
    actual = processed_logits(logits, build([p], logits=logits))[0]
    transformers_kept = ~torch.isinf(hf_reference(logits[0], p, [0], []))
    assert transformers_kept.sum() == 1
    assert (~torch.isinf(actual)).tolist() == (logits[0] == 3.0).tolist()
    assert (transformers_kept & torch.isinf(actual)).sum() == 0


@pytest.mark.parametrize("candidates", [1, 4, 16, 1024])
def test_top_p_candidate_prefix_and_full_sort_agree_with_transformers(candidates):
    # A nucleus that fits in the candidate prefix is found there; one that does not (flat rows,
    # high p) falls back to a full sort of that row alone. Both must equal transformers.
    torch.manual_seed(10)
    vocab_size = 64
    scales = torch.tensor([0.1, 0.5, 1.0, 3.0, 8.0, 20.0]).repeat_interleave(4)
    logits = torch.randn(len(scales), vocab_size) * scales.unsqueeze(1)
    top_ps = [0.2, 0.6, 0.9, 0.99] * 6
    top_ks = [-1, 30, -1, 5, 2, -1] * 4
    params = [SamplingParams(top_p=p, top_k=k) for p, k in zip(top_ps, top_ks)]
    md = build(params, logits=logits)
    actual = apply_top_k_top_p(logits.clone(), md.top_k, md.max_top_k, md.top_p, candidates)
    for row, p in enumerate(params):
        assert_same_filtering(actual[row], hf_reference(logits[row], p, [0], []))


def test_top_p_default_candidate_prefix_on_a_large_batch():
    # 32 rows of a 5000-token vocabulary take the default prefix path (4096 candidates); the
    # flat rows' nuclei do not fit in it and spill to the full sort.
    torch.manual_seed(11)
    rows, vocab_size = 32, 5000
    logits = torch.randn(rows, vocab_size) * torch.linspace(0.01, 8.0, rows).unsqueeze(1)
    params = [SamplingParams(top_p=[0.97, 0.5, 0.9][row % 3], top_k=[-1, -1, 4500, 40][row % 4])
              for row in range(rows)]
    actual = processed_logits(logits, build(params, logits=logits))
    for row, p in enumerate(params):
        assert_same_filtering(actual[row], hf_reference(logits[row], p, [0], []))


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9, 0.999])
def test_top_p_set_matches_transformers(top_p):
    torch.manual_seed(3)
    logits = torch.randn(1, 64) * 2
    p = SamplingParams(top_p=top_p)
    actual = processed_logits(logits, build([p], logits=logits))[0]
    expected = hf_reference(logits[0], p, [0], [])
    assert_same_filtering(actual, expected)
    assert (~torch.isinf(actual)).sum() >= 1


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_set_matches_transformers(min_p):
    torch.manual_seed(4)
    logits = torch.randn(1, 64) * 2
    p = SamplingParams(min_p=min_p, temperature=0.7)
    actual = processed_logits(logits, build([p], logits=logits))[0]
    assert_same_filtering(actual, hf_reference(logits[0], p, [0], []))


def test_rows_with_filters_off_are_untouched():
    # Row 1 has top-p 1 beside a top-p row: its underflowing (-200) token must survive, and
    # top-k at or past the vocabulary means no top-k at all.
    logits = torch.tensor([[2.0, 1.0, 0.0, -200.0], [2.0, 1.0, 0.0, -200.0], [0.5, 0.1, 0.2, 0.3]])
    params = [SamplingParams(top_p=0.5), SamplingParams(top_k=4), SamplingParams(top_k=99)]
    md = build(params, logits=logits)
    out = processed_logits(logits, md)
    assert torch.equal(out[1:], logits[1:])
    assert torch.isinf(out[0, 1:]).all() and out[0, 0] == 2.0
    assert build(params[1:], vocab_size=4).top_k is None


def test_temperature_only_batch_builds_nothing_else():
    md = build([SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)], outputs=[[1, 1], [2]],
               vocab_size=8)
    assert md.temperature is not None and md.greedy_mask is not None
    assert md.top_k is md.top_p is md.min_p is None
    assert md.output_token_counts is None and md.prompt_token_mask is None and not md.has_penalties
    assert md.max_num_logprobs is None and md.generators == {}


# ----------------------------------------------------------------------------- penalties


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(5)
    logits = torch.randn(3, 32) * 4
    prompts = [[1, 2, 2, 30], [5, 6], [7]]
    outputs = [[3, 1, 3], [], [8, 9]]
    params = [SamplingParams(temperature=0, repetition_penalty=1.5),
              SamplingParams(temperature=0, repetition_penalty=0.7),
              SamplingParams(temperature=0)]
    out = processed_logits(logits, build(params, prompts, outputs, logits=logits))
    for row in range(2):
        ids = torch.tensor([prompts[row] + outputs[row]])
        processor = RepetitionPenaltyLogitsProcessor(params[row].repetition_penalty)
        expected = processor(ids, logits[row:row + 1].clone())
        torch.testing.assert_close(out[row], expected[0], rtol=0, atol=0)
    assert torch.equal(out[2], logits[2])  # no penalty asked: bit-identical


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(2, 10)
    prompts = [[4, 4, 4, 5], [4]]
    outputs = [[1, 1, 1, 2, 4], [1]]
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), SamplingParams()]
    out = processed_logits(logits, build(params, prompts, outputs, logits=logits))
    expected = torch.zeros(10)
    expected[1] = -(3 * 0.5 + 0.25)
    expected[2] = -(1 * 0.5 + 0.25)
    expected[4] = -(1 * 0.5 + 0.25)  # counted once, from the output: the prompt's three do not count
    torch.testing.assert_close(out[0], expected, rtol=0, atol=1e-7)
    assert out[0, 5] == 0.0  # a prompt-only token is not penalized
    assert torch.equal(out[1], logits[1])


def test_penalties_move_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.9, 1.0, -1.0]])
    sampler = Sampler(seed=0)
    plain = sampler(logits, build([SamplingParams(temperature=0)], logits=logits))
    assert plain.sampled_token_ids.tolist() == [0]
    for p in (SamplingParams(temperature=0, repetition_penalty=1.1),
              SamplingParams(temperature=0, frequency_penalty=0.2),
              SamplingParams(temperature=0, presence_penalty=0.2)):
        md = build([p], prompts=[[0] if p.repetition_penalty != 1.0 else [3]], outputs=[[0]], logits=logits)
        assert sampler(logits, md).sampled_token_ids.tolist() == [1], p
    # Penalties counted only for rows that ask: the other row's token lists are not read.
    md = build([SamplingParams(presence_penalty=1.0), SamplingParams()], outputs=[[0], [0, 1]], vocab_size=4)
    assert md.output_token_counts[1].sum() == 0 and md.output_token_counts[0].tolist() == [1, 0, 0, 0]
