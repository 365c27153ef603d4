"""Mistral's formats: the `[TOOL_CALLS]` token, then either a JSON array of calls (tokenizers
before v11; a lone object is read as one call)

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

or, from tokenizer v11 on, the name and then its arguments, one call per token (`[ARGS]` may
stand between them)

    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{}

Text before the token is content. `[TOOL_CALLS]` is a special token, so this parser asks the
detokenizer to keep special tokens.
"""

from __future__ import annotations

from raypaged.text.tool_parsers.base import CallArguments, CallStarted, Content, Event, HeldText, ToolParser
from raypaged.text.tool_parsers.json_calls import CallArray, JsonNesting

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class _NameThenArguments:
    """`name{…}` (v11): the name until the object opens, then the object's text as arguments."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.name = ""
        self.nesting = JsonNesting()
        self.done = False

    @property
    def started(self) -> bool:
        return self.nesting.depth > 0 or self.done

    def push(self, char: str) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            if char != "{":
                self.name += char
                return []
            events.append(CallStarted(self.index, self.name.strip().removesuffix(ARGS).strip()))
        self.done = self.nesting.push(char) == "close" and self.nesting.depth == 0
        return [*events, CallArguments(self.index, char)]


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self) -> None:
        self.outside = HeldText((MARKER,))
        self.after_marker = False  # the token was seen; the next character says which format
        self.array: CallArray | None = None
        self.named: _NameThenArguments | None = None
        self.count = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for char in text:
            if self.after_marker and not char.isspace():
                self.after_marker = False
                if char in "[{":
                    self.array = CallArray(first_index=self.count)
                else:
                    self.named = _NameThenArguments(self.count)
            if self.array is not None:
                events += self.array.push(char)
                if self.array.done:
                    events += self._close_array()
            elif self.named is not None:
                events += self.named.push(char)
                if self.named.done:
                    self.named, self.count = None, self.count + 1
            elif not self.after_marker:
                content, marker = self.outside.push(char)
                if content:
                    events.append(Content(content))
                self.after_marker = marker is not None
        return events

    def _close_array(self) -> list[Event]:
        assert self.array is not None
        events = self.array.close(wrap=(MARKER, ""))
        self.count = self.array.calls.count
        self.array = None
        return events

    def finish(self) -> list[Event]:
        events = self._close_array() if self.array is not None else []
        if self.named is not None:
            if not self.named.started:  # the name never got its arguments: give it back
                events.append(Content(MARKER + self.named.name))
            else:
                self.count += 1
            self.named = None
        if self.after_marker:
            events.append(Content(MARKER))
        rest = self.outside.flush(drop_trailing_space=self.count > 0)
        return events + ([Content(rest)] if rest else [])
