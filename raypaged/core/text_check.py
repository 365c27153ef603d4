"""Is client text real text? The one check, shared by every door that takes text.

A Python str may hold lone UTF-16 surrogates (JSON's "\\ud800" escape decodes to one, and so
does a command-line byte that is not UTF-8, under surrogateescape); no UTF-8 encoder, tokenizer
or protobuf takes them, and each fails in its own confusing way. Callers refuse such text up
front, naming the field: serve/client_text.py for OpenAI request bodies (every field),
SamplingParams for stop strings, the offline LLM for text prompts. (gRPC needs none: protobuf
refuses string fields that are not valid UTF-8 as it parses.)
"""

from __future__ import annotations

from typing import Any

KEY = "<key>"  # a path part: the key of the dict entry before it, not its value


def lone_surrogate(text: str) -> str | None:
    """The first character of text that UTF-8 cannot carry, written U+XXXX; None if none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(text[e.start]):04X}"
    return None


def invalid_text_path(value: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], str] | None:
    """The path of the first string in `value` (a decoded JSON document: dicts, lists, scalars)
    that is not valid text, keys included, and its bad character; None when all are valid."""
    if isinstance(value, str):
        bad = lone_surrogate(value)
        return None if bad is None else (path, bad)
    if isinstance(value, dict):
        for key, item in value.items():
            found = invalid_text_path(str(key), (*path, KEY)) or invalid_text_path(item, (*path, str(key)))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = invalid_text_path(item, (*path, str(i)))
            if found is not None:
                return found
    return None


def invalid_text_message(character: str, key: bool = False) -> str:
    what = "a key is not" if key else "not"
    return f"{what} valid text (a lone UTF-16 surrogate, {character}: half a character, which UTF-8 cannot carry)"
