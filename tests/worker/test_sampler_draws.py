"""The sampler's draw and seeds: frequencies checked by chi-square on many seeded draws, and
seeds by reproducibility across batch compositions, positions and forks.
"""

from __future__ import annotations

import torch

from raypaged.core.sampling_params import SamplingParams
from raypaged.worker.sampler import Sampler
from tests.support.sampler_references import build, hf_reference

# Chi-square critical value for 5 degrees of freedom at p ~ 1e-6: a correct sampler fails this
# about once in a million runs (and the tests are seeded, so never in practice).
CHI2_DF5_CRITICAL = 35.9


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((observed - expected) ** 2 / expected).sum())


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
