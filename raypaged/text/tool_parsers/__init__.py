"""Tool-call parsers: a model's output → content and tool calls, streamed or whole.

`TOOL_PARSERS` maps vLLM's `--tool-call-parser` names to the parsers of the formats models
ship (one file each); `forced.py` reads what the grammar wrote for tool_choice `required` or a
named function. The seam is base.ToolParser.
"""

from __future__ import annotations

from raypaged.text.tool_parsers.base import (
    CallArguments,
    CallStarted,
    Content,
    Event,
    ParsedOutput,
    ToolCall,
    ToolParser,
)
from raypaged.text.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser
from raypaged.text.tool_parsers.hermes import HermesToolParser
from raypaged.text.tool_parsers.llama3_json import Llama3JsonToolParser
from raypaged.text.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["TOOL_PARSERS", "CallArguments", "CallStarted", "Content", "Event", "HermesToolParser",
           "Llama3JsonToolParser", "MistralToolParser", "NamedFunctionParser", "ParsedOutput",
           "RequiredCallsParser", "ToolCall", "ToolParser"]
