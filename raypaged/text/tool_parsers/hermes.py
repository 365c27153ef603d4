"""Hermes' format (Qwen2.5, Qwen3, NousResearch Hermes): each call a JSON object between tags,

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content. A call whose tags hold no call object (no name) is given back
as content, tags and all.
"""

from __future__ import annotations

from raypaged.text.tool_parsers.base import Content, Event, HeldText, ToolParser
from raypaged.text.tool_parsers.json_calls import CallSequence

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        self.outside = HeldText((START,))
        self.closing = HeldText((END,))
        self.calls = CallSequence()

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for char in text:
            call = self.calls.current
            if call is None:
                content, marker = self.outside.push(char)
                if content:
                    events.append(Content(content))
                if marker is not None:
                    self.calls.begin()
                continue
            events += self.calls.push(char)
            _, marker = self.closing.push(char)
            # The closing tag inside a JSON string is text of the arguments.
            if marker is not None and not call.nesting.in_string:
                events += self.calls.close(strip_suffix=END, wrap=(START, END))
        return events

    def finish(self) -> list[Event]:
        events = self.calls.close(wrap=(START, ""))
        self.closing.flush(drop_trailing_space=True)
        rest = self.outside.flush(drop_trailing_space=self.calls.count > 0)
        return events + ([Content(rest)] if rest else [])
