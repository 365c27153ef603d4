"""The engine's command-line flags, generated from the settings' fields.

One flag per setting: `--max-num-seqs` for max_num_seqs unless the field names its own flags;
booleans take `--x` / `--no-x`. Default, help text and choices are the field's, so a flag cannot
drift from the setting it sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from raypaged.config.sections import SECTIONS, SETTING_OWNERS


def flags_of(f: dataclasses.Field) -> tuple[str, ...]:
    """The option strings of a setting's flag, the first one canonical."""
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def _value_type(section: type, f: dataclasses.Field) -> type:
    """The field's type without Optional: int for `int | None`."""
    hint = typing.get_type_hints(section)[f.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        [hint] = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add every engine setting's flag to `parser`, one argument group per section."""
    for section in SECTIONS:
        title = "engine: " + section.__name__.removesuffix("Settings").lower()
        group = parser.add_argument_group(title, " ".join((section.__doc__ or "").split("\n\n")[0].split()))
        for f in dataclasses.fields(section):
            help_text = f.metadata["help"]
            if f.default is None and "(default:" in help_text:
                # The text says what None stands for; a zero-width %(default) keeps
                # ArgumentDefaultsHelpFormatter from adding "(default: None)" after it.
                help_text += "%(default).0s"
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text}
            value_type = _value_type(section, f)
            if value_type is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = f.metadata["parse"] or value_type
                choices = f.metadata["choices"]
                if choices is not None:
                    kwargs["choices"] = [c for c in choices if c is not None]
            group.add_argument(*flags_of(f), **kwargs)


def settings_from_cli_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the parsed flags give, by flat name. A None where the setting's default is
    not None means the flag was not given (a command may default a flag to None to see that, as
    `generate --seed` does): the setting keeps its default."""
    given = vars(args)
    defaults = {f.name: f.default for section in SECTIONS for f in dataclasses.fields(section)}
    return {name: given.get(name) for name in SETTING_OWNERS
            if given.get(name) is not None or defaults[name] is None}
