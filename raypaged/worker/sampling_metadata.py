"""SamplingMetadata: one step's sampling parameters as device tensors, one row per logits row.

The ModelRunner builds it once per step from the rows it samples; the Sampler only reads it.
Everything optional is left as None when no row of the step needs it, so a plain greedy or
plain temperature batch pays for nothing it does not use: no sort, no penalty token tensors.

Seeded rows get a torch.Generator of their own, seeded from (seed, number of output tokens so
far). A row's randomness is therefore a function of its request alone — not of the batch it
lands in, its row index, or whether the request was preempted and recomputed in between.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from raypaged.core.sampling_params import SamplingParams

# Temperatures below this sample greedily, as in vLLM: dividing logits by them overflows float32.
SAMPLING_EPS = 1e-5

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # A full-avalanche 64-bit mixer: neighbouring (seed, position) pairs get unrelated streams.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_generator_seed(seed: int, position: int) -> int:
    """The torch.Generator seed of a seeded row: a hash of the request's seed and the index of
    the token being sampled (its number of output tokens so far)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def effective_seed(params: SamplingParams, sample_index: int) -> int | None:
    """The seed that drives sample `sample_index` of a request.

    Rows of an n > 1 request that has not forked yet use the seed each sample will carry after
    the fork (SamplingParams.for_sample), so one sample's stream depends only on its own seed
    and position whether it is drawn before or after the fork.
    """
    if params.seed is None:
        return None
    return params.seed if params.n == 1 else params.for_sample(sample_index).seed


def _needs_repetition(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0


def needs_token_history(p: SamplingParams) -> bool:
    return _needs_repetition(p) or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    all_random: bool
    # [S] bool, True on greedy rows; None when the batch is all greedy or all random.
    greedy_mask: torch.Tensor | None = None
    # [S] float32, 1.0 on greedy rows so the division is harmless; None when all greedy.
    temperature: torch.Tensor | None = None
    # [S] int64 in [1, V]; V means "off". None when no random row uses top-k.
    top_k: torch.Tensor | None = None
    max_top_k: int = 0  # largest top-k in use, known on host so no device sync is needed
    top_p: torch.Tensor | None = None  # [S] float32 in (0, 1]; 1.0 means "off"
    min_p: torch.Tensor | None = None  # [S] float32 in [0, 1]; 0.0 means "off"
    repetition_penalty: torch.Tensor | None = None  # [S] float32; 1.0 means "off"
    frequency_penalty: torch.Tensor | None = None  # [S] float32; 0.0 means "off"
    presence_penalty: torch.Tensor | None = None  # [S] float32; 0.0 means "off"
    prompt_token_mask: torch.Tensor | None = None  # [S, V] bool, only with repetition penalty
    output_token_counts: torch.Tensor | None = None  # [S, V] int32, only with any penalty
    # Seeded random rows: row index -> generator seeded from (seed, position).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, as asked
    max_num_logprobs: int | None = None
    # logit_bias, sparse: flat indices row * V + token id [B] int64 and the biases [B] float32,
    # over the rows that have one. None when no row does: the sampler then launches nothing.
    logit_bias_index: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        sample_indices: Sequence[int] | None = None,
        num_output_tokens: Sequence[int] | None = None,
    ) -> SamplingMetadata:
        """One row per logits row. `sample_indices[i]` (default 0) is which sample of an n > 1
        request row i draws, when the runner repeats a request's row n times for its first
        token; it must lie in [0, params[i].n). Token lists are read only for rows that ask for
        a penalty (others may pass empty ones); `num_output_tokens` (default: the lengths of
        output_token_ids) positions each seeded row's randomness."""
        num_rows = len(params)
        if sample_indices is None:
            sample_indices = [0] * num_rows
        _validate(params, prompt_token_ids, output_token_ids, vocab_size, sample_indices)
        device = torch.device(device)

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        md = cls(num_rows=num_rows, vocab_size=vocab_size, device=device,
                 all_greedy=all_greedy, all_random=all_random)

        logprob_rows = [p.logprobs for p in params]
        md.num_logprobs = logprob_rows
        asked = [k for k in logprob_rows if k is not None]
        md.max_num_logprobs = max(asked) if asked else None

        # Host columns, copied to the device in one transfer below.
        columns: dict[str, list[float]] = {}
        if not all_greedy:
            random_rows = [p for p, g in zip(params, greedy) if not g]
            columns["temperature"] = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
            top_ks = [_effective_top_k(p, vocab_size) if not g else vocab_size
                      for p, g in zip(params, greedy)]
            if any(k < vocab_size for k in top_ks):
                columns["top_k"] = [float(k) for k in top_ks]
                md.max_top_k = max(k for k in top_ks if k < vocab_size)
            if any(p.top_p < 1.0 for p in random_rows):
                columns["top_p"] = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
            if any(p.min_p > 0.0 for p in random_rows):
                columns["min_p"] = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
            if not all_random:
                columns["greedy_mask"] = [float(g) for g in greedy]
        # Penalties change the logits greedy rows take the argmax of, so they apply to all rows.
        if any(needs_token_history(p) for p in params):
            columns["repetition_penalty"] = [p.repetition_penalty for p in params]
            columns["frequency_penalty"] = [p.frequency_penalty for p in params]
            columns["presence_penalty"] = [p.presence_penalty for p in params]
        md._set_columns(columns)

        if md.has_penalties:
            # Only rows that ask for a penalty contribute tokens: the others' lists stay empty
            # so a long prompt without penalties costs nothing here.
            md.output_token_counts = _token_counts(
                [o if needs_token_history(p) else () for p, o in zip(params, output_token_ids)],
                vocab_size, device, "output_token_ids")
            if any(_needs_repetition(p) for p in params):
                md.prompt_token_mask = _token_mask(
                    [t if _needs_repetition(p) else () for p, t in zip(params, prompt_token_ids)],
                    vocab_size, device, "prompt_token_ids")

        if any(p.logit_bias is not None for p in params):
            md._set_logit_bias(params)

        if num_output_tokens is None:
            num_output_tokens = [len(o) for o in output_token_ids]
        for row, (p, g, index, num_outputs) in enumerate(zip(params, greedy, sample_indices, num_output_tokens)):
            seed = effective_seed(p, index)
            if g or seed is None:
                continue
            generator = torch.Generator(device=device)
            generator.manual_seed(row_generator_seed(seed, num_outputs))
            md.generators[row] = generator
        return md

    def _set_logit_bias(self, params: Sequence[SamplingParams]) -> None:
        pairs = [p.logit_bias_pairs for p in params]
        self.logit_bias_index = _flat_token_indices([[t for t, _ in row] for row in pairs],
                                                    self.vocab_size, self.device, "logit_bias")
        values = torch.tensor([b for row in pairs for _, b in row], dtype=torch.float32)
        if self.device.type == "cuda":
            values = values.pin_memory()
        self.logit_bias_values = values.to(self.device, non_blocking=True)

    def _set_columns(self, columns: dict[str, list[float]]) -> None:
        if not columns:
            return
        host = torch.tensor(list(columns.values()), dtype=torch.float32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        on_device = host.to(self.device, non_blocking=True)
        for i, name in enumerate(columns):
            value = on_device[i]
            if name == "top_k":
                value = value.to(torch.int64)  # exact: vocabularies are far below 2**24
            elif name == "greedy_mask":
                value = value.bool()
            setattr(self, name, value)


def _effective_top_k(p: SamplingParams, vocab_size: int) -> int:
    # -1 and 0 mean "off"; a k at or past the vocabulary keeps everything, i.e. also off.
    return vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size)


