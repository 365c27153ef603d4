"""Tool-call parsers on crafted model texts: the whole output parses to the expected content and
calls, and feeding it in any pieces (character by character, random cuts) gives the same."""

from __future__ import annotations

import random

import pytest

from raypaged.text.tool_parsers import (
    TOOL_PARSERS,
    CallArguments,
    CallStarted,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedFunctionParser,
    ParsedOutput,
    RequiredCallsParser,
    ToolCall,
    ToolParser,
)

WEATHER = '{"city": "Paris \\"</tool_call>\\"", "days": [1, 2], "opts": {"metric": true}}'

CASES: list[tuple[type[ToolParser], str, str, list[tuple[str, str]]]] = [
    # Hermes: content before, two calls (the second with arguments first), a closing tag inside a string.
    (HermesToolParser, f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {WEATHER}}}\n</tool_call>\n'
     '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>\n', "Let me look.",
     [("weather", WEATHER), ("f", '{"x": 1}')]),
    (HermesToolParser, "plain <tool text, no call\n", "plain <tool text, no call\n", []),
    (HermesToolParser, "a<tool_call>not json</tool_call> b", "a<tool_call>not json</tool_call> b", []),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": 2', "", [("f", '{"a": [1, {"b": 2')]),
    (HermesToolParser, '<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    # Llama 3: the python tag, `;`-separated calls, parameters as the arguments' key.
    (Llama3JsonToolParser, '<|python_tag|>{"name": "weather", "parameters": ' + WEATHER + '}; {"name": "now", '
     '"parameters": {}}', "", [("weather", WEATHER), ("now", "{}")]),
    (Llama3JsonToolParser, '  {"name": "f", "parameters": {"q": "a;b"}}', "", [("f", '{"q": "a;b"}')]),
    (Llama3JsonToolParser, "  Hello {there}", "  Hello {there}", []),
    (Llama3JsonToolParser, '{"answer": 42}', '{"answer": 42}', []),
    # Mistral: an array after the token, arguments also as a JSON string.
    (MistralToolParser, 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": '
     '"{\\"z\\": 1}"}]', "Sure.", [("a", '{"q": "x"}'), ("b", '{"z": 1}')]),
    (MistralToolParser, '[TOOL_CALLS]{"name": "a", "arguments": {}}', "", [("a", "{}")]),
    (MistralToolParser, "no calls [TOOL_CALLS]here", "no calls[TOOL_CALLS]here", []),
    # What the grammar writes for tool_choice required.
    (RequiredCallsParser, '[{"name":"a","parameters":{"q":"x"}},{"name":"b","parameters":{}}]', "",
     [("a", '{"q":"x"}'), ("b", "{}")]),
]


def _pieces(text: str, cut: str, seed: int = 0) -> list[str]:
    if cut == "whole":
        return [text]
    if cut == "chars":
        return list(text)
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        step = rng.randint(1, 7)
        pieces.append(text[i:i + step])
        i += step
    return pieces


def _fed(parser: ToolParser, pieces: list[str]) -> ParsedOutput:
    out = ParsedOutput()
    for piece in pieces:
        out.add(parser.feed(piece))
    out.add(parser.finish())
    return out


@pytest.mark.parametrize("cut", ["whole", "chars", "random"])
@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parse_whole_and_in_pieces(parser, text, content, calls, cut):
    expected = ParsedOutput(content, [ToolCall(name, arguments) for name, arguments in calls])
    assert parser().parse(text) == expected
    for seed in range(3 if cut == "random" else 1):
        assert _fed(parser(), _pieces(text, cut, seed)) == expected


def test_streamed_events_send_the_name_before_any_arguments():
    parser = HermesToolParser()
    events = [e for c in f'<tool_call>{{"name": "weather", "arguments": {WEATHER}}}</tool_call>'
              for e in parser.feed(c)]
    assert isinstance(events[0], CallStarted) and events[0].name == "weather"
    fragments = [e for e in events[1:] if isinstance(e, CallArguments)]
    assert len(fragments) > 5  # the arguments arrive as they are written, not at the end
    assert "".join(f.text for f in fragments) == WEATHER


def test_named_function_output_is_the_arguments():
    assert NamedFunctionParser("f").parse('{"a": 1}') == ParsedOutput("", [ToolCall("f", '{"a": 1}')])
    assert NamedFunctionParser("f").parse("") == ParsedOutput()
    assert _fed(NamedFunctionParser("f"), list('{"a": 1}')) == NamedFunctionParser("f").parse('{"a": 1}')


def test_registry_uses_vllms_names():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert TOOL_PARSERS["mistral"].needs_special_tokens and not TOOL_PARSERS["hermes"].needs_special_tokens
