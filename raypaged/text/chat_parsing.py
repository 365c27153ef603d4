"""Which parsers read a server's chat answers: the `--tool-call-parser`, `--enable-auto-tool-choice`
and `--reasoning-parser` settings of `raypaged serve` and the Serve app (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from raypaged.config import ConfigError
from raypaged.text.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from raypaged.text.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ChatParsing:
    """The server's flags: `--tool-call-parser`, `--enable-auto-tool-choice`, `--reasoning-parser`."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def validate(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"unknown tool_call_parser {self.tool_call_parser!r}; known: {sorted(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"unknown reasoning_parser {self.reasoning_parser!r}; known: "
                              f"{sorted(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice needs a tool_call_parser")

    def reasoning(self) -> ReasoningParser | None:
        return None if self.reasoning_parser is None else REASONING_PARSERS[self.reasoning_parser]()
