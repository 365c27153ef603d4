"""Llama 3.1 / 3.2 / 3.3's JSON tool calls: an output that starts (optionally after the
`<|python_tag|>` token) with a JSON object is one or more calls separated by `;`,

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

and any other output is content. An object without a name is given back as content; text after
the calls, too.
"""

from __future__ import annotations

from raypaged.text.tool_parsers.base import Content, Event, ToolParser
from raypaged.text.tool_parsers.json_calls import CallSequence

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        self.mode = "start"  # start, between (calls), call, content
        self.start = ""  # the output's beginning, until it shows what it is
        self.calls = CallSequence()

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for char in text:
            if self.mode == "start":
                events += self._start(char)
            elif self.mode == "content":
                events.append(Content(char))
            elif self.mode == "between":
                if char == "{":
                    self.mode = "call"
                    self.calls.begin()
                    events += self.calls.push(char)
                elif not (char.isspace() or char == ";"):
                    self.mode = "content"
                    events.append(Content(char))
            else:
                events += self.calls.push(char)
                call = self.calls.current
                assert call is not None
                if call.done or call.failed:
                    self.mode = "between" if call.done else "content"
                    events += self.calls.close()
        return _merged(events)

    def _start(self, char: str) -> list[Event]:
        self.start += char
        begun = self.start.lstrip()
        if not begun or PYTHON_TAG.startswith(begun):
            return []
        if begun.startswith(PYTHON_TAG):
            rest = begun.removeprefix(PYTHON_TAG)
            if not rest.strip():
                return []
            begun = rest.lstrip()
        raw, self.start = self.start, ""
        if begun.startswith("{"):
            self.mode = "between"
            return self.feed(begun)
        self.mode = "content"
        return [Content(begun if PYTHON_TAG in raw else raw)]

    def finish(self) -> list[Event]:
        events = self.calls.close()
        if self.mode == "start" and self.start.strip() and PYTHON_TAG not in self.start:
            events.append(Content(self.start))
        self.start = ""
        return events


def _merged(events: list[Event]) -> list[Event]:
    """Neighbouring content characters as one event."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, Content) and out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + event.text)
        else:
            out.append(event)
    return out
