"""Mistral's format: the `[TOOL_CALLS]` token, then a JSON array of calls,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

(a lone object after the token is read as one call). Text before the token is content.
`[TOOL_CALLS]` is a special token, so this parser asks the detokenizer to keep special tokens.
"""

from __future__ import annotations

from raypaged.text.tool_parsers.base import Content, Event, HeldText, ToolParser
from raypaged.text.tool_parsers.json_calls import CallArray

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self) -> None:
        self.outside = HeldText((MARKER,))
        self.array: CallArray | None = None
        self.count = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for char in text:
            if self.array is None:
                content, marker = self.outside.push(char)
                if content:
                    events.append(Content(content))
                if marker is not None:
                    self.array = CallArray(first_index=self.count)
                continue
            events += self.array.push(char)
            if self.array.done:
                events += self._close()
        return events

    def _close(self) -> list[Event]:
        assert self.array is not None
        events = self.array.close(wrap=(MARKER, ""))
        self.count = self.array.calls.count
        self.array = None
        return events

    def finish(self) -> list[Event]:
        events = self._close() if self.array is not None else []
        rest = self.outside.flush(drop_trailing_space=self.count > 0)
        return events + ([Content(rest)] if rest else [])
