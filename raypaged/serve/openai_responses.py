"""raypaged.v1 GenerateResponse messages → OpenAI response objects and stream chunks.

One builder per request. Streaming: every message becomes chunks (one per sample delta that
carries text, logprobs or a finish reason) and the stream's last chunk carries the usage: the
OpenAI-style `choices: []` usage chunk when the client asked for stream_options.include_usage,
otherwise the usage rides on the chunk that finishes the last sample. Non-streaming: the deltas
are accumulated into one response. `echo` (completions): the prompt's text, put before each
choice's text (streaming: in the choice's first chunk). Chat choices with a parser (tools,
reasoning: serve/chat_output.py) carry reasoning_content and tool_calls beside the content.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.chat_output import ChatChoiceParser

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}
# JSON has no -inf: a token the model rules out entirely reads as this (vLLM's choice too).
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float | None:
    if math.isnan(logprob):
        return None
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def usage_dict(usage: pb.Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _stop_reason(delta: pb.CompletionDelta) -> int | str | None:
    kind = delta.WhichOneof("stop_reason")
    return None if kind is None else getattr(delta, kind)


class ResponseBuilder:
    """chat: /v1/chat/completions objects; otherwise /v1/completions ones."""

    def __init__(self, *, chat: bool, request_id: str, model: str, tokenizer: Any, n: int,
                 logprobs: bool, include_usage: bool, echo: str | None = None,
                 chat_parser: Callable[[], ChatChoiceParser] | None = None) -> None:
        """chat_parser: makes each chat choice's parser; None: the text is the content."""
        self.chat = chat
        self.parsers = [chat_parser() for _ in range(n)] if chat and chat_parser is not None else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.choices = [_Choice() for _ in range(n)]
        self.usage: dict[str, Any] | None = None
        self._role_sent = [False] * n
        self.echo = echo
        self._echo_sent = [echo is None] * n
        self._streamed_chars = [0] * n  # completion logprobs' text_offset runs on across chunks

    # ---- streaming -----------------------------------------------------------------------------
    def chunks(self, message: pb.GenerateResponse) -> list[dict[str, Any]]:
        chunks = []
        for delta in message.outputs:
            choice = self._chunk_choice(delta)
            if choice is not None:
                chunks.append(self._envelope([choice]))
        if message.HasField("usage"):
            self.usage = usage_dict(message.usage)
            if self.include_usage:
                chunks.append(self._envelope([], usage=self.usage))
            elif chunks:
                chunks[-1]["usage"] = self.usage
            else:  # nothing left to say but the count: a chunk of its own all the same
                chunks.append(self._envelope([], usage=self.usage))
        return chunks

    def _chunk_choice(self, delta: pb.CompletionDelta) -> dict[str, Any] | None:
        finish = FINISH_REASONS.get(delta.finish_reason)
        text = delta.text
        if not self._echo_sent[delta.index]:
            text = (self.echo or "") + text
            self._echo_sent[delta.index] = True
        parsed = None
        if self.parsers is not None:
            parser = self.parsers[delta.index]
            parsed = parser.feed(delta.text)
            if finish is not None:
                parsed.extend(parser.finish())
                finish = parser.finish_reason(finish)
        if (not text if parsed is None else not parsed) and finish is None and not (self.logprobs and delta.logprobs):
            return None  # held-back text (split UTF-8, a possible stop string): nothing to send yet
        logprobs = None
        if self.logprobs:
            logprobs = self._logprobs(delta.logprobs, self._streamed_chars[delta.index])
        self._streamed_chars[delta.index] += len(delta.text)
        choice: dict[str, Any] = {"index": delta.index, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = _stop_reason(delta)
        if self.chat:
            content: dict[str, Any] = {}
            if not self._role_sent[delta.index]:
                content["role"] = "assistant"
                self._role_sent[delta.index] = True
            if parsed is not None:
                content.update(parsed.fields())
            elif delta.text or "role" in content:
                content["content"] = delta.text
            choice["delta"] = content
        else:
            choice["text"] = text
        return choice

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage}

    # ---- one response --------------------------------------------------------------------------
    def add(self, message: pb.GenerateResponse) -> None:
        for delta in message.outputs:
            choice = self.choices[delta.index]
            choice.text.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs)
            finish = FINISH_REASONS.get(delta.finish_reason)
            if finish is not None:
                choice.finish_reason = finish
                choice.stop_reason = _stop_reason(delta)
        if message.HasField("usage"):
            self.usage = usage_dict(message.usage)

    def response(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.choices):
            text = (self.echo or "") + "".join(choice.text)
            logprobs = self._logprobs(choice.logprobs, 0) if self.logprobs else None
            entry: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                     "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
            if self.chat and self.parsers is not None:
                parser = self.parsers[index]
                entry["message"] = parser.message(text)
                entry["finish_reason"] = parser.finish_reason(choice.finish_reason)
            elif self.chat:
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            choices.append(entry)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage}

    # ---- logprobs ------------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprobs(self, entries: list[pb.TokenLogprobs], offset: int) -> dict[str, Any]:
        if self.chat:
            content = []
            for entry in entries:
                token = self._token(entry.token_id)
                top = [{"token": (t := self._token(top.token_id)), "logprob": _finite(top.logprob),
                        "bytes": list(t.encode())} for top in entry.top_logprobs]
                content.append({"token": token, "logprob": _finite(entry.logprob),
                                "bytes": list(token.encode()), "top_logprobs": top})
            return {"content": content}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            token = self._token(entry.token_id)
            tokens.append(token)
            token_logprobs.append(_finite(entry.logprob))
            top_logprobs.append({self._token(top.token_id): _finite(top.logprob)
                                 for top in entry.top_logprobs})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
