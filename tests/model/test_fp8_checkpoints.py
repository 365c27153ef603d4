"""FP8 models through the real loader: quantized at load, compressed-tensors and ModelOpt
checkpoints, each against transformers running the same quantization (compressed-tensors'
fake-quantized forward), and against the float model within FP8's error."""

from __future__ import annotations

import pytest
import torch

from raypaged.model.loader import load_model
from raypaged.model.quantization.fp8 import Fp8Linear
from tests.support.checkpoints import checkpoint_dir
from tests.support.fp8_checkpoints import compressed_tensors_dir, modelopt_dir
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of
from tests.support.model_harness import PagedHarness, run_mixed_schedule

DECODE_STEPS = 6
PROMPTS = dict(zip(("a", "b", "c"), random_prompts([5, 13, 9], vocab_of("llama"), seed=4)))


def _load(path, **kwargs):
    return load_model(path, dtype=torch.float32, progress=False, **kwargs)


def _run(model) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    harness = PagedHarness(model, model.config, block_size=8, num_blocks=32, seed=3)
    generated = run_mixed_schedule(harness, PROMPTS, DECODE_STEPS, chunk="b")
    return generated, {req: harness.logits_of(req) for req in PROMPTS}


def _hf_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    from tests.support.hf_oracle import _hf_model

    with torch.inference_mode():
        return _hf_model(str(model_dir))(torch.tensor([tokens])).logits[0]


def _assert_matches_transformers(model, model_dir) -> None:
    """Greedy tokens equal transformers' on the same checkpoint; every position's logits agree
    to fp32 rounding of the two orders of the same FP8 arithmetic."""
    generated, logits = _run(model)
    for req, prompt in PROMPTS.items():
        assert generated[req] == hf_greedy(model_dir, tuple(prompt), len(generated[req])), req
        tokens = prompt + generated[req]
        expected = _hf_logits(model_dir, tokens)[: logits[req].shape[0]]
        torch.testing.assert_close(logits[req], expected, rtol=1e-3, atol=2e-3 * float(expected.abs().max()))


def _fp8_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if getattr(m, "quant", None) is not None}


def test_quantize_at_load_is_compressed_tensors_fp8_dynamic_exactly():
    """--quantization fp8 on the float checkpoint gives the e4m3 weights and per-channel scales
    compressed-tensors' FP8_DYNAMIC scheme writes for it, bit for bit."""
    at_load = _load(checkpoint_dir("llama"), quantization="fp8")
    stored = _load(compressed_tensors_dir("channel", "token"))
    a, b = _fp8_layers(at_load), _fp8_layers(stored)
    assert set(a) == set(b) and len(a) == 4 * at_load.config.num_hidden_layers
    for name in a:
        assert a[name].weight.dtype == torch.float8_e4m3fn
        assert torch.equal(a[name].weight.view(torch.uint8), b[name].weight.view(torch.uint8)), name
        assert torch.equal(a[name].quant.weight_scale, b[name].quant.weight_scale), name
    assert at_load.lm_head.weight.dtype == torch.float32  # embeddings and the LM head stay float


def test_quantized_at_load_matches_transformers_on_the_same_quantization():
    _assert_matches_transformers(_load(checkpoint_dir("llama"), quantization="fp8"),
                                 compressed_tensors_dir("channel", "token"))


def test_fp8_logits_are_close_to_the_float_model():
    """On the prompts' positions (after them the two models may pick different tokens): a
    single FP8 GEMM is off by ~3% of its output's norm (test_fp8_numerics); this model chains 14
    (7 a layer), whose independent errors add in quadrature to ~3%·√14 ≈ 11%."""
    _, float_logits = _run(_load(checkpoint_dir("llama")))
    _, fp8_logits = _run(_load(checkpoint_dir("llama"), quantization="fp8"))
    for req, prompt in PROMPTS.items():
        ref, got = float_logits[req][: len(prompt)], fp8_logits[req][: len(prompt)]
        rel = (got - ref).norm() / ref.norm()
        assert 1e-3 < rel < 0.2, (req, float(rel))


def test_compressed_tensors_per_channel_dynamic_checkpoint_matches_transformers():
    path = compressed_tensors_dir("channel", "token")
    model = _load(path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, Fp8Linear) and qkv.quant.activation == "token"
    _assert_matches_transformers(model, path)


