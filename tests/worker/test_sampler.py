"""The batched sampler against straightforward references on fixed logits.

Filters and the repetition penalty are checked against transformers' own logits processors,
chained in the sampler's (vLLM's) order; the draw is checked by chi-square on many seeded
draws; seeds by reproducibility across batch compositions, positions and forks.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from raypaged.core.sampling_params import SamplingParams
from raypaged.worker.sampler import Sampler, apply_top_k_top_p, processed_logits
from raypaged.worker.sampling_metadata import SamplingMetadata

# Chi-square critical value for 5 degrees of freedom at p ~ 1e-6: a correct sampler fails this
# about once in a million runs (and the tests are seeded, so never in practice).
CHI2_DF5_CRITICAL = 35.9


def build(params, prompts=None, outputs=None, vocab_size=None, sample_indices=None, logits=None):
    vocab_size = vocab_size if vocab_size is not None else logits.shape[1]
    prompts = prompts if prompts is not None else [[0]] * len(params)
    outputs = outputs if outputs is not None else [[]] * len(params)
    return SamplingMetadata.build(params, prompts, outputs, vocab_size, "cpu", sample_indices)


def hf_reference(logits_row: torch.Tensor, p: SamplingParams, prompt: list[int],
                 output: list[int]) -> torch.Tensor:
    """One row through transformers' processors in the sampler's order: repetition penalty,
    frequency/presence (written out: transformers has none), then for random rows temperature,
    min-p, top-k, top-p."""
    scores = logits_row.float().unsqueeze(0).clone()
    input_ids = torch.tensor([prompt + output])
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
    counts = torch.zeros_like(scores)
    for token, count in Counter(output).items():
        counts[0, token] = count
    scores = scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    if p.temperature < 1e-5:
        return scores[0]
    scores = TemperatureLogitsWarper(p.temperature)(input_ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(input_ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(input_ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(input_ids, scores)
    return scores[0]


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


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((observed - expected) ** 2 / expected).sum())


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


# ----------------------------------------------------------------------------- the draw


LOGITS_6 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])


def test_temperature_frequencies_match_softmax_unseeded():
    draws = 20_000
    temperature = 0.6
    logits = LOGITS_6.expand(draws, -1).contiguous()
    md = build([SamplingParams(temperature=temperature)] * draws, logits=logits)
    samples = Sampler(seed=11)(logits, md).sampled_token_ids
    assert chi_square(samples, torch.softmax(LOGITS_6 / temperature, -1)) < CHI2_DF5_CRITICAL
    # The bound has power: the untempered distribution is rejected by a wide margin.
    assert chi_square(samples, torch.softmax(LOGITS_6, -1)) > 20 * CHI2_DF5_CRITICAL


def test_seeded_rows_frequencies_match_softmax():
    # One draw per seed, many seeds: the per-row generators together sample the right law.
    draws = 4_000
    temperature = 1.3
    logits = LOGITS_6.expand(draws, -1).contiguous()
    md = build([SamplingParams(temperature=temperature, seed=s) for s in range(draws)], logits=logits)
    assert len(md.generators) == draws
    samples = Sampler()(logits, md).sampled_token_ids
    assert chi_square(samples, torch.softmax(LOGITS_6 / temperature, -1)) < CHI2_DF5_CRITICAL
    assert chi_square(samples, torch.softmax(LOGITS_6, -1)) > 3 * CHI2_DF5_CRITICAL


def test_filtered_draws_stay_in_the_allowed_set_with_renormalized_frequencies():
    draws = 20_000
    torch.manual_seed(8)
    row = torch.randn(40) * 1.5
    p = SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05)
    logits = row.expand(draws, -1).contiguous()
    samples = Sampler(seed=12)(logits, build([p] * draws, logits=logits)).sampled_token_ids
    reference = hf_reference(row, p, [0], [])
    allowed = (~torch.isinf(reference)).nonzero().flatten()
    assert 3 <= allowed.numel() <= 12
    assert set(samples.unique().tolist()) == set(allowed.tolist())
    # Frequencies over the allowed set follow the renormalized distribution.
    remap = torch.full((40,), -1, dtype=torch.int64)
    remap[allowed] = torch.arange(allowed.numel())
    observed = remap[samples]
    stat = chi_square(observed, torch.softmax(reference[allowed], -1))
    assert stat < 3 * allowed.numel() + 30  # far above the mean (df) for df <= 11, p < 1e-6


# ----------------------------------------------------------------------------- seeds


def sample_one(sampler, logits_row, params, output, neighbours=(), at_row=0, sample_index=0):
    """The token drawn for one request placed at `at_row` among other rows."""
    rows = list(neighbours)
    rows.insert(at_row, (params, output, sample_index))
    logits = logits_row.expand(len(rows), -1).contiguous()
    md = build([r[0] for r in rows], outputs=[r[1] for r in rows], logits=logits,
               sample_indices=[r[2] for r in rows])
    return sampler(logits, md).sampled_token_ids[at_row].item()


FLAT = torch.zeros(1000)  # uniform: the token is purely the row's randomness


def test_same_seed_same_tokens_in_any_batch_and_position():
    p = SamplingParams(seed=1234, max_tokens=64)
    neighbours = [(SamplingParams(), [], 0), (SamplingParams(seed=99), [5], 0),
                  (SamplingParams(temperature=0), [], 0), (SamplingParams(seed=1234, top_k=500), [], 0)]
    history: list[int] = []
    for step in range(8):
        alone = sample_one(Sampler(seed=1), FLAT, p, history)
        crowded = sample_one(Sampler(seed=2), FLAT, p, history, neighbours, at_row=step % 5)
        assert alone == crowded
        history.append(alone)
    assert len(set(history)) > 1  # the position moves the stream on
    # Preemption recomputes the request with its outputs so far: same history, same next token.
    resumed = [sample_one(Sampler(), FLAT, p, history[:k]) for k in range(3, 8)]
    assert resumed == history[3:8]


def test_different_seeds_differ_and_unseeded_follow_the_sampler_seed():
    tokens = [[sample_one(Sampler(), FLAT, SamplingParams(seed=s), [0] * k) for k in range(5)]
              for s in range(4)]
    assert len({tuple(t) for t in tokens}) == 4
    unseeded = SamplingParams()
    first = [sample_one(Sampler(seed=7), FLAT, unseeded, []) for _ in range(2)]
    assert first[0] == first[1]
    other = [sample_one(Sampler(seed=s), FLAT, unseeded, []) for s in range(8, 12)]
    assert len(set(other + first)) > 1


def test_n_samples_draw_distinct_streams_that_match_their_forks():
    parent = SamplingParams(n=3, seed=42)
    for position in range(4):
        output = [0] * position
        together = [sample_one(Sampler(), FLAT, parent, output,
                               [(parent, output, j) for j in range(3) if j != i], at_row=i, sample_index=i)
                    for i in range(3)]
        # After the fork each sample carries for_sample(i): its stream must continue unchanged.
        forked = [sample_one(Sampler(), FLAT, parent.for_sample(i), output) for i in range(3)]
        assert together == forked
        assert len(set(together)) > 1


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
