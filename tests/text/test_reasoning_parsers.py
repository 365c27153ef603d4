"""Reasoning parsers on crafted texts: `<think>` splits the same whole and fed in pieces."""

from __future__ import annotations

import pytest

from raypaged.text.reasoning_parsers import (
    REASONING_PARSERS,
    Answer,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    Reasoning,
)

# text, deepseek_r1's (reasoning, content), qwen3's
CASES = [
    ("<think>\nhmm, 2 + 2\n</think>\n\nIt is 4.", ("hmm, 2 + 2", "It is 4."), ("hmm, 2 + 2", "It is 4.")),
    ("hmm, 2 + 2</think>It is 4.", ("hmm, 2 + 2", "It is 4."), (None, "hmm, 2 + 2</think>It is 4.")),
    ("It is 4.", ("It is 4.", ""), (None, "It is 4.")),
    ("<think>cut short", ("cut short", ""), ("cut short", "")),
    ("<thin", ("<thin", ""), (None, "<thin")),
    ("<think></think>4 < 5 <think>", (None, "4 < 5 <think>"), (None, "4 < 5 <think>")),
    ("", (None, ""), (None, "")),
]


def _fed(parser, text: str) -> tuple[str | None, str]:
    events = [e for c in text for e in parser.feed(c)] + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    answer = "".join(e.text for e in events if isinstance(e, Answer))
    return (reasoning or None), answer


@pytest.mark.parametrize("text, r1, qwen3", CASES)
def test_split_whole_and_char_by_char(text, r1, qwen3):
    for parser, expected in ((DeepSeekR1ReasoningParser, r1), (Qwen3ReasoningParser, qwen3)):
        assert parser().parse(text) == expected
        assert _fed(parser(), text) == expected


def test_registry_uses_vllms_names():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
