"""The engine's settings: EngineConfig, its sections, their flags and ConfigError.

base.py: how a setting is declared; sections.py: the sections; engine.py: EngineConfig;
cli.py: the flags generated from the fields.
"""

from raypaged.config.base import ConfigError
from raypaged.config.engine import SERVING_MAX_WAITING_REQUESTS, EngineConfig
from raypaged.config.sections import (
    KV_CACHE_MODES,
    CacheSettings,
    CompilationSettings,
    KernelSettings,
    ModelSettings,
    ParallelSettings,
    SchedulerSettings,
    ServingSettings,
)

__all__ = [
    "KV_CACHE_MODES",
    "SERVING_MAX_WAITING_REQUESTS",
    "CacheSettings",
    "CompilationSettings",
    "ConfigError",
    "EngineConfig",
    "KernelSettings",
    "ModelSettings",
    "ParallelSettings",
    "SchedulerSettings",
    "ServingSettings",
]
