"""Reasoning parsers: `<think>…</think>` → `reasoning_content`, the rest → `content`.

`REASONING_PARSERS` maps vLLM's `--reasoning-parser` names to the parsers (one file each); the
seam is base.ReasoningParser.
"""

from __future__ import annotations

from raypaged.text.reasoning_parsers.base import Answer, Reasoning, ReasoningEvent, ReasoningParser
from raypaged.text.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from raypaged.text.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}

__all__ = ["REASONING_PARSERS", "Answer", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser",
           "Reasoning", "ReasoningEvent", "ReasoningParser"]
