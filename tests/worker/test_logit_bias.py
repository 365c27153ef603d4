"""logit_bias in the sampler: a sparse add over the rows that have one, before penalties and
sampling, greedy rows included; raw logprobs unchanged; nothing launched without a bias."""

from __future__ import annotations

import pytest
import torch

from raypaged.core.errors import InvalidRequestError
from raypaged.core.sampling_params import SamplingParams
from raypaged.worker.sampler import Sampler, apply_logit_bias, processed_logits
from raypaged.worker.sampling_metadata import SamplingMetadata

V = 12


def build(params, outputs=None):
    outputs = outputs or [[] for _ in params]
    return SamplingMetadata.build(params, [[0]] * len(params), outputs, V, "cpu")


def dense(bias: dict[int, float]) -> torch.Tensor:
    row = torch.zeros(V)
    for t, b in bias.items():
        row[t] += b
    return row


def test_bias_moves_greedy_and_random_rows_and_leaves_others_bit_identical():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    biases = [{3: 100.0}, {}, {5: 100.0, 0: -100.0}, {7: -2.5, 1: 4.0}]
    params = [SamplingParams(temperature=0.0, logit_bias=biases[0]), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=1, logit_bias=biases[2]),
              SamplingParams(temperature=0.0, frequency_penalty=0.5, logit_bias=biases[3])]
    md = build(params, outputs=[[], [], [], [1, 1]])
    got = processed_logits(logits, md)
    # Bias first, then the penalty (vLLM's order): the penalized row sees the biased logit.
    expected_last = logits[3] + dense(biases[3]) - 0.5 * torch.bincount(torch.tensor([1, 1]), minlength=V)
    torch.testing.assert_close(got[3], expected_last)
    assert torch.equal(got[1], logits[1])  # no bias: untouched
    torch.testing.assert_close(got[0], logits[0] + dense(biases[0]))
    out = Sampler(seed=0)(logits, md)
    assert out.sampled_token_ids[0].item() == 3 and out.sampled_token_ids[2].item() == 5
    assert out.sampled_token_ids[1].item() == logits[1].argmax().item()


def test_raw_logprobs_ignore_the_bias():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    md = build([SamplingParams(temperature=0.0, logprobs=2, logit_bias={4: 50.0}),
                SamplingParams(temperature=0.0, logprobs=2)])
    out = Sampler(seed=0)(logits, md)
    assert out.sampled_token_ids.tolist()[0] == 4
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs[0, 0], raw[0, 4])  # the sampled token's raw logprob


def test_no_bias_in_the_batch_launches_nothing(monkeypatch):
    md = build([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)])
    assert md.logit_bias_index is None and md.logit_bias_values is None
    logits = torch.randn(2, V)
    assert apply_logit_bias(logits, md) is logits

    def refuse(*args, **kwargs):
        raise AssertionError("index_add launched for a batch without logit_bias")

    monkeypatch.setattr(torch.Tensor, "index_add", refuse)
    Sampler(seed=0)(logits, md)


def test_a_grammar_masked_token_stays_out_whatever_its_bias():
    logits = torch.zeros(1, V)
    logits[0, 2] = float("-inf")  # what the bitmask leaves for a token the grammar forbids
    md = build([SamplingParams(temperature=0.0, logit_bias={2: 100.0})])
    assert Sampler(seed=0)(logits, md).sampled_token_ids.item() != 2
    assert processed_logits(logits, md)[0, 2].item() == float("-inf")


def test_half_precision_logits_are_biased_in_float32():
    logits = torch.zeros(1, V, dtype=torch.bfloat16)
    logits[0, 6] = 1.0
    md = build([SamplingParams(temperature=0.0, logit_bias={9: 1.001})])
    assert Sampler(seed=0)(logits, md).sampled_token_ids.item() == 9  # 1.001 > 1 only in fp32


@pytest.mark.parametrize("bias, match", [({1: 100.5}, r"\[-100, 100\]"), ({-3: 1.0}, "token ids"),
                                         ({1: float("inf")}, r"\[-100, 100\]"), ({"a": 1.0}, "token ids"),
                                         ({True: 1.0}, "token ids")])
def test_bad_bias_is_refused(bias, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(logit_bias=bias)


def test_ids_outside_the_vocabulary_are_refused():
    params = SamplingParams(logit_bias={V: 1.0})
    with pytest.raises(InvalidRequestError, match="not a token id"):
        params.check_logit_bias(V)
    with pytest.raises(ValueError, match="logit_bias"):
        build([params])
