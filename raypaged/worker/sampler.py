"""The batched sampler: one step's logits [S, V] -> one token per row (+ logprobs), on device.

Order of operations, as in vLLM v1:
  1. logprobs of the RAW model output (log_softmax before logit_bias, penalties or temperature),
     which is what vLLM v1 returns by default (logprobs_mode="raw_logprobs");
  2. float32; logit_bias (a sparse add over the rows that have one; skipped when none does);
     penalties: repetition (prompt + output tokens: positive logits divided, negative
     multiplied), then frequency and presence (output tokens only, OpenAI semantics);
  3. greedy rows (temperature < 1e-5): argmax of those logits — the raw logits' argmax when no
     penalty applies, so greedy output is token-identical to transformers;
  4. random rows: temperature, then min-p, then top-k, then top-p (vLLM's order; transformers
     applies min-p last, which differs only when top-p and min-p are combined), then one draw
     by the exponential race: argmax(p / E) with E ~ Exp(1) per token is an exact sample of p.

Randomness: a seeded row draws its E from its own generator (seeded from (seed, position) by
SamplingMetadata), so it is reproducible whatever else is in the batch; unseeded rows share the
Sampler's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from raypaged.core.outputs import Logprobs
from raypaged.worker.sampling_metadata import SamplingMetadata

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "processed_logits", "apply_penalties",
           "apply_sampling_filters", "apply_logit_bias", "apply_min_p", "apply_top_k_top_p", "compute_logprobs_outputs"]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [S] int64
    # [S, k+1]: the sampled token's logprob, then the top-k (k = max asked in the batch).
    logprobs: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None  # [S, k+1] int64, same layout
    sampled_token_ranks: torch.Tensor | None = None  # [S] int64, 1 = most likely token
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, as asked

    def logprobs_as_dicts(self) -> list[Logprobs | None]:
        """Per row on host: {sampled token: logprob, top-1: logprob, …, top-k: logprob} with
        that row's own k, or None where the row did not ask. Two device->host copies in all."""
        if self.logprobs is None or self.logprob_token_ids is None:
            return [None] * len(self.num_logprobs)
        values = self.logprobs.tolist()
        token_ids = self.logprob_token_ids.tolist()
        rows: list[Logprobs | None] = []
        for k, row_values, row_ids in zip(self.num_logprobs, values, token_ids):
            # The sampled token comes first; if it is also in the top-k the dict keeps one entry.
            rows.append(None if k is None else dict(zip(row_ids[: k + 1], row_values[: k + 1])))
        return rows


