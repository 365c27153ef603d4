"""What a `raypaged launch` command line runs with: every engine setting as the server's own
parser reads the flags, and the features a result depends on, as they take effect on this
machine. A benchmark that starts the server as a child process records this beside its figures,
so a reader sees whether asynchronous scheduling, PDL, the GEMM epilogues and prefix caching
were on without reading the flags (or the defaults they leave alone)."""

from __future__ import annotations

import torch

from raypaged import envs
from raypaged.cli import build_parser
from raypaged.config import EngineConfig
from raypaged.kernels import gemv_config, gemv_table, pdl


def launch_config(flags: list[str]) -> EngineConfig:
    """The EngineConfig `raypaged launch FLAGS` builds (its parser, its defaults)."""
    return EngineConfig.from_cli_args(build_parser().parse_args(["launch", *flags]))


def effective_settings(flags: list[str], on_cuda: bool | None = None) -> dict:
    """The settings of `raypaged launch FLAGS` started from this process (the server inherits
    its environment) on this machine: `engine_config`, every setting by flat name; `effective`,
    what each feature the serving figures depend on does there:

      async_scheduling   the setting (nothing else turns it off);
      prefix_caching     the setting, and only with the paged KV cache (contiguous has none);
      pdl                the setting, RAYPAGED_PDL, and a device that has it (pdl.supported);
      gemm_epilogues     those the setting and RAYPAGED_GEMM_EPILOGUES allow, on a CUDA device
                         with a tuned GEMM table (they run only for shapes it lists);

    and `env`, the RAYPAGED_* overrides as envs.py read them. `on_cuda` defaults to where the
    server's device "auto" would put it."""
    config = launch_config(flags)
    device = config.model_settings.device
    if on_cuda is None:
        on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    table = gemv_table.table_path(torch.cuda.get_device_name()) if on_cuda else None
    epilogues = sorted(gemv_config.allowed_epilogues(envs.RAYPAGED_GEMM_EPILOGUES)) \
        if config.kernel.gemm_epilogues else []
    return {
        "engine_config": config.flat(),
        "effective": {
            "async_scheduling": config.scheduler.async_scheduling,
            "prefix_caching": config.scheduler.enable_prefix_caching
            and config.cache.kv_cache_mode == "paged",
            "pdl": bool(config.kernel.pdl and envs.RAYPAGED_PDL and on_cuda
                        and pdl.supported(torch.device("cuda"))),
            "gemm_epilogues": epilogues if table is not None and table.exists() else [],
        },
        "gemm_table": table.name if table is not None and table.exists() else None,
        "env": {"RAYPAGED_PDL": envs.RAYPAGED_PDL,
                "RAYPAGED_GEMM_EPILOGUES": envs.RAYPAGED_GEMM_EPILOGUES,
                "RAYPAGED_ATTENTION_BACKEND": envs.RAYPAGED_ATTENTION_BACKEND},
    }
