"""The one check on OpenAI request bodies: every string, in any field, must be real text.

JSON may carry lone UTF-16 surrogates ("\\ud800" is a valid escape), which the tokenizer,
protobuf and even the JSON error response fail on (HTTP 500). The body models run this before
any field is read, over the whole decoded body — every field, nested ones (chat content parts,
stream_options) and the keys and values of free-form ones (logit_bias, response_format,
unknown fields) — so a new field can never skip it. The check itself is core/text_check.py.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

from raypaged.core.text_check import KEY, invalid_text_message, invalid_text_path

ERROR_TYPE = "invalid_text"  # the pydantic error type; ctx["field"] names the field


def check_client_text(body: Any) -> Any:
    """Returns body unchanged, or raises a pydantic error whose ctx names the field (FastAPI
    answers it as a 400 in OpenAI's shape, param = the field). The message never repeats the
    bad text: it could not be encoded into the response either."""
    found = invalid_text_path(body)
    if found is None:
        return body
    path, character = found
    field = ".".join(part for part in path if part != KEY) or "body"
    message = invalid_text_message(character, key=bool(path) and path[-1] == KEY)
    raise PydanticCustomError(ERROR_TYPE, "{message}", {"field": field, "message": message})
