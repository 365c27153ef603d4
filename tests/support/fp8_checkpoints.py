"""Tiny FP8 checkpoints, as the tools that publish them write them.

- `compressed_tensors_dir(weights, activations)`: quantized by compressed-tensors itself (its
  preset schemes, its `calculate_qparams` for the scales, its ModelCompressor to compress and
  write the config), from the float "llama" test checkpoint; transformers loads the result with
  compressed-tensors installed and runs it with fake-quantized activations: the oracle.
- `modelopt_dir()`: NVIDIA ModelOpt's FP8 layout built by hand (per-tensor `weight_scale` and
  static `input_scale` as 0-d fp32 tensors, `hf_quant_config.json`, and the KV scales an FP8-KV
  export adds), from the same checkpoint.

Static input scales come from the inputs' amax over one calibration batch. Built once per process.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch

from tests.support.checkpoints import _root, checkpoint_dir

BASE = "llama"
_PRESETS = {("channel", "token"): "FP8_DYNAMIC", ("tensor", "static"): "FP8"}


def _hf_model(base: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_dir(base), dtype=torch.float32).eval()


def input_amax(model: torch.nn.Module, vocab_size: int) -> dict[str, torch.Tensor]:
    """Each Linear's input amax over a fixed calibration batch (the float model's forward)."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def record(mod, args, name=name):
                amax[name] = torch.maximum(amax.get(name, torch.tensor(0.0)), args[0].detach().abs().amax())
            hooks.append(module.register_forward_pre_hook(record))
    ids = torch.randint(3, vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return amax


def _copy_base(dest: Path, base: str) -> None:
    shutil.copytree(checkpoint_dir(base), dest)
    for weights in dest.glob("*.safetensors"):
        weights.unlink()


@functools.cache
def compressed_tensors_dir(weights: str = "channel", activations: str = "token",
                           ignore: tuple[str, ...] = ("lm_head",), base: str = BASE) -> Path:
    """An FP8 compressed-tensors checkpoint: weights per "channel" or "tensor", activations
    per "token" (dynamic) or "static" (per tensor, with input_scale)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    dest = _root() / f"ct-fp8-{weights}-{activations}-{'-'.join(ignore) or 'none'}-{base}"
    if dest.exists():
        return dest
    model = _hf_model(base)
    amax = input_amax(model, model.config.vocab_size)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(_PRESETS[weights, activations], ["Linear"])},
        ignore=list(ignore), format="float-quantized",
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None:
                continue
            w = module.weight
            dims = dict(dim=1, keepdim=True) if weights == "channel" else {}
            scale, zero = calculate_qparams(w.amin(**dims).reshape(module.weight_scale.shape),
                                            w.amax(**dims).reshape(module.weight_scale.shape), scheme.weights)
            module.weight_scale.copy_(scale)
            module.weight_zero_point.copy_(zero)
            if activations == "static":
                a = amax[name].reshape(module.input_scale.shape)
                scale, zero = calculate_qparams(-a, a, scheme.input_activations)
                module.input_scale.copy_(scale)
                module.input_zero_point.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    _copy_base(dest, base)
    model.save_pretrained(dest)
    compressor.update_config(dest)
    return dest


@functools.cache
def modelopt_dir(base: str = BASE, kv_scales: bool = True) -> Path:
    """A ModelOpt FP8 checkpoint: per-tensor e4m3 weights, 0-d weight_scale and input_scale,
    the quantization described in hf_quant_config.json (config.json carries none)."""
    from safetensors.torch import save_file

    from raypaged.model.quantization.numerics import FP8_MAX, scale_for, to_fp8

    dest = _root() / f"modelopt-fp8-{base}-{kv_scales}"
    if dest.exists():
        return dest
    model = _hf_model(base)
    amax = input_amax(model, model.config.vocab_size)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in amax and not module.endswith("lm_head"):
            scale = scale_for(param.abs().amax())
            tensors[name] = to_fp8(param, scale)
            tensors[f"{module}.weight_scale"] = scale.reshape(())
            tensors[f"{module}.input_scale"] = (amax[module] / FP8_MAX).reshape(()).float()
        else:
            tensors[name] = param.contiguous()
    if kv_scales:
        for i in range(model.config.num_hidden_layers):
            tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
            tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(1.0)
    _copy_base(dest, base)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_scales else None,
             "exclude_modules": ["lm_head"]}
    (dest / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": quant}, indent=2))
    return dest
