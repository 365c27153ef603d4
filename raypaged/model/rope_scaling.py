"""Rope frequency scalings for long context: yarn, dynamic NTK and longrope (Phi-3's "su").

Each is parsed from config.json's rope_scaling / rope_parameters and computes its inverse
frequencies in fp32 exactly as transformers' ROPE_INIT_FUNCTIONS do (same operations in the same
order, so the tables are bit-identical), plus the attention factor transformers multiplies cos
and sin by.

What a paged engine can and cannot reproduce of transformers' sequence-length-dependent ropes:

- dynamic: transformers recomputes the frequencies from the longest position of each forward
  once it passes max_position_embeddings; the keys already cached keep the rotation of the step
  that wrote them, so the result depends on how the sequence was split into forwards (chunked
  prefill, prefix caching and preemption all change that). Up to max_position_embeddings its
  frequencies are the unscaled ones, so raypaged serves dynamic there, exactly, and refuses a
  longer max_model_len (`max_model_len`).
- longrope: transformers uses the short factors while a sequence is at most
  original_max_position_embeddings long and, when it grows past it, drops its KV cache and
  recomputes the whole sequence with the long factors. A paged engine cannot rotate cached keys
  again, so, like vLLM, the choice is made once per engine (`served_at`): the short factors when
  max_model_len <= original_max_position_embeddings (then identical to transformers for every
  sequence), the long ones otherwise (identical for every token generated from a context longer
  than original_max_position_embeddings; shorter contexts use the long factors where
  transformers uses the short ones).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

SCALED_ROPE_TYPES = ("yarn", "dynamic", "longrope")


class ScaledRope(ABC):
    """A rope scaling whose frequencies need more than the base rope's parameters."""

    attention_factor: float  # cos and sin are multiplied by it (transformers' attention_scaling)

    @abstractmethod
    def inverse_frequencies(self, theta: float, dim: int) -> torch.Tensor:
        """[dim / 2] fp32 inverse frequencies for a rotary dimension of `dim`."""

    def max_model_len(self, max_position_embeddings: int) -> int:
        """The longest sequence this scaling serves."""
        return max_position_embeddings

    def served_at(self, max_model_len: int) -> ScaledRope:
        """This scaling as an engine serving sequences up to max_model_len computes it."""
        return self


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


@dataclass(frozen=True)
class YarnRope(ScaledRope):
    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def inverse_frequencies(self, theta: float, dim: int) -> torch.Tensor:
        # Frequencies that turn fewer than beta_slow times over the original context are
        # interpolated (divided by factor), those turning more than beta_fast times are kept,
        # and the band between ramps linearly from one to the other.
        def correction_dim(rotations: float) -> float:
            context = self.original_max_position_embeddings
            return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        pos_freqs = theta ** _exponents(dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        return interpolation * (1 - keep) + extrapolation * keep

    def max_model_len(self, max_position_embeddings: int) -> int:
        # As vLLM: the original context stretched by the factor, or the configured one if longer.
        return max(max_position_embeddings,
                   int(self.original_max_position_embeddings * self.factor))


@dataclass(frozen=True)
class DynamicNTKRope(ScaledRope):
    factor: float
    max_position_embeddings: int
    attention_factor: float = 1.0

    def inverse_frequencies(self, theta: float, dim: int) -> torch.Tensor:
        # transformers' formula at a sequence length of max_position_embeddings (the only length
        # served, see the module docstring): the base is scaled by exactly 1 up to rounding,
        # which is reproduced by computing it the same way.
        length = self.max_position_embeddings
        scale = (self.factor * length / self.max_position_embeddings) - (self.factor - 1)
        base = theta * scale ** (dim / (dim - 2))
        return 1.0 / (base ** _exponents(dim))


@dataclass(frozen=True)
class LongRope(ScaledRope):
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    use_long: bool = False  # set by served_at

    def inverse_frequencies(self, theta: float, dim: int) -> torch.Tensor:
        factors = self.long_factor if self.use_long else self.short_factor
        if len(factors) != dim // 2:
            raise ValueError(f"longrope factors have {len(factors)} entries, expected {dim // 2}")
        ext_factors = torch.tensor(factors, dtype=torch.float32)
        return 1.0 / (ext_factors * theta ** _exponents(dim))

    def served_at(self, max_model_len: int) -> ScaledRope:
        return dataclasses.replace(
            self, use_long=max_model_len > self.original_max_position_embeddings
        )


def parse_scaled_rope(
    rope_type: str, params: dict[str, Any], raw: dict[str, Any], max_pos: int, rotary_dim: int
) -> ScaledRope:
    """The scaling of `rope_type` from its parameters (config.json's rope dict `params`, the whole
    config `raw`), with transformers' defaults. Raises KeyError for a missing parameter and
    ValueError for a bad one."""
    # Phi-3 keeps the pretraining context at the top level, and transformers prefers it there.
    original = int(raw.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings") or max_pos)
    if rope_type == "dynamic":
        return DynamicNTKRope(factor=float(params["factor"]), max_position_embeddings=max_pos)
    if rope_type == "yarn":
        factor = params.get("factor")
        factor = max_pos / original if factor is None else float(factor)
        return YarnRope(
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=_yarn_attention_factor(params, factor),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
        )
    if rope_type == "longrope":
        short, long = (tuple(float(x) for x in params[k]) for k in ("short_factor", "long_factor"))
        for name, factors in (("short_factor", short), ("long_factor", long)):
            if len(factors) != rotary_dim // 2:
                raise ValueError(
                    f"{name} has {len(factors)} entries, expected rotary dim / 2 = {rotary_dim // 2}"
                )
        return LongRope(short, long, original, _longrope_attention_factor(params, max_pos, original))
    raise ValueError(f"not a scaled rope type: {rope_type!r}")


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _longrope_attention_factor(params: dict[str, Any], max_pos: int, original: int) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor")
    factor = max_pos / original if factor is None else float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