class Sampler(nn.Module):
    def __init__(self, seed: int | None = None) -> None:
        """`seed` fixes the generator that unseeded rows share (tests, reproducible runs);
        None seeds it from the OS."""
        super().__init__()
        self.seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        _check_logits(logits, metadata)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        logits = apply_logit_bias(logits, metadata)

        if metadata.all_greedy and not metadata.has_penalties:
            sampled = logits.argmax(dim=-1)  # the fast path: one kernel, no float32 copy
        else:
            logits = apply_penalties(logits.float(), metadata)
            greedy = None if metadata.all_random else logits.argmax(dim=-1)
            if metadata.all_greedy:
                sampled = cast(torch.Tensor, greedy)  # all greedy, so not all random
            else:
                sampled = self._draw(apply_sampling_filters(logits, metadata), metadata)
                if greedy is not None:  # greedy and random rows: the mask tells them apart
                    sampled = torch.where(cast(torch.Tensor, metadata.greedy_mask), greedy, sampled)

        output = SamplerOutput(sampled_token_ids=sampled, num_logprobs=metadata.num_logprobs)
        if raw_logprobs is not None:
            output.logprobs, output.logprob_token_ids, output.sampled_token_ranks = \
                compute_logprobs_outputs(raw_logprobs, sampled, cast(int, metadata.max_num_logprobs))
        return output

    def _draw(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        noise = torch.empty_like(logits)
        if len(metadata.generators) < metadata.num_rows:
            noise.exponential_(generator=self._shared_generator(logits.device))
        for row, generator in metadata.generators.items():
            noise[row].exponential_(generator=generator)
        # argmax p/E == argmax (logit - log E): no softmax needed, and filtered (-inf) tokens
        # can never win. E is clamped away from 0, which exponential_ may return.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_()
        return (logits - noise).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._shared_generators[device] = generator
        return generator


def processed_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The float32 logits the random rows draw from: penalties, temperature, min-p, top-k,
    top-p, filtered tokens at -inf (greedy rows: penalized only). A new tensor; `logits` is not
    modified. The Sampler computes exactly this; it is exposed for tests and debugging."""
    _check_logits(logits, metadata)
    logits = apply_penalties(apply_logit_bias(logits, metadata).float(), metadata)
    return logits.clone() if metadata.all_greedy else apply_sampling_filters(logits, metadata)


def apply_sampling_filters(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, for a batch with at least one random row. Returns a
    new tensor (the temperature division makes it; the filters then work in place on it)."""
    logits = logits / cast(torch.Tensor, metadata.temperature).unsqueeze(1)  # set: a random row
    if metadata.min_p is not None:
        apply_min_p(logits, metadata.min_p)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
    return logits


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """A new float32 tensor with each row's logit_bias added (one index_add over the batch's
    (row, token) pairs), or `logits` itself when no row has a bias. A token the grammar mask
    ruled out (-inf) stays out: a finite bias cannot bring it back."""
    if metadata.logit_bias_index is None:
        return logits
    flat = logits.float().reshape(-1)
    return flat.index_add(0, metadata.logit_bias_index,
                          cast(torch.Tensor, metadata.logit_bias_values)).view(logits.shape)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency and presence penalties. Returns a new tensor when any row
    asks for a penalty, else `logits` itself."""
    if not metadata.has_penalties:
        return logits
    # has_penalties: the penalty tensors and the output counts are all set.
    counts = cast(torch.Tensor, metadata.output_token_counts)
    if metadata.prompt_token_mask is not None:
        seen = metadata.prompt_token_mask | (counts > 0)
        penalty = cast(torch.Tensor, metadata.repetition_penalty).unsqueeze(1)
        # Dividing a positive logit and multiplying a negative one both make the token less
        # likely; rows with penalty 1.0 come through bit-identical.
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits - cast(torch.Tensor, metadata.frequency_penalty).unsqueeze(1) * counts
    return logits - cast(torch.Tensor, metadata.presence_penalty).unsqueeze(1) * (counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: filter tokens whose probability is below min_p times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


# Top-p first looks for each row's nucleus among its TOP_P_CANDIDATES most likely tokens: a
# radix top-k costs a fraction of a full sort of a 128k vocabulary, and a trained model's
# nucleus almost always fits; rows whose nucleus does not fit are then sorted in full. Measured
# on an H200 (V = 128256, top_p = 0.9): batch 128, nucleus fits: 0.66 ms vs 2.48 ms for a full
# sort; every row spills: 2.8 ms. At batch 1 the extra launches and the sync lose (0.46 vs
# 0.28 ms), hence the full sort below TOP_P_CANDIDATES_MIN_ROWS rows.
TOP_P_CANDIDATES = 4096
TOP_P_CANDIDATES_MIN_ROWS = 32


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None, candidates: int | None = None) -> torch.Tensor:
    """In place: filter to the top-k tokens, then to the nucleus: the most likely tokens up to
    and including the one at which their probability (renormalized after top-k) reaches top_p.

    Both filters are thresholds, so every token tied with the last one kept is kept too — as
    transformers and vLLM do for top-k; for top-p they break such ties by sort order, which
    differs only when a tie straddles the nucleus boundary. Rows with k = V and p = 1 are
    untouched. `candidates` overrides the size of the prefix top-p searches first (None:
    chosen by batch size, see TOP_P_CANDIDATES)."""
    num_rows, vocab_size = logits.shape
    neg_inf = float("-inf")
    if top_p is None:
        width = max_top_k
    elif candidates is None:
        width = max(max_top_k, TOP_P_CANDIDATES) if num_rows >= TOP_P_CANDIDATES_MIN_ROWS else vocab_size
    else:
        width = max(max_top_k, candidates)
    width = min(width, vocab_size)
    if width < vocab_size:
        largest, largest_ids = torch.topk(logits, width, dim=-1)
    else:
        largest, largest_ids = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = largest.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), neg_inf)
        logits.masked_fill_(logits < kth, neg_inf)
    if top_p is None:
        return logits

    # Probabilities over the whole (top-k filtered) row, so the candidates see the true mass;
    # the candidates' ids give them in descending order without another sort.
    probs = logits.softmax(dim=-1)
    threshold, complete = _nucleus_threshold(probs.gather(1, largest_ids), top_p)
    if width < vocab_size:
        # One sync, and a full sort only of the rows whose nucleus runs past the candidates.
        spill = (~complete & (top_p < 1.0)).nonzero().flatten()
        if spill.numel():
            full = probs.index_select(0, spill).sort(dim=-1, descending=True).values
            threshold.index_copy_(0, spill, _nucleus_threshold(full, top_p.index_select(0, spill))[0])
    # p = 1 rows keep everything, even tokens whose probability underflows to 0.
    threshold.masked_fill_((top_p >= 1.0).unsqueeze(1), -1.0)
    return logits.masked_fill_(probs < threshold, neg_inf)


def _nucleus_threshold(descending: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For probabilities sorted in descending order (a prefix of each row, or all of it): the
    probability of the last token in the nucleus [S, 1], and whether the nucleus ended inside
    the prefix [S]. A token is in the nucleus iff the mass strictly before it is below top_p,
    so the most likely token always is."""
    mass_before = descending.cumsum(dim=-1) - descending
    # At least one: a top_p too small for float32 (e.g. 1e-50) reaches the device as 0.
    count = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    complete = count.squeeze(1) < descending.shape[-1]
    return descending.gather(1, count - 1), complete


def compute_logprobs_outputs(logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int):
    """([S, k+1] logprobs, [S, k+1] token ids, [S] ranks): the sampled token first, then the
    top-k. Rank = 1 + the number of tokens strictly more likely than the sampled one."""
    sampled = sampled.unsqueeze(1)
    sampled_logprob = logprobs.gather(1, sampled)
    ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
    top_values, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
    return (torch.cat([sampled_logprob, top_values], dim=1),
            torch.cat([sampled, top_ids], dim=1), ranks)


def _check_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    expected = (metadata.num_rows, metadata.vocab_size)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point tensor")
    if tuple(logits.shape) != expected:
        raise ValueError(f"logits have shape {tuple(logits.shape)}, metadata expects {expected}")
    if logits.device.type != metadata.device.type:
        raise ValueError(f"logits are on {logits.device}, metadata on {metadata.device}")
