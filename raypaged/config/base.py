"""What every settings section is made of: fields that carry their own help, choices and flags.

A section is a dataclass whose fields are declared with `setting(...)`: the default is written
there once, and the command line (config/cli.py), the Serve config's `args:` and validation all
read it from the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any


class ConfigError(ValueError):
    """An engine setting that can never work (unknown choice, out of range, contradicting another
    setting). Raised before anything starts; a request's bad values are InvalidRequestError."""


def setting(default: Any, help: str, *, choices: Sequence[Any] | None = None,
            flags: Sequence[str] = (), parse: Callable[[str], Any] | None = None) -> Any:
    """A section field. `help` is the flag's help text; `choices` are checked by validate() and
    offered by the flag; `flags` replaces the flag derived from the name (`--max-num-seqs`), the
    first one shown; `parse` turns the flag's text into the value (default: the field's type)."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None,
                "flags": tuple(flags), "parse": parse}
    return dataclasses.field(default=default, metadata=metadata)


def check_choices(section: Any) -> None:
    """Raise ConfigError for a field whose value is not one of its declared choices."""
    for f in dataclasses.fields(section):
        choices = f.metadata.get("choices")
        value = getattr(section, f.name)
        if choices is not None and value not in choices:
            shown = ", ".join(repr(c) for c in choices)
            raise ConfigError(f"{f.name} must be one of {shown}; got {value!r}")


def check(rules: Sequence[tuple[bool, str]]) -> None:
    """Raise ConfigError with the message of the first rule that does not hold."""
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def parse_bytes(text: str) -> int:
    """A size as people write it: 512MiB, 2GiB, 1.5GB, 4096 (bytes)."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)
