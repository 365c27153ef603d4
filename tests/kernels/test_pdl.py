"""Programmatic dependent launch (raypaged/kernels/pdl.py): on unless turned off, never under the
interpreter, and on a GPU that has it, the kernels of a decode step give the same results
launched either way.

The interpreter cannot run the PDL instructions, so on CPU only the switch is checked; the `gpu`
test compares the kernels with it on and off (the other GPU tests run with it on).
"""

from __future__ import annotations

import math

import pytest
import torch

from raypaged import envs
from raypaged.kernels import gemv, pdl
from raypaged.kernels.gemv import gemv_rope, gemv_silu_mul, gemv_triton
from raypaged.kernels.gemv_config import default_config
from raypaged.kernels.ops import add_rms_norm, rope_in_place, rope_tables, silu_and_mul
from raypaged.kernels.paged_decode import paged_decode_triton
from raypaged.kernels.testing import random_paged_batch


@pytest.fixture
def pdl_env(monkeypatch):
    """Set RAYPAGED_PDL as envs.py would have read it (None: unset)."""
    def set_to(value: str | None) -> None:
        monkeypatch.setattr(envs, "RAYPAGED_PDL", value != "0")
        pdl._enabled.cache_clear()

    yield set_to
    pdl.set_enabled(True)


def test_the_kernel_setting_turns_it_off(pdl_env, monkeypatch):
    monkeypatch.setattr(pdl, "device_properties", lambda device: type("P", (), {"major": 9}))
    pdl_env(None)
    pdl.set_enabled(False)
    assert not pdl._enabled(torch.device("cuda", 0))
    pdl.set_enabled(True)
    assert pdl._enabled(torch.device("cuda", 0))


def test_this_triton_has_the_launch_option_and_the_wait():
    # CI's Triton; the GPU machine's (3.6) is checked by the gpu test, which needs it on.
    assert pdl._triton_has_pdl()


def test_never_on_cpu_and_off_when_turned_off(pdl_env, monkeypatch):
    x = torch.zeros(1)
    for value in (None, "1", "0"):
        pdl_env(value)
        assert pdl.pdl_launch(x) == {"USE_PDL": False}  # the interpreter has no PDL
    # The switch itself, as a capable GPU would see it:
    monkeypatch.setattr(pdl, "device_properties", lambda device: type("P", (), {"major": 9}))
    pdl_env(None)
    assert pdl._enabled(torch.device("cuda", 0))
    pdl_env("0")
    assert not pdl._enabled(torch.device("cuda", 0))


def test_supported_asks_the_device_not_the_settings(pdl_env, monkeypatch):
    pdl_env("0")
    pdl.set_enabled(False)
    assert not pdl.supported(torch.device("cpu"))
    for major, expected in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(pdl, "device_properties", lambda device, m=major: type("P", (), {"major": m}))
        assert pdl.supported(torch.device("cuda", 0)) is expected  # off by setting, still supported
        assert not pdl._enabled(torch.device("cuda", 0))
        pdl._enabled.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper-class GPU")
def test_gpu_decode_kernels_match_with_pdl_in_a_cuda_graph(pdl_env, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    dtype, dev = torch.bfloat16, "cuda"
    batch = random_paged_batch([300, 1000], 8, 128, 16, dtype, dev, generator=gen)
    hidden = torch.randn(2, 4096, generator=gen).to(dtype).to(dev)
    residual = torch.randn(2, 4096, generator=gen).to(dtype).to(dev)
    norm_weight = torch.rand(4096, generator=gen).to(dtype).to(dev)
    weight = (torch.randn(6144, 4096, generator=gen) * 0.02).to(dtype).to(dev)
    up = (torch.randn(2 * 1024, 4096, generator=gen) * 0.02).to(dtype).to(dev)
    positions = torch.tensor([299, 999], device=dev)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 128, 2, device=dev).float() / 128))

    def step() -> list[torch.Tensor]:
        normed, summed = add_rms_norm(hidden, residual, norm_weight, 1e-5)
        qkv = gemv_triton(normed, weight)
        cos, sin = rope_tables(positions, inv_freq)
        q, k = qkv[:, :4096].reshape(2, 32, 128), qkv[:, 4096:5120].reshape(2, 8, 128)
        rope_in_place(q, k, cos, sin)
        attn = paged_decode_triton(q.contiguous(), batch.k_cache, batch.v_cache, batch.block_tables,
                                   batch.seq_lens, 1 / math.sqrt(128))
        split = gemv_triton(normed, up, split_k=4)  # its partials meet through atomics
        # the fused epilogues, and a GEMM right after a GEMM
        rotated = gemv_rope(normed, weight, None, cos, sin, 128, 5120, default_config(6144, 4096, 2))
        activated = gemv_silu_mul(attn.reshape(2, 4096), up, None, default_config(2048, 4096, 2))
        return [summed, attn, silu_and_mul(gemv_triton(attn.reshape(2, 4096), up)), split, rotated,
                gemv_triton(activated, weight[:, :1024].contiguous())]

    results = {}
    assert pdl._triton_has_pdl()
    at_end = gemv._dependents_at_end
    for setting in ("0", "1", "1 end"):  # "end": the GEMMs let the next kernel launch at their end
        pdl_env(setting[0])
        monkeypatch.setattr(gemv, "_dependents_at_end",
                            (lambda epilogue: True) if setting.endswith("end") else at_end)
        assert pdl.pdl_launch(hidden)["USE_PDL"] == (setting[0] == "1")
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        graph.replay()
        torch.cuda.synchronize()
        results[setting] = [t.clone() for t in outputs]
    for off, on, on_end in zip(results["0"], results["1"], results["1 end"]):
        assert torch.equal(off, on) and torch.equal(off, on_end)
