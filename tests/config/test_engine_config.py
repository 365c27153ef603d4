"""EngineConfig: its sections, the flags generated from their fields, flat names and ConfigError."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from raypaged.cli import build_parser
from raypaged.config import (
    SERVING_MAX_WAITING_REQUESTS,
    ConfigError,
    EngineConfig,
    SchedulerSettings,
)
from raypaged.config.cli import flags_of
from raypaged.config.sections import SECTIONS
from raypaged.core.errors import InvalidRequestError
from raypaged.core.scheduler_config import SchedulerConfig
from raypaged.model.config import ModelConfigError


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return parser


def all_fields():
    return [(section, f) for section in SECTIONS for f in dataclasses.fields(section)]


# ---- flags ---------------------------------------------------------------------------------------
def test_every_setting_has_a_flag_with_help_and_its_default():
    parser = engine_parser()
    actions = {a.dest: a for a in parser._actions}
    for section, f in all_fields():
        action = actions[f.name]
        assert action.option_strings[0] == flags_of(f)[0]
        assert action.default == f.default, f.name
        assert f.metadata["help"], f"{section.__name__}.{f.name} has no help text"
        choices = f.metadata["choices"]
        if choices is not None:
            assert list(action.choices) == [c for c in choices if c is not None]


def test_no_flags_give_the_default_config():
    assert EngineConfig.from_cli_args(engine_parser().parse_args([])) == EngineConfig()


def test_the_flags_users_know_keep_working():
    args = engine_parser().parse_args([
        "--tp", "2", "--kv-cache-memory", "512MiB", "--no-async-scheduling",
        "--no-enable-prefix-caching", "--enforce-eager", "--address", "auto", "--block-size", "32",
        "--attention-backend", "torch", "--no-pdl", "--no-gemm-epilogues", "--max-model-len", "128",
        "--distributed-executor-backend", "ray", "--piecewise-cuda-graph-max-tokens", "64"])
    config = EngineConfig.from_cli_args(args)
    assert config == EngineConfig(
        tensor_parallel_size=2, kv_cache_memory_bytes=512 * 2**20, async_scheduling=False,
        enable_prefix_caching=False, enforce_eager=True, ray_address="auto", block_size=32,
        attention_backend="torch", pdl=False, gemm_epilogues=False, max_model_len=128,
        distributed_executor_backend="ray", piecewise_cuda_graph_max_tokens=64)
    assert EngineConfig.from_cli_args(engine_parser().parse_args(["--enable-prefix-caching"])) \
        .scheduler.enable_prefix_caching


@pytest.mark.parametrize("argv", [["--block-size", "12"], ["--dtype", "fp8"],
                                  ["--kv-cache-mode", "reserved"], ["--tp", "two"]])
def test_the_parser_refuses_what_the_fields_do_not_allow(argv, capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(argv)


def test_commands_default_what_they_own():
    launch = build_parser().parse_args(["launch"])
    assert EngineConfig.from_cli_args(launch).scheduler.max_waiting_requests == SERVING_MAX_WAITING_REQUESTS
    generate = build_parser().parse_args(["generate", "--prompt", "x"])
    assert generate.seed is None  # the request samples unseeded ...
    assert EngineConfig.from_cli_args(generate).model_settings.seed == 0  # ... the engine keeps its seed
    assert build_parser().parse_args(["generate", "--prompt", "x", "--seed", "5"]).seed == 5


# ---- sections and flat names -------------------------------------------------------------------
def test_flat_names_reach_their_sections():
    config = EngineConfig(model="/m", tensor_parallel_size=2, block_size=32, pdl=False)
    assert (config.model_settings.model, config.parallel.tensor_parallel_size, config.scheduler.block_size,
            config.kernel.pdl) == ("/m", 2, 32, False)
    assert EngineConfig(**config.flat()) == config
    assert set(config.flat()) == EngineConfig.names()
    with pytest.raises(TypeError, match="blocksize"):
        EngineConfig(blocksize=32)


def test_replace_leaves_the_original_and_no_flat_attributes():
    config = EngineConfig(device="auto")
    changed = config.replace(device="cpu", max_num_seqs=4)
    assert (config.model_settings.device, config.scheduler.max_num_seqs) == ("auto", SchedulerConfig.max_num_seqs)
    assert (changed.model_settings.device, changed.scheduler.max_num_seqs) == ("cpu", 4)
    with pytest.raises(AttributeError):
        config.block_size = 8  # a flat attribute would be silently ignored: refused instead


def test_scheduler_defaults_are_core_schedulers():
    settings = SchedulerSettings()
    for name in ("block_size", "max_num_seqs", "enable_prefix_caching", "enable_chunked_prefill",
                 "max_waiting_requests"):
        assert getattr(settings, name) == getattr(SchedulerConfig, name)
    assert settings.scheduling_policy == SchedulerConfig.policy
    built = settings.build(num_blocks=10, max_model_len=4096)
    assert (built.num_blocks, built.max_model_len, built.async_scheduling) == (10, 4096, True)
    assert built.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens
    unchunked = dataclasses.replace(settings, enable_chunked_prefill=False)
    assert unchunked.token_budget(8192) == 8192
    assert dataclasses.replace(settings, max_num_batched_tokens=512).token_budget(8192) == 512


# ---- ConfigError ---------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    ({"dtype": "fp8"}, "dtype"),
    ({"load_format": "gguf"}, "load_format"),
    ({"device": "tpu"}, "device"),
    ({"block_size": 12}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ({"kv_cache_mode": "reserved"}, "kv_cache_mode"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"distributed_executor_backend": "mp"}, "distributed_executor_backend"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, "ray executor"),
    ({"piecewise_cuda_graph_max_tokens": 0}, "piecewise_cuda_graph_max_tokens"),
    ({"attention_backend": "cuda"}, "attention_backend"),
])
def test_bad_settings_raise_config_error(settings, message):
    with pytest.raises(ConfigError, match=message) as info:
        EngineConfig(**settings).validate()
    assert isinstance(info.value, ValueError) and not isinstance(info.value, InvalidRequestError)


def test_what_the_checkpoint_rules_out_is_a_config_error_too():
    assert issubclass(ModelConfigError, ConfigError)
