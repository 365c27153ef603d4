"""Tools in /v1/chat/completions: the request's `tools` and `tool_choice` checked, the grammar that
enforces `required` and named choices, and the parsers each choice of the answer is read with.

vLLM's semantics: `tool_choice` defaults to `auto` when tools are given; `auto` needs the server
started with `--enable-auto-tool-choice` and a `--tool-call-parser` (otherwise a 400 saying so);
`none` answers plain content (the tools still reach the template); `required` and a named
function are enforced with a JSON-schema grammar for any model, template or parser — the output
is then that JSON (an array of `{"name", "parameters"}` items, or the named function's
arguments), read as such rather than in the model's format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from raypaged.core.errors import InvalidRequestError
from raypaged.text.chat_parsing import ChatParsing
from raypaged.text.tool_parsers import TOOL_PARSERS, NamedFunctionParser, RequiredCallsParser, ToolParser

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """OpenAI's tool list, each checked: `{"type": "function", "function": {"name", "description"?,
    "parameters"?}}` with parameters an object schema."""
    checked: list[dict[str, Any]] = []
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(f"{where} must be an object of type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' "
                                      f"or '.'; got {name!r}")
        if not isinstance(function.get("description", ""), str):
            raise InvalidRequestError(f"{where}.function.description must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
                or not isinstance(parameters.get("properties", {}), dict)):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema of an object "
                                      f"(type 'object', properties an object); got {parameters!r}")
        checked.append({"type": "function", "function": {**function, "parameters": parameters}})
        names.append(name)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidRequestError(f"tools name the function(s) {duplicates} more than once")
    return checked


@dataclass(frozen=True)
class ToolPlan:
    """What one request does with its tools: kind is none, auto, required or named."""

    kind: str
    tools: list[dict[str, Any]]
    function: str | None = None  # the named one
    parser_name: str | None = None  # auto's --tool-call-parser
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[Any] | None, choice: Any, parallel: bool, parsing: ChatParsing) -> ToolPlan:
        checked = check_tools(tools or [])
        if choice is None:
            choice = "auto" if checked else "none"
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise InvalidRequestError('a named tool_choice is {"type": "function", "function": '
                                          '{"name": ...}}')
            known = [t["function"]["name"] for t in checked]
            if name not in known:
                raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not "
                                          f"in tools ({known or 'none given'})")
            return cls("named", checked, function=name, parallel=parallel)
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or a named "
                                      f"function; got {choice!r}")
        if choice != "none" and not checked:
            raise InvalidRequestError(f"tool_choice {choice!r} needs a non-empty tools list")
        if choice == "auto" and not (parsing.enable_auto_tool_choice and parsing.tool_call_parser):
            raise InvalidRequestError(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                "--tool-call-parser; send tool_choice 'required' or a named function (enforced "
                "for any model), or 'none'")
        return cls(choice, checked, parser_name=parsing.tool_call_parser if choice == "auto" else None,
                   parallel=parallel)

    @property
    def enforced(self) -> bool:
        return self.kind in ("required", "named")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the grammar holds the output to, for required and named choices."""
        if self.kind == "named":
            return self._parameters(self.function)
        if self.kind != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": t["function"]["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def _parameters(self, name: str | None) -> dict[str, Any]:
        return next(t["function"]["parameters"] for t in self.tools if t["function"]["name"] == name)

    def schema_text(self) -> str | None:
        schema = self.schema()
        return None if schema is None else json.dumps(schema, sort_keys=True)

    @property
    def parses(self) -> bool:
        """The answer is read for tool calls (new_parser gives a parser)."""
        return self.enforced or (self.kind == "auto" and self.parser_name is not None)

    def new_parser(self) -> ToolParser | None:
        """A parser for one choice of the answer; None: the answer is plain content."""
        if self.kind == "named":
            assert self.function is not None
            return NamedFunctionParser(self.function)
        if self.kind == "required":
            return RequiredCallsParser()
        if self.kind == "auto" and self.parser_name is not None:
            return TOOL_PARSERS[self.parser_name]()
        return None

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser's markers are special tokens ([TOOL_CALLS]) the detokenizer must keep."""
        return self.kind == "auto" and self.parser_name is not None and \
            TOOL_PARSERS[self.parser_name].needs_special_tokens
