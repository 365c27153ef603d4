"""EngineConfig: the engine's settings, one section per concern.

Shared by every layer above core (engine, executor, worker). Code reads a section
(`config.parallel.tensor_parallel_size`); callers may also name settings flat, as vLLM's
`LLM(model, tensor_parallel_size=2)` does: `EngineConfig(model=..., tensor_parallel_size=2)`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from raypaged.config import cli
from raypaged.config.sections import (
    SETTING_OWNERS,
    CacheSettings,
    CompilationSettings,
    KernelSettings,
    ModelSettings,
    ParallelSettings,
    SchedulerSettings,
    ServingSettings,
)

# Servers bound the engine's waiting queue (a full one answers RESOURCE_EXHAUSTED / 429);
# the offline engine leaves it unbounded.
SERVING_MAX_WAITING_REQUESTS = 1024

# The attribute of EngineConfig that holds each section.
_SECTION_ATTRS: dict[type, str] = {
    ModelSettings: "model_settings", SchedulerSettings: "scheduler", CacheSettings: "cache",
    ParallelSettings: "parallel", CompilationSettings: "compilation", KernelSettings: "kernel",
    ServingSettings: "serving",
}


@dataclass(init=False, slots=True)
class EngineConfig:
    """The sections are frozen: a changed setting is a new section (replace()), so configs may
    share them. Slots make a misspelt or flat attribute (`config.block_size = 8`) an error."""

    model_settings: ModelSettings = field(default_factory=ModelSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    compilation: CompilationSettings = field(default_factory=CompilationSettings)
    kernel: KernelSettings = field(default_factory=KernelSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)

    def __init__(self, *, model_settings: ModelSettings | None = None,
                 scheduler: SchedulerSettings | None = None, cache: CacheSettings | None = None,
                 parallel: ParallelSettings | None = None,
                 compilation: CompilationSettings | None = None,
                 kernel: KernelSettings | None = None, serving: ServingSettings | None = None,
                 **settings: Any) -> None:
        """Sections as given (defaults otherwise), then flat `settings` (EngineConfig.names())
        applied over them. An unknown name is a TypeError, as for any keyword argument."""
        self.model_settings = model_settings or ModelSettings()
        self.scheduler = scheduler or SchedulerSettings()
        self.cache = cache or CacheSettings()
        self.parallel = parallel or ParallelSettings()
        self.compilation = compilation or CompilationSettings()
        self.kernel = kernel or KernelSettings()
        self.serving = serving or ServingSettings()
        self._apply(settings)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """A flag for every setting (config/cli.py), one argument group per section."""
        cli.add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**cli.settings_from_cli_args(args))

    @staticmethod
    def names() -> frozenset[str]:
        """The flat names of every setting, over all sections."""
        return frozenset(SETTING_OWNERS)

    def replace(self, **settings: Any) -> EngineConfig:
        """A copy with the flat `settings` changed; this one is left as it is."""
        return EngineConfig(**{attr: getattr(self, attr) for attr in _SECTION_ATTRS.values()},
                            **settings)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name: EngineConfig(**config.flat()) == config."""
        return {name: getattr(getattr(self, _SECTION_ATTRS[owner]), name)
                for name, owner in SETTING_OWNERS.items()}

    def validate(self) -> None:
        """Raise ConfigError for the first setting that can never work."""
        for attr in _SECTION_ATTRS.values():
            getattr(self, attr).validate()

    def _apply(self, settings: dict[str, Any]) -> None:
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            owner = SETTING_OWNERS.get(name)
            if owner is None:
                raise TypeError(f"EngineConfig got an unknown setting {name!r}")
            by_section.setdefault(_SECTION_ATTRS[owner], {})[name] = value
        for attr, values in by_section.items():
            setattr(self, attr, dataclasses.replace(getattr(self, attr), **values))
