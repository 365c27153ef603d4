"""Tool-call parsers on crafted model texts: the whole output parses to the expected content and
calls, and feeding it in any pieces (character by character, random cuts) gives the same."""

from __future__ import annotations

import json
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
    (MistralToolParser, "no calls [TOOL_CALLS]", "no calls[TOOL_CALLS]", []),
    (MistralToolParser, "[TOOL_CALLS][nope", "[TOOL_CALLS][nope", []),
    # Mistral from tokenizer v11: the name, then the arguments, a token per call.
    (MistralToolParser, 'Sure. [TOOL_CALLS]get_weather{"city": "P{a}ris"}[TOOL_CALLS]now[ARGS]{}', "Sure.",
     [("get_weather", '{"city": "P{a}ris"}'), ("now", "{}")]),
    (MistralToolParser, "[TOOL_CALLS]dangling", "[TOOL_CALLS]dangling", []),
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


KEY_TAILS = ["", '"', "}", "\\"]


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('ab "\\{}[],:;<>/\n\té') for _ in range(rng.randint(0, 6)))
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {f"k{i}" + rng.choice(KEY_TAILS): _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return {"int": rng.randint(-99, 99), "float": rng.random(), "bool": rng.random() < 0.5, "null": None}[kind]


FORMATS = {
    HermesToolParser: lambda calls: "".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n' for n, a in calls),
    Llama3JsonToolParser: lambda calls: "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls),
    MistralToolParser: lambda calls: "[TOOL_CALLS]["
    + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]",
    "mistral-v11": lambda calls: "".join(f"[TOOL_CALLS]{n}{a}" for n, a in calls),
}


@pytest.mark.parametrize("form", list(FORMATS), ids=lambda f: f if isinstance(f, str) else f.name)
def test_random_arguments_survive_any_cut(form):
    """Strings full of braces, quotes, escapes and markers, nested values: the arguments come out
    verbatim, whole or in random pieces."""
    parser = MistralToolParser if form == "mistral-v11" else form
    rng = random.Random(str(form))
    for trial in range(40):
        calls = [(f"f{i}", json.dumps({"a": _random_value(rng)}, ensure_ascii=rng.random() < 0.5))
                 for i in range(rng.randint(1, 3))]
        text = FORMATS[form](calls)
        expected = ParsedOutput("", [ToolCall(n, a) for n, a in calls])
        assert parser().parse(text) == expected, text
        assert _fed(parser(), _pieces(text, "random", trial)) == expected, text
