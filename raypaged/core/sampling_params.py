"""Per-request generation parameters, named and defaulted as vLLM names them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from raypaged.core.errors import InvalidRequestError
from raypaged.core.structured_output import StructuredOutput
from raypaged.core.text_check import lone_surrogate


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # matched on text by the frontend, not by the engine
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return with each sampled token
    # Constrained decoding: the output must match this (a dict in vLLM's structured_outputs shape
    # is accepted and converted). None: unconstrained, and it costs nothing.
    structured_output: StructuredOutput | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias: each in
    # [-100, 100]); greedy rows take the argmax of the biased logits. A {token id: bias} mapping
    # is accepted and stored as sorted (id, bias) pairs; None: no bias, and it costs nothing.
    # Returned logprobs stay those of the raw model output, as vLLM's.
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] | None = None
    # Logprobs of each prompt token given the ones before it, with this many top alternatives
    # (vLLM's prompt_logprobs, 0..20). A request that asks for them takes no prefix-cache hit:
    # every prompt position has to be computed to be scored.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        if isinstance(self.structured_output, dict):
            object.__setattr__(self, "structured_output", StructuredOutput.from_dict(self.structured_output))
        bias = self.logit_bias
        if bias is not None:
            pairs = bias.items() if isinstance(bias, Mapping) else bias
            try:
                normalized = tuple(sorted((token_id, bias) for token_id, bias in pairs))
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias must map token ids to numbers") from None
            object.__setattr__(self, "logit_bias", normalized or None)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
             f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (not any(isinstance(s, str) and lone_surrogate(s) for s in self.stop),
             "stop strings must be valid text (no lone UTF-16 surrogates)"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be in [0, 20], got {self.logprobs!r}"),
            (self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
             "structured_output must be a StructuredOutput"),
            (self.prompt_logprobs is None
             or (type(self.prompt_logprobs) is int and 0 <= self.prompt_logprobs <= 20),
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        if any(v != v for v in (self.temperature, self.top_p, self.min_p)):  # NaN
            raise InvalidRequestError("sampling parameters must not be NaN")
        for token_id, bias in self.logit_bias_pairs:
            if type(token_id) is not int or token_id < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), "
                                          f"got {token_id!r}")
            number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if not number or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise InvalidRequestError(f"logit_bias[{token_id}] must be a number in [-100, 100], "
                                          f"got {bias!r}")

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """The (token id, bias) pairs, sorted by token id; () without a bias."""
        return cast(tuple[tuple[int, float], ...], self.logit_bias or ())

    def check_logit_bias(self, vocab_size: int) -> None:
        """Every token id logit_bias names lies in the vocabulary (the sampler indexes by them)."""
        bad = [t for t, _ in self.logit_bias_pairs if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias holds token id {bad[0]}, which is not a token id "
                                      f"of this model (0 to {vocab_size - 1})")

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request after it forks: one sample each,
        and a seed of its own so seeded samples differ yet stay reproducible."""
        seed = None if self.seed is None else self.seed * 1_000_003 + index
        return dataclasses.replace(self, n=1, seed=seed)