def test_compressed_tensors_per_tensor_static_checkpoint_keeps_each_parts_scale():
    path = compressed_tensors_dir("tensor", "static")
    model = _load(path)
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        scales = {p: f.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight_scale").item() for p in "qkv"}
        inputs = [f.get_tensor(f"model.layers.0.self_attn.{p}_proj.input_scale").item() for p in "qkv"]
    qkv = model.model.layers[0].self_attn.qkv_proj
    rows = {"q": qkv.output_shard("q"), "k": qkv.output_shard("k"), "v": qkv.output_shard("v")}
    assert len(set(scales.values())) == 3  # the merged GEMM's parts were scaled differently
    for part, shard in rows.items():
        got = qkv.quant.weight_scale[shard.dest_start : shard.dest_start + shard.rows]
        assert torch.equal(got, torch.full_like(got, scales[part]))
    assert qkv.quant.activation == "static" and float(qkv.quant.input_scale) == max(inputs)
    _assert_matches_transformers(model, path)


def test_compressed_tensors_ignore_list_leaves_those_layers_float():
    path = compressed_tensors_dir("channel", "token", ignore=("lm_head", "re:.*down_proj$"))
    model = _load(path)
    mlp = model.model.layers[1].mlp
    assert mlp.down_proj.quant is None and mlp.down_proj.weight.dtype == torch.float32
    assert mlp.gate_up_proj.quant is not None
    _assert_matches_transformers(model, path)


def test_modelopt_checkpoint_loads_as_the_same_per_tensor_static_scheme():
    """ModelOpt's FP8 (per-tensor weights, static inputs, 0-d scales, KV scales ignored) is the
    scheme compressed-tensors' FP8 preset writes: the same calibration gives the same model, so
    transformers on the latter is the oracle of the former."""
    modelopt = _load(modelopt_dir())
    ct = _load(compressed_tensors_dir("tensor", "static"))
    a, b = _fp8_layers(modelopt), _fp8_layers(ct)
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name].weight.view(torch.uint8), b[name].weight.view(torch.uint8)), name
        torch.testing.assert_close(a[name].quant.weight_scale, b[name].quant.weight_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(a[name].quant.input_scale, b[name].quant.input_scale, rtol=1e-6, atol=0)
    _assert_matches_transformers(modelopt, compressed_tensors_dir("tensor", "static"))


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_scales_shard_with_rows_of_column_parallel_and_whole_for_row_parallel(tp_rank):
    """At tp 2 (one rank's shard, loaded without a process group) each column-parallel layer
    keeps its rows' scales, each row-parallel one every output row's."""
    from raypaged.model import parallel

    path = compressed_tensors_dir("channel", "token")
    full = _load(path)
    parallel.init_tensor_parallel(rank=tp_rank, world_size=2)
    try:
        shard = _load(path)
    finally:
        parallel.reset_tensor_parallel()
    for layer_full, layer in zip(full.model.layers, shard.model.layers):
        for name in ("qkv_proj", "gate_up_proj"):
            whole = getattr(layer_full.self_attn if name == "qkv_proj" else layer_full.mlp, name)
            part = getattr(layer.self_attn if name == "qkv_proj" else layer.mlp, name)
            for s_whole, s_part in zip(whole.shards, part.shards):
                start = s_whole.dest_start + s_part.source_start
                expected = whole.quant.weight_scale[start : start + s_part.rows]
                got = part.quant.weight_scale[s_part.dest_start : s_part.dest_start + s_part.rows]
                assert torch.equal(got, expected)
        for whole, part in ((layer_full.self_attn.o_proj, layer.self_attn.o_proj),
                            (layer_full.mlp.down_proj, layer.mlp.down_proj)):
            assert torch.equal(part.quant.weight_scale, whole.quant.weight_scale)
            cols = part.weight.shape[1]
            assert torch.equal(part.weight.view(torch.uint8),
                               whole.weight.view(torch.uint8)[:, tp_rank * cols : (tp_rank + 1) * cols])


@pytest.mark.slow  # the interpreter runs the paged kernels too: ~30 s on CI's cores
def test_fp8_through_the_triton_kernels_matches_the_reference_path(monkeypatch):
    """The Triton backend under the interpreter: decode rows through the skinny GEMM's FP8
    variant (weight-only), prefill through the reference GEMM, paged kernels; against the torch
    backend computing the same arithmetic — W8A8 for prefill, as transformers' FP8 does, and the
    weight-only reference at a decode step's rows — so the same tokens and logits to fp32 rounding."""
    from raypaged.kernels import gemv, ops
    from raypaged.model.quantization.numerics import weight_only_matmul_reference

    model = _load(checkpoint_dir("llama"), quantization="fp8")
    with monkeypatch.context() as patch:
        def weight_only(x, weight, w_scale, bias):
            if x.shape[0] > gemv.DEFAULT_ROWS:
                return None
            out = weight_only_matmul_reference(x, weight, w_scale)
            return (out if bias is None else out + bias.float()).to(x.dtype)

        patch.setattr(ops, "linear_fp8", weight_only)
        reference_tokens, reference_logits = _run(model)
    ops.set_backend("triton")
    try:
        tokens, logits = _run(model)
    finally:
        ops.set_backend("auto")
    assert tokens == reference_tokens
    for req in PROMPTS:
        torch.testing.assert_close(logits[req], reference_logits[req], rtol=1e-4, atol=1e-4)


def test_modelopt_quantization_config_in_config_json_is_read_too(tmp_path):
    """Newer ModelOpt exports put the same fields in config.json's quantization_config."""
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(modelopt_dir(), path)
    quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    (path / "hf_quant_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    (path / "config.json").write_text(json.dumps(config))
    a, b = _fp8_layers(_load(path)), _fp8_layers(_load(modelopt_dir()))
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name].weight.view(torch.uint8), b[name].weight.view(torch.uint8))
        assert torch.equal(a[name].quant.input_scale, b[name].quant.input_scale)


