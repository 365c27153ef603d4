"""The reasoning-parser seam: a reasoning model's output → `reasoning_content` and `content`.

Like the tool parsers (text/tool_parsers/base.py), a parser is a state machine fed the output
piece by piece, deciding one character at a time, so streamed and whole outputs split the same
way. `ThinkTagParser` is the `<think>…</think>` machine both shipped parsers are made of; they
differ in where the output starts: inside the reasoning (DeepSeek-R1, whose template opens the
`<think>` in the prompt) or in the answer unless the output opens `<think>` itself (Qwen3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from raypaged.text.tool_parsers.base import HeldText

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Answer:
    text: str


ReasoningEvent = Reasoning | Answer


class ReasoningParser(ABC):
    """One per sample; `name` is vLLM's --reasoning-parser value."""

    name: str = ""

    @abstractmethod
    def feed(self, text: str) -> list[ReasoningEvent]:
        """The events the output so far (plus text) makes certain."""

    @abstractmethod
    def finish(self) -> list[ReasoningEvent]:
        """What was held back, at the end of the output."""

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole output: (the reasoning, None if there was none; the answer)."""
        reasoning: list[str] = []
        answer: list[str] = []
        for event in [*self.feed(text), *self.finish()]:
            (reasoning if isinstance(event, Reasoning) else answer).append(event.text)
        return ("".join(reasoning) if reasoning else None), "".join(answer)


class ThinkTagParser(ReasoningParser):
    """starts_in_reasoning: the output is reasoning from its first character (an opening
    `<think>` there is dropped) until `</think>`; otherwise it is the answer unless it opens
    with `<think>`. Whitespace around the tags is dropped; an output cut before `</think>` is
    all reasoning."""

    starts_in_reasoning = False

    def __init__(self) -> None:
        self.state = "start"  # start, opened (<think>), reasoning, after (</think>), answer
        self.start = ""
        self.reasoning = HeldText((THINK_END,))

    def feed(self, text: str) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        for char in text:
            if self.state == "start":
                events += self._start(char)
            elif self.state == "reasoning":
                events += self._reason(char)
            elif self.state == "opened":  # whitespace after <think> is not reasoning
                if not char.isspace():
                    self.state = "reasoning"
                    events += self._reason(char)
            elif self.state == "after":
                if not char.isspace():
                    self.state = "answer"
                    events.append(Answer(char))
            else:
                events.append(Answer(char))
        return _merged(events)

    def _start(self, char: str) -> list[ReasoningEvent]:
        self.start += char
        begun = self.start.lstrip()
        if not begun or (THINK_START.startswith(begun) and begun != THINK_START):
            return []
        raw, self.start = self.start, ""
        if begun.startswith(THINK_START):
            self.state = "opened"
            return []
        if self.starts_in_reasoning:
            self.state = "reasoning"
            return [e for c in raw for e in self._reason(c)]
        self.state = "answer"
        return [Answer(raw)]

    def _reason(self, char: str) -> list[ReasoningEvent]:
        certain, marker = self.reasoning.push(char)
        events: list[ReasoningEvent] = [Reasoning(certain)] if certain else []
        if marker is not None:
            self.state = "after"
        return events

    def finish(self) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        if self.state == "start" and self.start:
            kind = Reasoning if self.starts_in_reasoning else Answer
            if self.start.strip():
                events.append(kind(self.start))
        elif self.state == "reasoning":
            held = self.reasoning.flush(drop_trailing_space=True)
            if held:
                events.append(Reasoning(held))
        self.start = ""
        return events


def _merged(events: list[ReasoningEvent]) -> list[ReasoningEvent]:
    out: list[ReasoningEvent] = []
    for event in events:
        if out and type(out[-1]) is type(event):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out
