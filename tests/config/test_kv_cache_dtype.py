"""--kv-cache-dtype: the flag every command takes, the names it accepts, and the start-up check
that refuses an FP8 pool where the GPU cannot run one."""

from __future__ import annotations

import argparse
from unittest import mock

import pytest
import torch

from raypaged.config import EngineConfig
from raypaged.config.base import ConfigError
from raypaged.config.sections import kv_cache_value_bytes
from raypaged.kernels.kv_quant import Fp8KvUnsupportedError, check_kv_cache_device


def _config(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(argv))


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_the_flag_sets_the_cache_section(name):
    assert _config(["--kv-cache-dtype", name]).cache.kv_cache_dtype == name
    assert EngineConfig(kv_cache_dtype=name).cache.kv_cache_dtype == name


def test_an_unknown_kv_dtype_is_refused():
    with pytest.raises(SystemExit):
        _config(["--kv-cache-dtype", "int8"])
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4").validate()
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype"):
        kv_cache_value_bytes("int8")


def test_value_bytes():
    assert [kv_cache_value_bytes(n) for n in ("auto", "fp8", "fp8_e5m2")] == [2, 1, 1]
    assert kv_cache_value_bytes("auto", 4) == 4


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False),
                                                 ((9, 0), False)])
def test_fp8_pools_need_sm89_on_cuda(capability, refused):
    device = torch.device("cuda", 0)
    with mock.patch.object(torch.cuda, "get_device_capability", return_value=capability), \
            mock.patch.object(torch.cuda, "get_device_name", return_value="a GPU"):
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if refused:
                with pytest.raises(Fp8KvUnsupportedError, match="compute capability >= 8.9"):
                    check_kv_cache_device(dtype, device)
            else:
                check_kv_cache_device(dtype, device)
        check_kv_cache_device(torch.bfloat16, device)  # a 16-bit pool runs anywhere
    check_kv_cache_device(torch.float8_e4m3fn, torch.device("cpu"))  # references / interpreter
