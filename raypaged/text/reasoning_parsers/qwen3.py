"""Qwen3 (hybrid thinking): the model opens `<think>` itself when it thinks; an output that does
not start with `<think>` (thinking disabled, `/no_think`) is all answer."""

from __future__ import annotations

from raypaged.text.reasoning_parsers.base import ThinkTagParser


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"
    starts_in_reasoning = False
