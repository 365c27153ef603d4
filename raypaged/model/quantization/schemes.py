"""Which FP8 scheme a model is served with: asked for (--quantization fp8) or read from the
checkpoint's own quantization config.

Understood:
- no quantization config and quantization "fp8": quantize the float checkpoint at load, e4m3
  weights with per-output-channel scales, activations per token;
- compressed-tensors (config.json `quantization_config.quant_method == "compressed-tensors"`),
  format float-quantized, FP8 weights per channel or per tensor, activations per token (dynamic),
  per tensor (dynamic) or static with `input_scale`; parsed and validated by compressed-tensors'
  own QuantizationConfig, its targets / ignore lists matched by its own `is_match`;
- NVIDIA ModelOpt (`hf_quant_config.json`, or `quantization_config.quant_method == "modelopt"`):
  quant_algo FP8 (per-tensor weight_scale, static input_scale).

Anything else quantized (int8, int4/w4a16, block-wise FP8, NVFP4, GPTQ/AWQ, FP8 weights without
activation quantization) is a `QuantizationError` at load, never a silent bf16 model.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raypaged.config.base import ConfigError

from ..config import ModelConfig

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)  # what --quantization may ask for
MODELOPT_CONFIG = "hf_quant_config.json"


class QuantizationError(ConfigError):
    """The quantization asked for, or the checkpoint's, cannot be served."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers are held and multiplied in FP8.

    from_checkpoint: the checkpoint stores e4m3 weights and their scales (else quantize at load).
    weight_strategy: "channel" (one scale per output row) or "tensor" (one per checkpoint tensor).
    activation: "token" / "tensor" (dynamic) or "static" (the checkpoint's input_scale).
    """

    source: str  # "at-load", "compressed-tensors", "modelopt"
    from_checkpoint: bool
    weight_strategy: str = "channel"
    activation: str = "token"
    # checkpoint module name (e.g. "model.layers.0.mlp.down_proj") -> whether it is quantized
    quantizes: Callable[[str], bool] = field(default=lambda name: True, compare=False, repr=False)

    @property
    def static_input_scale(self) -> bool:
        return self.activation == "static"

    def for_dummy_weights(self) -> Fp8Scheme:
        """Random weights are generated in float: they are quantized at load, whatever the
        checkpoint stores, with activations per token (there is no input_scale to read)."""
        return Fp8Scheme("at-load", False, "channel", "token", self.quantizes)


def resolve_quantization(requested: str | None, config: ModelConfig) -> Fp8Scheme | None:
    """The scheme to serve `config`'s model with, or None for an unquantized model.

    `requested`: the --quantization setting (None: whatever the checkpoint is). A checkpoint
    that is quantized is served as it is stored; asking for fp8 on an FP8 checkpoint is the same.
    """
    if requested is not None and requested not in QUANTIZATIONS:
        raise QuantizationError(f"unknown quantization {requested!r}; raypaged has {', '.join(QUANTIZATIONS)}")
    raw = _checkpoint_quantization(config)
    if raw is None:
        if requested == "fp8":
            return Fp8Scheme("at-load", from_checkpoint=False)
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "modelopt" or "quant_algo" in raw or "quantization" in raw:
        return _modelopt(raw)
    raise QuantizationError(
        f"the checkpoint is quantized with quant_method {method or '(none)'!r}, which raypaged "
        "cannot read: it serves float checkpoints (optionally quantized at load with "
        "--quantization fp8), compressed-tensors FP8 and ModelOpt FP8"
    )


def _checkpoint_quantization(config: ModelConfig) -> dict[str, Any] | None:
    if config.quantization_config is not None:
        return dict(config.quantization_config)
    if config.model_dir is not None:
        path = Path(config.model_dir) / MODELOPT_CONFIG
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise QuantizationError(f"{path} is not valid JSON: {e}") from e
            return {"quant_method": "modelopt", **raw}
    return None


# -- compressed-tensors ------------------------------------------------------------------------


def _compressed_tensors(raw: dict[str, Any]) -> Fp8Scheme:
    import torch
    try:
        from compressed_tensors.quantization import QuantizationConfig
        from compressed_tensors.utils.match import is_match
    except ImportError as e:
        raise QuantizationError(
            "this is a compressed-tensors checkpoint: install compressed-tensors (pip install "
            "'raypaged[fp8]') to read its quantization_config"
        ) from e
    from pydantic import ValidationError

    try:
        parsed = QuantizationConfig.model_validate(raw)
    except ValidationError as e:
        raise QuantizationError(f"the checkpoint's compressed-tensors quantization_config is invalid: {e}") from e
    if parsed.kv_cache_scheme is not None:
        logger.warning("the checkpoint has a kv_cache_scheme: its k/v scales are used with "
                       "--kv-cache-dtype fp8; without it the KV cache stays in the model's dtype")
    if not parsed.config_groups:
        raise QuantizationError("the compressed-tensors quantization_config has no config_groups")
    schemes = {}
    for group_name, scheme in parsed.config_groups.items():
        fmt = scheme.format or parsed.format
        if fmt != "float-quantized":
            raise QuantizationError(
                f"compressed-tensors group {group_name!r} has format {fmt!r}: raypaged reads "
                "float-quantized (FP8) checkpoints only"
            )
        schemes[group_name] = _ct_fp8_modes(group_name, scheme)
    if len(set(schemes.values())) > 1:
        raise QuantizationError(f"compressed-tensors groups with different FP8 schemes are not supported: {schemes}")
    weight_strategy, activation = next(iter(schemes.values()))
    targets = [t for scheme in parsed.config_groups.values() for t in scheme.targets]
    ignore = list(parsed.ignore or [])
    linear = torch.nn.Linear(1, 1, device="meta")  # what each projection is in the HF model

    def quantizes(name: str) -> bool:
        return is_match(name, linear, targets, ignore)

    return Fp8Scheme("compressed-tensors", True, weight_strategy, activation, quantizes)


def _ct_fp8_modes(group_name: str, scheme: Any) -> tuple[str, str]:
    """(weight strategy, activation mode) of one compressed-tensors scheme, if it is FP8 W8A8."""
    weights, inputs = scheme.weights, scheme.input_activations
    what = f"compressed-tensors group {group_name!r}"
    if weights is None or weights.num_bits != 8 or str(weights.type) != "float":
        raise QuantizationError(f"{what} quantizes weights as {_describe(weights)}: raypaged reads FP8 (8-bit float)")
    if not weights.symmetric or weights.dynamic:
        raise QuantizationError(f"{what}: FP8 weights must be symmetric and static")
    if str(weights.strategy) not in ("channel", "tensor"):
        raise QuantizationError(
            f"{what}: FP8 weight strategy {str(weights.strategy)!r} is not supported (channel or tensor)"
        )
    if scheme.output_activations is not None:
        raise QuantizationError(f"{what}: output activation quantization is not supported")
    if inputs is None:
        raise QuantizationError(
            f"{what} is FP8 weight-only (no input_activations): raypaged runs FP8 as W8A8 only"
        )
    if inputs.num_bits != 8 or str(inputs.type) != "float" or not inputs.symmetric:
        raise QuantizationError(f"{what} quantizes activations as {_describe(inputs)}: raypaged runs FP8 W8A8")
    strategy = str(inputs.strategy)
    if strategy == "token" and inputs.dynamic is True:
        return str(weights.strategy), "token"
    if strategy == "tensor":
        return str(weights.strategy), "tensor" if inputs.dynamic is True else "static"
    raise QuantizationError(
        f"{what}: activation strategy {strategy!r} (dynamic={inputs.dynamic}) is not supported "
        "(token-dynamic, tensor-dynamic or tensor-static)"
    )


def _describe(args: Any) -> str:
    return "nothing" if args is None else f"{args.num_bits}-bit {args.type} ({args.strategy})"


# -- ModelOpt ----------------------------------------------------------------------------------

_MODELOPT_ALGOS = {"FP8": ("tensor", "static")}


def _modelopt(raw: dict[str, Any]) -> Fp8Scheme:
    nested = raw.get("quantization")
    section: dict[str, Any] = nested if isinstance(nested, dict) else raw
    algo = str(section.get("quant_algo") or "").upper()
    if algo not in _MODELOPT_ALGOS:
        raise QuantizationError(
            f"ModelOpt quant_algo {algo or '(none)'!r} is not supported: raypaged reads "
            f"{', '.join(_MODELOPT_ALGOS)}"
        )
    if section.get("kv_cache_quant_algo"):
        logger.warning("the checkpoint's kv_cache_quant_algo is not used: the KV cache stays in the model's dtype")
    excluded = [str(p) for p in section.get("exclude_modules") or section.get("ignore") or []]

    def quantizes(name: str) -> bool:
        # ModelOpt's patterns are shell wildcards over module names ("lm_head", "*mlp.gate*").
        return not any(fnmatch.fnmatchcase(name, p) or name.endswith(f".{p}") for p in excluded)

    weight_strategy, activation = _MODELOPT_ALGOS[algo]
    return Fp8Scheme("modelopt", True, weight_strategy, activation, quantizes)
