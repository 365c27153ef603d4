"""What bench_serving records of its servers' settings (benchmarks/lib/server_settings.py): the
flags as `raypaged launch` parses them, and each feature as it takes effect — the flag, the
RAYPAGED_* override, and the device."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lib import server_settings
from benchmarks.lib.server_settings import effective_settings
from raypaged import envs
from raypaged.kernels import pdl


@pytest.fixture
def h200(monkeypatch):
    """A CUDA device that has PDL and a tuned GEMM table, as the GPU machine's."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(pdl, "supported", lambda device: device.type == "cuda")


def test_launch_defaults_turn_every_feature_on(h200):
    settings = effective_settings(["--max-model-len", "8192"], on_cuda=True)
    assert settings["effective"] == {"async_scheduling": True, "prefix_caching": True, "pdl": True,
                                     "gemm_epilogues": ["rope", "silu"]}
    assert settings["gemm_table"] == "gemv_nvidia_h200.json"
    config = settings["engine_config"]
    assert config["max_model_len"] == 8192 and config["max_waiting_requests"] == 1024  # launch's own default


@pytest.mark.parametrize("flag, feature, off", [
    ("--no-async-scheduling", "async_scheduling", False),
    ("--no-enable-prefix-caching", "prefix_caching", False),
    ("--kv-cache-mode=contiguous", "prefix_caching", False),  # contiguous has no prefix cache
    ("--no-pdl", "pdl", False),
    ("--no-gemm-epilogues", "gemm_epilogues", []),
])
def test_a_flag_turns_its_feature_off(h200, flag, feature, off):
    settings = effective_settings([flag], on_cuda=True)
    assert settings["effective"][feature] == off
    others = {k: v for k, v in settings["effective"].items() if k != feature}
    assert all(others.values())  # and nothing else


def test_the_environment_and_the_device_count(h200, monkeypatch):
    monkeypatch.setattr(envs, "RAYPAGED_PDL", False)
    monkeypatch.setattr(envs, "RAYPAGED_GEMM_EPILOGUES", "rope")
    settings = effective_settings([], on_cuda=True)
    assert settings["effective"]["pdl"] is False and settings["env"]["RAYPAGED_PDL"] is False
    assert settings["effective"]["gemm_epilogues"] == ["rope"]
    monkeypatch.setattr(envs, "RAYPAGED_PDL", True)
    monkeypatch.setattr(pdl, "supported", lambda device: False)  # e.g. an A100
    assert effective_settings([], on_cuda=True)["effective"]["pdl"] is False
    # A GPU without a tuned table runs no epilogue; the CPU neither PDL nor epilogues.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert effective_settings([], on_cuda=True)["effective"]["gemm_epilogues"] == []
    cpu = effective_settings(["--device", "cpu"])
    assert cpu["effective"] == {"async_scheduling": True, "prefix_caching": True, "pdl": False,
                                "gemm_epilogues": []}
    assert cpu["gemm_table"] is None and server_settings.launch_config(["--device", "cpu"]).kernel.pdl
