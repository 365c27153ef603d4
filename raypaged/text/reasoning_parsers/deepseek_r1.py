"""DeepSeek-R1 (and its distills): the chat template opens `<think>` in the prompt, so the output
is reasoning until `</think>`, then the answer. An output cut before `</think>` is all reasoning
(vLLM's reading too)."""

from __future__ import annotations

from raypaged.text.reasoning_parsers.base import ThinkTagParser


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
