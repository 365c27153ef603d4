"""The one check on client text: every string in an OpenAI request body must be real text.

JSON may carry lone UTF-16 surrogates ("\\ud800" is a valid escape), and Python decodes them into
str values that no UTF-8 encoder takes: the tokenizer, protobuf and even the JSON error response
fail on them (HTTP 500). The request body's models run this before any field is read, over the
whole decoded body — every field, nested ones (chat content parts, stream_options) and the keys
and values of free-form ones (logit_bias, response_format, unknown fields) — so a new field can
never skip it. The gRPC API needs no twin: protobuf refuses string fields that are not valid
UTF-8 while parsing (frontend/malformed.py answers INVALID_ARGUMENT).
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

ERROR_TYPE = "invalid_text"  # the pydantic error type; ctx["field"] names the field


def invalid_text_path(value: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], str] | None:
    """The path of the first string in `value` (a decoded JSON document) that is not valid
    Unicode text, with its offending character's code point written out; None when all are."""
    if isinstance(value, str):
        bad = _first_lone_surrogate(value)
        return None if bad is None else (path, f"U+{ord(bad):04X}")
    if isinstance(value, dict):
        for key, item in value.items():
            key_text = str(key)
            found = invalid_text_path(key_text, (*path, "<key>")) or invalid_text_path(item, (*path, key_text))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = invalid_text_path(item, (*path, str(i)))
            if found is not None:
                return found
    return None


def check_client_text(body: Any) -> Any:
    """Returns body unchanged, or raises a pydantic error naming the field (FastAPI answers it
    as a 400 in OpenAI's shape, param = the field). The message never repeats the bad text: it
    could not be encoded into the response either."""
    found = invalid_text_path(body)
    if found is None:
        return body
    path, character = found
    field = ".".join(part for part in path if part != "<key>") or "body"
    what = "a key is not" if path and path[-1] == "<key>" else "not"
    raise PydanticCustomError(
        ERROR_TYPE, "{what} valid text (a lone UTF-16 surrogate, {character}: half a character, "
        "which UTF-8 cannot carry)", {"field": field, "what": what, "character": character})


def _first_lone_surrogate(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return text[e.start]
    return None
