"""One chat choice's text → OpenAI's message (reasoning_content, content, tool_calls), streamed
as deltas or whole.

The reasoning parser (if the server has one) reads the output first; what it calls the answer
goes on to the tool parser (if the request's tools call for one: serve/chat_tools.py). Both are
fed the same text either way, so a streamed answer's deltas add up to the whole one's message;
only the tool calls' ids differ (each answer makes its own).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from raypaged.text.reasoning_parsers import Reasoning, ReasoningParser
from raypaged.text.tool_parsers import CallArguments, CallStarted, Content, Event, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's streamed tool_calls entries

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def extend(self, later: ChatDelta) -> None:
        """later's text and calls after this delta's, one entry per call index."""
        self.reasoning += later.reasoning
        self.content += later.content
        by_index = {entry["index"]: entry for entry in self.calls}
        for entry in later.calls:
            mine = by_index.get(entry["index"])
            if mine is None:
                self.calls.append(entry)
                by_index[entry["index"]] = entry
            else:
                mine["function"]["arguments"] += entry["function"]["arguments"]

    def fields(self) -> dict[str, Any]:
        """The delta's fields as a stream chunk carries them (only those with something to say)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = self.calls
        return out


class ChatChoiceParser:
    """parallel: False keeps only the first tool call (`parallel_tool_calls: false`)."""

    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None,
                 parallel: bool = True) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.parallel = parallel
        self.ids: list[str] = []  # the calls made, by index
        self.arguments: list[str] = []
        self.names: list[str] = []

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str) -> ChatDelta:
        return self._delta(text, final=False)

    def finish(self) -> ChatDelta:
        return self._delta("", final=True)

    def _delta(self, text: str, final: bool) -> ChatDelta:
        delta = ChatDelta()
        answer = text
        if self.reasoning is not None:
            answer = ""
            for event in self.reasoning.feed(text) + (self.reasoning.finish() if final else []):
                if isinstance(event, Reasoning):
                    delta.reasoning += event.text
                else:
                    answer += event.text
        if self.tools is None:
            delta.content = answer
            return delta
        events = self.tools.feed(answer) + (self.tools.finish() if final else [])
        self._apply(events, delta)
        return delta

    def _apply(self, events: list[Event], delta: ChatDelta) -> None:
        entries: dict[int, dict[str, Any]] = {}
        for event in events:
            if isinstance(event, Content):
                delta.content += event.text
                continue
            if not self.parallel and event.index > 0:
                continue
            if isinstance(event, CallStarted):
                self.ids.append(new_call_id())
                self.names.append(event.name)
                self.arguments.append("")
                entries[event.index] = {"index": event.index, "id": self.ids[event.index], "type": "function",
                                        "function": {"name": event.name, "arguments": ""}}
            elif isinstance(event, CallArguments):
                self.arguments[event.index] += event.text
                entry = entries.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += event.text
        delta.calls = list(entries.values())

    def message(self, text: str) -> dict[str, Any]:
        """A whole output as the non-streamed message."""
        first, last = self.feed(text), self.finish()
        content = first.content + last.content
        message: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            message["reasoning_content"] = (first.reasoning + last.reasoning) or None
        message["content"] = content if content or not self.made_calls else None
        if self.made_calls:
            message["tool_calls"] = [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                for call_id, name, arguments in zip(self.ids, self.names, self.arguments)]
        return message

    def finish_reason(self, finish: str | None) -> str | None:
        """A stop after tool calls is OpenAI's "tool_calls"; a cut (length) stays what it is."""
        return "tool_calls" if finish == "stop" and self.made_calls else finish
