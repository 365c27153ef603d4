"""Parsers for output the grammar wrote (tool_choice `required` or a named function), whatever the
model: the output is JSON of the request's own schema (serve/chat_tools.py builds it), not a
model's format.

- named: the output is the named function's arguments object; one call.
- required: the output is an array of `{"name": …, "parameters": {…}}`, one item or more.
"""

from __future__ import annotations

from raypaged.text.tool_parsers.base import CallArguments, CallStarted, Event, ToolParser
from raypaged.text.tool_parsers.json_calls import CallArray


class NamedFunctionParser(ToolParser):
    name = "named_function"

    def __init__(self, function: str) -> None:
        self.function = function
        self.started = False

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        if not self.started:
            self.started = True
            events.append(CallStarted(0, self.function))
        return [*events, CallArguments(0, text)]

    def finish(self) -> list[Event]:
        return []  # an empty output (cut before its first token) makes no call


class RequiredCallsParser(ToolParser):
    name = "required"

    def __init__(self) -> None:
        self.array = CallArray()

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for char in text:
            if not self.array.done:
                events += self.array.push(char)
        return events

    def finish(self) -> list[Event]:
        return self.array.close()
