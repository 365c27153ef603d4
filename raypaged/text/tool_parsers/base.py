"""The tool-call parser seam: a model's text in, content and tool calls out, incrementally.

A parser is a state machine over characters: `feed(text)` takes the next piece of the model's
output and returns the events it makes certain, `finish()` flushes what is left at the end.
Everything is decided one character at a time, so the events do not depend on how the text was
cut: feeding the whole output at once and feeding it token by token give the same calls, the
same arguments text and the same content (what streamed and non-streamed answers rely on).

Events are what OpenAI streams: `Content` (text for the message's content), `CallStarted` (a
tool call's index and function name, sent first) and `CallArguments` (the next fragment of that
call's arguments, a JSON text). The arguments are the model's own JSON text, verbatim, so their
concatenation is what the non-streamed answer carries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStarted | CallArguments


@dataclass
class ToolCall:
    name: str
    arguments: str = ""


@dataclass
class ParsedOutput:
    """The events of a whole output, gathered: what a non-streamed answer carries."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Content):
                self.content += event.text
            elif isinstance(event, CallStarted):
                assert event.index == len(self.calls), "calls start in order"
                self.calls.append(ToolCall(event.name))
            else:
                self.calls[event.index].arguments += event.text


class ToolParser(ABC):
    """One per sample. Subclasses set `name` (vLLM's --tool-call-parser value) and implement
    feed and finish; `needs_special_tokens` says the format's markers are special tokens the
    detokenizer must keep (Mistral's [TOOL_CALLS])."""

    name: str = ""
    needs_special_tokens: bool = False

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events the output so far (plus text) makes certain."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The rest, at the end of the output: held-back content, an unterminated call."""

    def parse(self, text: str) -> ParsedOutput:
        """A whole output (non-streamed answers)."""
        parsed = ParsedOutput()
        parsed.add(self.feed(text))
        parsed.add(self.finish())
        return parsed


class HeldText:
    """Content that may still turn out to be the start of a marker (`<tool_call>`, …) or
    whitespace before one, held until the next character decides.

    Whitespace right before a marker, and at the very end once calls were made, is dropped:
    "Let me look.\\n<tool_call>…" has the content "Let me look.", streamed or not."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self.held = ""
        self._firsts = frozenset(m[0] for m in markers)

    def push(self, char: str) -> tuple[str, str | None]:
        """(content now certain, the marker completed by char or None)."""
        if not self.held and char not in self._firsts and not char.isspace():
            return char, None  # the common case, decided at once
        self.held += char
        for marker in self.markers:
            position = self.held.find(marker)
            if position >= 0:
                before, self.held = self.held[:position], ""
                return before.rstrip(), marker
        # Keep the longest tail that could still grow into a marker, plus the whitespace run
        # before it: everything before that is content for sure.
        keep = len(self.held)
        for start in range(len(self.held)):
            tail = self.held[start:]
            if any(m.startswith(tail) for m in self.markers) or tail.isspace():
                keep = start
                break
        else:
            keep = len(self.held)
        while keep > 0 and self.held[keep - 1].isspace():
            keep -= 1
        certain, self.held = self.held[:keep], self.held[keep:]
        return certain, None

    def flush(self, drop_trailing_space: bool) -> str:
        text, self.held = self.held, ""
        return text.rstrip() if drop_trailing_space else text
