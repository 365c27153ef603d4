"""The precisions a benchmark runs an engine at, by the name its command line uses: what each one
sets (activations' dtype, FP8 weights, the KV pool's dtype).

    bf16         the unquantized model in bfloat16: weights, activations and KV cache
    fp32         the same in float32 (the CPU runs' default)
    fp8          FP8 (e4m3) weights quantized at load, per output channel, and an FP8 KV cache;
                 activations bf16 (what the issue 22 target compares against bf16)
    fp8-weights  FP8 weights only, KV cache bf16
    fp8-kv       FP8 KV cache only, weights bf16

The FP8 variants run on CPU too: there the weights and the pool hold e4m3 values that the torch
references widen before they compute (the arithmetic of the GPU path, not its speed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raypaged.config.sections import kv_cache_value_bytes


@dataclass(frozen=True)
class Precision:
    """One precision's engine settings. `dtype` is the activations' and every unquantized weight's."""

    name: str
    dtype: str
    quantization: str | None = None
    kv_cache_dtype: str = "auto"

    @property
    def quantized(self) -> bool:
        """Whether anything is stored below the model's dtype (weights or KV)."""
        return self.quantization is not None or self.kv_cache_dtype != "auto"

    def engine_settings(self) -> dict[str, str | None]:
        """The LLM / EngineConfig keyword arguments of this precision."""
        return {"dtype": self.dtype, "quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype}

    def kv_blocks_in_memory_of(self, blocks: int) -> int:
        """How many of this precision's KV blocks fit in the memory of `blocks` blocks of its model
        dtype: the same number unless the pool holds one byte a value (then proportionally more),
        so that on CPU, where no profiler sizes the pool, each precision gets the same memory."""
        value_bytes = torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        return blocks * value_bytes // kv_cache_value_bytes(self.kv_cache_dtype, value_bytes)


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("bf16", "bfloat16"),
    Precision("fp32", "float32"),
    Precision("fp8", "bfloat16", quantization="fp8", kv_cache_dtype="fp8"),
    Precision("fp8-weights", "bfloat16", quantization="fp8"),
    Precision("fp8-kv", "bfloat16", kv_cache_dtype="fp8"),
)}


def parse_precisions(text: str) -> list[Precision]:
    """A comma list of precision names, in the order given (the order they run in). Raises
    ValueError for an unknown or repeated name, or an empty list."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRECISIONS]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"precisions {text!r}: a comma list of distinct names from {', '.join(PRECISIONS)}")
    return [PRECISIONS[n] for n in names]


def baseline_of(precisions: list[Precision]) -> Precision | None:
    """The precision the others are compared with: the first unquantized one in the list (so a run
    may start with fp8 and still report fp8 over bf16), or None when every one is quantized."""
    return next((p for p in precisions if not p.quantized), None)