def _flat_token_indices(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
                        name: str) -> torch.Tensor:
    """Every (row, token id) pair as one flat index row * V + id into an [S, V] tensor, on the
    device. The ids cross as one packed int64 buffer (array('q') packs a list of ints far faster
    than torch.tensor on nested lists) and are range-checked, vectorized, on the host copy."""
    try:
        packed = array.array("q", itertools.chain.from_iterable(rows))
    except (TypeError, OverflowError) as e:
        raise ValueError(f"{name} must hold integer token ids: {e}") from None
    flat = torch.frombuffer(packed, dtype=torch.int64) if packed else torch.zeros(0, dtype=torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        bad_row = next(i for i, r in enumerate(rows)
                       if min(r, default=0) < 0 or max(r, default=0) >= vocab_size)
        raise ValueError(f"{name}[{bad_row}] holds a token id outside [0, {vocab_size})")
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    row_starts = torch.arange(len(rows), device=device, dtype=torch.int64) * vocab_size
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64).to(device, non_blocking=True)
    # output_size is known on host, so repeat_interleave needs no device sync.
    return torch.repeat_interleave(row_starts, lengths, output_size=flat.numel()) + flat


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
                  name: str) -> torch.Tensor:
    """[S, V] int32: how often each token occurs in each row."""
    index = _flat_token_indices(rows, vocab_size, device, name)
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
    counts.view(-1).scatter_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    return counts


def _token_mask(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
                name: str) -> torch.Tensor:
    """[S, V] bool: whether each token occurs in each row."""
    index = _flat_token_indices(rows, vocab_size, device, name)
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    mask.view(-1).index_fill_(0, index, True)
    return mask


def _validate(params, prompt_token_ids, output_token_ids, vocab_size, sample_indices) -> None:
    num_rows = len(params)
    if num_rows == 0:
        raise ValueError("SamplingMetadata.build needs at least one row")
    lengths = {"prompt_token_ids": len(prompt_token_ids), "output_token_ids": len(output_token_ids),
               "sample_indices": len(sample_indices)}
    for name, length in lengths.items():
        if length != num_rows:
            raise ValueError(f"{name} has {length} rows but params has {num_rows}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    for row, (p, index) in enumerate(zip(params, sample_indices)):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{row}] is {type(p).__name__}, not SamplingParams")
        if not isinstance(index, int) or not 0 <= index < p.n:
            raise ValueError(f"sample_indices[{row}] = {index!r} is outside [0, n={p.n})")
