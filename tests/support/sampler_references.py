"""What the sampler's tests check it against: SamplingMetadata built from a batch's params (and
prompts, outputs), and one row's logits through transformers' own processors, chained in the
sampler's (vLLM's) order."""

from __future__ import annotations

from collections import Counter

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from raypaged.core.sampling_params import SamplingParams
from raypaged.worker.sampling_metadata import SamplingMetadata


def build(params, prompts=None, outputs=None, vocab_size=None, sample_indices=None, logits=None):
    """The batch's SamplingMetadata; prompts default to [0] a row, outputs to none, the vocabulary
    to the logits' width."""
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
