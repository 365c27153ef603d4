"""What FP8 refuses, at load, with a message: schemes it cannot read, inconsistent or damaged
checkpoints, a bad --quantization. Never a silent float model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raypaged.config.base import ConfigError
from raypaged.model.loader import CheckpointError, load_model
from raypaged.model.quantization.schemes import QuantizationError
from tests.support.checkpoints import checkpoint_dir
from tests.support.fp8_checkpoints import compressed_tensors_dir, modelopt_dir


def _load(path, **kwargs):
    return load_model(path, dtype=torch.float32, progress=False, **kwargs)


def _copy(src: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(src, dest)
    return dest


def _edit_quant_config(path: Path, edit) -> Path:
    config = json.loads((path / "config.json").read_text())
    edit(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))
    return path


def _group(q: dict) -> dict:
    return q["config_groups"]["group_0"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: _group(q)["weights"].update(type="int"), "8-bit int"),  # int8 W8A8
        (lambda q: (q.update(format="pack-quantized"), _group(q).update(format="pack-quantized")),
         "format 'pack-quantized'"),  # w4a16
        (lambda q: _group(q)["weights"].update(strategy="block", block_structure=[128, 128]),
         "strategy 'block'"),
        (lambda q: _group(q).update(input_activations=None), "weight-only"),
        (lambda q: _group(q)["input_activations"].update(strategy="group", group_size=16), "strategy 'group'"),
        (lambda q: _group(q)["weights"].update(num_bits="eight"), "invalid"),
    ],
    ids=["int8", "w4a16", "block-fp8", "fp8-weight-only", "group-activations", "malformed"],
)
def test_compressed_tensors_schemes_it_cannot_serve_fail_at_load(tmp_path, edit, message):
    path = _edit_quant_config(_copy(compressed_tensors_dir("channel", "token"), tmp_path / "m"), edit)
    with pytest.raises(QuantizationError, match=message):
        _load(path)


@pytest.mark.parametrize("quant_method", ["gptq", "awq", "bitsandbytes", "fp8"])
def test_other_quant_methods_fail_at_load(tmp_path, quant_method):
    path = _copy(checkpoint_dir("llama"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": quant_method, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=f"quant_method '{quant_method}'"):
        _load(path)
    with pytest.raises(QuantizationError, match="cannot read"):
        _load(path, quantization="fp8")  # asking for fp8 does not re-quantize a quantized checkpoint


@pytest.mark.parametrize("algo", ["NVFP4", "W4A8_AWQ", "FP8_PB_WO"])
def test_modelopt_algorithms_it_cannot_serve_fail_at_load(tmp_path, algo):
    path = _copy(modelopt_dir(), tmp_path / "m")
    raw = json.loads((path / "hf_quant_config.json").read_text())
    raw["quantization"]["quant_algo"] = algo
    (path / "hf_quant_config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantizationError, match=f"quant_algo '{algo}'"):
        _load(path)


def test_unknown_quantization_is_refused():
    with pytest.raises(QuantizationError, match="unknown quantization 'int8'"):
        _load(checkpoint_dir("llama"), quantization="int8")
    assert issubclass(QuantizationError, ConfigError)


def test_a_merged_gemm_quantized_only_in_part_is_refused(tmp_path):
    path = _edit_quant_config(_copy(compressed_tensors_dir("channel", "token"), tmp_path / "m"),
                              lambda q: q["ignore"].append("re:.*q_proj$"))
    with pytest.raises(QuantizationError, match="q_proj.*k_proj.*v_proj are one GEMM"):
        _load(path)


def _rewrite_tensors(path: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_float_weights_under_an_fp8_config_are_refused_by_dtype(tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    path = _rewrite_tensors(_copy(compressed_tensors_dir("channel", "token"), tmp_path / "m"),
                            lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError, match=f"{name}.*dtype F32.*F8_E4M3"):
        _load(path)


def test_missing_scale_is_refused(tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    path = _rewrite_tensors(_copy(compressed_tensors_dir("channel", "token"), tmp_path / "m"),
                            lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor in checkpoint: {name}"):
        _load(path)


@pytest.mark.parametrize("value", [0.0, float("nan")])
def test_scales_that_are_not_positive_and_finite_are_refused(tmp_path, value):
    name = "model.layers.0.self_attn.k_proj.weight_scale"

    def poison(t):
        t[name][3] = value

    path = _rewrite_tensors(_copy(compressed_tensors_dir("channel", "token"), tmp_path / "m"), poison)
    with pytest.raises(QuantizationError, match=r"weight_scale of .*\.k_proj.* not positive and finite"):
        _load(path)


def test_per_channel_scale_of_the_wrong_length_is_refused(tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale"
    path = _rewrite_tensors(_copy(compressed_tensors_dir("channel", "token"), tmp_path / "m"),
                            lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match=f"{name}.*shape"):
        _load(path)


def test_dummy_weights_with_fp8_quantize_at_load():
    from raypaged.model.config import ModelConfig

    config = ModelConfig.from_pretrained(compressed_tensors_dir("tensor", "static"))
    model = load_model(config, dtype=torch.float32, load_format="dummy", progress=False)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.quant.activation == "token"
