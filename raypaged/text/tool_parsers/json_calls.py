"""Tool calls written as JSON objects, `{"name": …, "arguments": {…}}`, read a character at a time.

`CallObject` follows one object's top level (strings, escapes and nesting are tracked, nothing
is parsed twice): the function name once its string closes, and the arguments value's text as
far as it has arrived. `CallSequence` turns a run of such objects (an array, or objects
separated by `;` or by markers) into events: the name first, then argument fragments.
"""

from __future__ import annotations

import json

from raypaged.text.tool_parsers.base import CallArguments, CallStarted, Content, Event

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes / Mistral say arguments, Llama 3 parameters


class JsonNesting:
    """Where JSON text stands after each character: inside a string or not, and how deep in
    brackets. push says what the character did: "string_end", "open", "close" or None."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False

    def push(self, char: str) -> str | None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                return "string_end"
            return None
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
            return "open"
        elif char in "}]":
            self.depth -= 1
            return "close"
        return None


class CallObject:
    """One `{...}` from its opening brace. `failed`: the text is not a call object (then the
    caller decides what it was); `done`: the object closed."""

    def __init__(self) -> None:
        self.text = ""
        self.nesting = JsonNesting()
        self.expect = "open"  # open, key, colon, value, after
        self.token_start = 0  # where the key or value being read began
        self.key: str | None = None
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.done = False
        self.failed = False

    def push(self, char: str) -> None:
        i = len(self.text)
        self.text += char  # all of it, after the object too: a call given back keeps its words
        if self.done or self.failed:
            return
        nesting = self.nesting
        if nesting.in_string or nesting.depth >= 2:
            did = nesting.push(char)
            if nesting.depth == 1 and did == "string_end":
                self._token_end(i + 1)
            elif nesting.depth == 1 and did == "close":
                self._value_end(i + 1)
            return
        self._top_level(char, i)

    def _top_level(self, char: str, i: int) -> None:
        if char.isspace() and self.expect != "value_primitive":
            return
        expect = self.expect
        if expect == "open":
            if char == "{":
                self.nesting.push(char)
                self.expect = "key"
            else:
                self.failed = True
        elif expect == "key":
            if char == '"':
                self.nesting.push(char)
                self.token_start = i
            elif char == "}" and self.key is None:
                self.nesting.push(char)
                self.done = True
            else:
                self.failed = True
        elif expect == "colon":
            self._expect(char == ":", "value")
        elif expect == "value":
            self.token_start = i
            if self.key in ARGUMENT_KEYS:
                self.args_start = i
            if char == '"' or char in "{[":
                self.nesting.push(char)
            else:
                self.expect = "value_primitive"
        elif expect == "value_primitive":
            if char in ",}":
                self._value_end(i)
                self._after(char)
        else:  # after
            self._after(char)

    def _expect(self, ok: bool, then: str) -> None:
        if ok:
            self.expect = then
        else:
            self.failed = True

    def _after(self, char: str) -> None:
        if char == ",":
            self.expect = "key"
        elif char == "}":
            self.nesting.push(char)
            self.done = True
        else:
            self.failed = True

    def _token_end(self, end: int) -> None:
        if self.expect == "key":
            self.key = json.loads(self.text[self.token_start:end])
            self.expect = "colon"
        else:
            self._value_end(end)

    def _value_end(self, end: int) -> None:
        value = self.text[self.token_start:end].strip()
        if self.key == "name":
            try:
                name = json.loads(value)
            except ValueError:
                name = None
            if not isinstance(name, str):
                self.failed = True
                return
            self.name = name
        elif self.key in ARGUMENT_KEYS:
            self.args_end = self.token_start + len(value)
        self.expect = "after"

    def arguments(self) -> str:
        """The arguments text so far: an object or array value as far as it has arrived (all of
        it is inside the value until it closes), a string value (arguments JSON-encoded in a
        string) decoded once whole; "{}" for an object that closed without arguments."""
        if self.args_start is None:
            return "{}" if self.done else ""
        if self.args_end is None:
            opening = self.text[self.args_start]
            return self.text[self.args_start:] if opening in "{[" else ""
        value = self.text[self.args_start:self.args_end]
        if value.startswith('"'):
            decoded = json.loads(value)
            return decoded if isinstance(decoded, str) else value
        return value


class CallSequence:
    """Numbers the calls and turns each object's progress into events. `push` feeds the current
    object; `close` ends it (at a separator or the end of the output): a call whose name never
    arrived is given back as content, in its own words."""

    def __init__(self) -> None:
        self.count = 0
        self.current: CallObject | None = None
        self.started = False  # the current call's name was sent
        self._sent = 0

    def begin(self) -> None:
        self.current, self.started, self._sent = CallObject(), False, 0

    def push(self, char: str) -> list[Event]:
        call = self.current
        assert call is not None
        call.push(char)
        return self._progress(call)

    def _progress(self, call: CallObject) -> list[Event]:
        events: list[Event] = []
        if not self.started and call.name is not None and not call.failed:
            self.started = True
            events.append(CallStarted(self.count, call.name))
        if self.started:
            arguments = call.arguments()
            if len(arguments) > self._sent:
                events.append(CallArguments(self.count, arguments[self._sent:]))
                self._sent = len(arguments)
        return events

    def close(self, strip_suffix: str = "", wrap: tuple[str, str] = ("", "")) -> list[Event]:
        """strip_suffix: the closing marker that ended the call, pushed with it; wrap: the
        markers around a call given back as content."""
        call, self.current = self.current, None
        if call is None:
            return []
        if not self.started:
            text = call.text.removesuffix(strip_suffix)
            return [Content(wrap[0] + text + wrap[1])] if text.strip() or any(wrap) else []
        events = self._progress(call)
        self.count += 1
        return events


class CallArray:
    """`[call, call, …]` (or one bare call object), a character at a time; `done` once it closed,
    or once a character showed it is not one (that character is given back as content)."""

    def __init__(self, first_index: int = 0) -> None:
        self.calls = CallSequence()
        self.calls.count = self.first_index = first_index
        self.state = "open"  # open, items, object, sep
        self.bare = False  # one object, no brackets
        self.raw = ""
        self.done = False

    def push(self, char: str) -> list[Event]:
        self.raw += char
        if self.state == "object":
            events = self.calls.push(char)
            call = self.calls.current
            assert call is not None
            if call.failed:
                self.done = True
            elif call.done:
                events += self.calls.close()
                self.state = "sep"
                self.done = self.bare
            return events
        if char.isspace():
            return []
        if self.state in ("open", "items") and char == "{":
            self.bare = self.state == "open"
            self.state = "object"
            self.calls.begin()
            return self.calls.push(char)
        if self.state == "open" and char == "[":
            self.state = "items"
        elif self.state == "sep" and char == ",":
            self.state = "items"
        elif self.state in ("items", "sep") and char == "]":
            self.done = True
        else:
            self.done = True
            # With no call made, close() gives everything back; after one, only the rest.
            return [] if self._nothing_started() else [Content(char)]
        return []

    def _nothing_started(self) -> bool:
        return self.calls.count == self.first_index and not self.calls.started

    def close(self, wrap: tuple[str, str] = ("", "")) -> list[Event]:
        if self._nothing_started():
            self.calls.current = None
            return [Content(wrap[0] + self.raw + wrap[1])] if self.raw or any(wrap) else []
        return self.calls.close()