@pytest.mark.parametrize("weights, activations", [("channel", "token"), ("tensor", "static")])
def test_phi3_fused_tensors_quantize_and_load_per_part(weights, activations):
    """Phi-3's checkpoint fuses qkv and gate/up into one tensor each (one scale per fused tensor
    when per tensor); at load every linear is quantized, and the compressed-tensors checkpoint
    matches transformers. ("phi3-partial": the longrope "phi3" is served at a length set by its
    spec, which _load does not pass.)"""
    from tests.support.hf_oracle import hf_greedy

    at_load = _load(checkpoint_dir("phi3-partial"), quantization="fp8")
    assert len(_fp8_layers(at_load)) == 4 * at_load.config.num_hidden_layers
    path = compressed_tensors_dir(weights, activations, base="phi3-partial")
    model = _load(path)
    assert len(_fp8_layers(model)) == 4 * model.config.num_hidden_layers
    if weights == "channel":  # the same quantization, at load or stored
        for name, layer in _fp8_layers(model).items():
            other = _fp8_layers(at_load)[name]
            assert torch.equal(layer.weight.view(torch.uint8), other.weight.view(torch.uint8)), name
            assert torch.equal(layer.quant.weight_scale, other.quant.weight_scale), name
    harness = PagedHarness(model, model.config, block_size=8, num_blocks=32, seed=3)
    prompts = dict(zip(("a", "b"), random_prompts([5, 11], model.config.vocab_size, seed=7)))
    generated = run_mixed_schedule(harness, prompts, DECODE_STEPS)
    for req, prompt in prompts.items():
        assert generated[req] == hf_greedy(path, tuple(prompt), len(generated[req])), req


@pytest.mark.parametrize("name", ["qwen3", "llama-tied", "phi3-partial"])
def test_every_architecture_quantizes_its_linears_at_load(name):
    """Biases (llama-tied), head norms (qwen3), fused tensors (phi3): every linear is FP8,
    and the prompt's logits stay within FP8's error of the float model's."""
    path = checkpoint_dir(name)
    float_model, fp8_model = _load(path), _load(path, quantization="fp8")
    assert len(_fp8_layers(fp8_model)) == 4 * fp8_model.config.num_hidden_layers
    prompt = random_prompts([9], fp8_model.config.vocab_size, seed=8)[0]
    logits = []
    for model in (float_model, fp8_model):
        harness = PagedHarness(model, model.config, block_size=8, num_blocks=16, seed=3)
        run_mixed_schedule(harness, {"a": prompt}, 0)
        logits.append(harness.logits_of("a")[: len(prompt)])
    assert 1e-3 < (logits[1] - logits[0]).norm() / logits[0].norm() < 0.2
