"""Fp8Linear: e4m3 products of a layer's FP8 weight and per-output-channel scales.

A decode step's few rows on the Triton backend take the skinny GEMM over the e4m3 weight
(ops.linear_fp8, kernels/gemv_fp8.py): weight-only, the rows in the model's dtype, the weight read
at one byte an element and widened in registers — the step is bound by those bytes, and
quantizing its rows would cost a kernel launch per linear. The qkv and gate/up layers take the
same kernel with rope / SwiGLU in its epilogue (matmul_rope, matmul_silu_mul), except where the
device's table chose the one-row kernel, which has none (gemv_fp8.w8a16_epilogue_config).

Every other step is W8A8. Where the device's tuned table chose it for the shape and row count
(kernels/gemm_w8a8.py, ops.linear_fp8_w8a8: from 2 to 256 rows, CUDA only), one kernel quantizes
the rows per (row, K group) as it multiplies them: dynamic scales finer than per token, so it
stands in for the dynamic modes ("token", "tensor"), not for a checkpoint's static input_scale.
Where it takes a qkv or gate/up product it takes precedence over the weight-only kernel's rope /
SwiGLU epilogues (the table chose it over the plain weight-only product; under 17 rows the
separate rope and SwiGLU kernels measured no slower than the epilogues for bf16), and the layer
runs those as separate kernels after it. Elsewhere activations are quantized as the checkpoint
says: per token from their own amax (dynamic, the default and what --quantization fp8 uses), per
tensor (dynamic), or with the checkpoint's static input_scale. Then:

- on CUDA (FP8 tensor cores, sm_89+): `torch._scaled_mm` with row-wise scales (cuBLASLt FP8),
  the activation scales [T, 1] and the weight scales [1, N]; it writes bf16, cast to the model's
  dtype;
- elsewhere (CPU, CI): the same arithmetic as a reference, the fp8 values widened to fp32,
  multiplied, and the product scaled by both scales (numerics.scaled_matmul_reference).

Either way the weight's numbers that enter the product are the e4m3 values, so the CPU tests
check the quantization the GPU runs (the interpreter runs the skinny kernel too).
"""

from __future__ import annotations

import torch

from raypaged.kernels import ops

from .base import LinearMethod
from .numerics import FP8_DTYPE, quantize_activation, scaled_matmul_reference

ACTIVATION_MODES = ("token", "tensor", "static")
# FP8 tensor cores: Ada (8.9) and Hopper (9.0) on.
MIN_CAPABILITY = (8, 9)
# cuBLASLt's FP8 GEMM needs K and N to be multiples of 16.
_ALIGNMENT = 16


class Fp8UnsupportedError(ValueError):
    """FP8 cannot run here as asked: a GPU without FP8 tensor cores, or a shape it cannot take."""


def check_device(device: torch.device) -> None:
    """Raise unless `device` runs FP8 GEMMs: CPU runs the reference; CUDA needs sm_89+."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise Fp8UnsupportedError(
            f"FP8 weights need FP8 tensor cores (compute capability >= 8.9, Ada or Hopper); "
            f"{name} has {capability[0]}.{capability[1]}. Load the model unquantized instead."
        )


def check_shape(name: str, out_features: int, in_features: int, device: torch.device) -> None:
    """Raise where cuBLASLt's FP8 GEMM cannot take this rank's weight shape."""
    if device.type == "cuda" and (out_features % _ALIGNMENT or in_features % _ALIGNMENT):
        raise Fp8UnsupportedError(
            f"{name}: FP8 GEMMs need both weight dimensions to be multiples of {_ALIGNMENT}; this "
            f"rank's shard is [{out_features}, {in_features}]"
        )


class Fp8Linear(LinearMethod):
    """The product with an e4m3 weight [N, K]: holds its per-output-channel scales
    `weight_scale` [N] fp32 and, for static activations, `input_scale` [1] fp32."""

    weight_scale: torch.Tensor

    def __init__(self, out_features: int, activation: str = "token",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if activation not in ACTIVATION_MODES:
            raise ValueError(f"activation quantization {activation!r}; expected one of {ACTIVATION_MODES}")
        self.activation = activation
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.input_scale: torch.Tensor | None
        if activation == "static":
            self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_scale = None

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, out_features={self.weight_scale.shape[0]}"

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, K] -> (e4m3 [T, K], scales [T, 1] fp32) as this layer's scheme says."""
        if self.activation == "tensor":  # one amax over the whole step: the torch ops
            return quantize_activation(x, per_token=False)
        return ops.quantize_fp8(x, self.input_scale)

    def fused_w8a8_takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `matmul` runs this product through the fused W8A8 kernel (gemm_w8a8.py)."""
        return self.activation != "static" and ops.fp8_w8a8_takes(x.reshape(-1, x.shape[-1]), weight)

    def matmul_silu_mul(self, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
        if self.fused_w8a8_takes(x, weight):
            return None
        return ops.linear_fp8_silu_mul(x, weight, self.weight_scale, bias)

    def matmul_rope(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                    rotated_features: int) -> torch.Tensor | None:
        if self.fused_w8a8_takes(x, weight):
            return None
        return ops.linear_fp8_rope(x, weight, self.weight_scale, bias, cos, sin, head_dim, rotated_features)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if weight.dtype != FP8_DTYPE:
            raise TypeError(f"Fp8Linear needs an {FP8_DTYPE} weight, got {weight.dtype}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.activation != "static":
            fused = ops.linear_fp8_w8a8(x2, weight, self.weight_scale, bias)
            if fused is not None:
                return fused.reshape(*lead, -1)
        # A decode step's few rows: weight-only, the rows unquantized (the bytes are the weight's).
        skinny = ops.linear_fp8(x2, weight, self.weight_scale, bias)
        if skinny is not None:
            return skinny.reshape(*lead, -1)
        xq, x_scale = self.quantize_input(x2)
        if x.is_cuda:
            out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=self.weight_scale.view(1, -1),
                                   out_dtype=torch.bfloat16)
            if bias is not None:
                out = out + bias
        else:
            out = scaled_matmul_reference(xq, x_scale, weight, self.weight_scale)
            if bias is not None:
                out = out + bias.float()
        return out.to(x.dtype).reshape(*lead, -1)
