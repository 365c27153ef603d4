"""A chat completion's message as one dict, from a stream's chunks or from the whole answer, so
tests can check that the two agree (content, reasoning_content, finish reason, tool calls)."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk


def streamed_message(chunks: list[ChatCompletionChunk], index: int = 0) -> dict[str, Any]:
    """A stream's deltas of one choice, added up as the whole answer's message would read."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": None, "arguments": ""})
                assert call.function is not None
                if call.function.name is not None:
                    assert entry["name"] is None and entry["arguments"] == "", "the name comes first"
                    entry["name"] = call.function.name
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "finish": finish,
            "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
            "ids": [c["id"] for _, c in sorted(calls.items())]}


def whole_message(response: ChatCompletion, index: int = 0) -> dict[str, Any]:
    """One choice of a whole answer, as streamed_message reads a stream."""
    choice = response.choices[index]
    message = choice.message
    calls = message.tool_calls or []
    return {"content": message.content, "reasoning": (message.model_extra or {}).get("reasoning_content"),
            "finish": choice.finish_reason, "calls": [(c.function.name, c.function.arguments) for c in calls],
            "ids": [c.id for c in calls]}
