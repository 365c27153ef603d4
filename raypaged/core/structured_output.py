"""StructuredOutput: what a request's output must conform to (constrained decoding).

Pure Python, validated on construction for what can be checked without a grammar engine (one
kind set, a JSON schema that parses as a JSON object, non-empty choices). Whether a schema, regex
or EBNF grammar is one the grammar engine accepts is checked by raypaged/structured/ when the
engine takes the request, before it is queued. `Constraint` is the face of a request's grammar
state that the scheduler sees (raypaged/structured/matcher.py implements it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from raypaged.core.errors import InvalidRequestError

__all__ = ["StructuredOutput", "Constraint", "DEAD_END"]

# The stop_reason of a request ended because its grammar allows no next token (finish reason
# "abort"): never an unconstrained token instead.
DEAD_END = "structured_output_dead_end"

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: `json` (a JSON schema, as JSON text or a dict), `json_object` (any JSON
    value, as OpenAI's json_object), `regex`, `choice` (one of these strings),
    `grammar` (EBNF / GBNF text). Hashable: `key` identifies the compiled grammar.

    reasoning_end_token_ids: the grammar applies from after the first appearance of this token
    sequence in the output (a reasoning model's `</think>`, so it may reason first, as vLLM
    does with a reasoning parser); the tokens before it, the sequence included, are free.
    Empty: from the first token. Not part of `key`: the grammar is the same."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        schema: Any = self.json
        if schema is not None and not isinstance(schema, str):
            try:  # a dict from a caller: stored as canonical text so the spec stays hashable
                schema = json.dumps(schema, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"structured output json schema is not JSON: {e}") from None
            object.__setattr__(self, "json", schema)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        object.__setattr__(self, "reasoning_end_token_ids", tuple(self.reasoning_end_token_ids))
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what the compiled grammar is cached by (per tokenizer)."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))

    def validate(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError("structured output must set exactly one of "
                                      f"{', '.join(_KINDS)}; got {set_kinds or 'none'}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"structured output json schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("structured output json schema must be a JSON object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured output {name} must be a non-empty string")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured output choice must be non-empty strings, at least one")
        if not all(isinstance(t, int) and t >= 0 for t in self.reasoning_end_token_ids):
            raise InvalidRequestError("structured output reasoning_end_token_ids must be token ids (>= 0)")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutput:
        """From vLLM's `structured_outputs` shape ({"json": …} / {"regex": …} / …)."""
        unknown = set(value) - {*_KINDS, "reasoning_end_token_ids"}
        if unknown:
            raise InvalidRequestError(f"unknown structured output field(s): {sorted(unknown)}")
        return cls(**value)


class Constraint(Protocol):
    """A request's grammar state, advanced by the tokens the scheduler appends.

    Contract: the tokens accepted are exactly the request's output tokens so far (so a
    preempted request recomputes with its state as is: nothing to replay)."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (a dead end)."""

    def is_terminated(self) -> bool:
        """The grammar is complete and accepted its stop token: the request is done."""

    def fork(self) -> Constraint:
        """An independent copy of this state (n > 1: each sample its own)."""
