"""Where a constrained chat answer's grammar starts when the server parses reasoning.

With `--reasoning-parser`, a request under a grammar (response_format, structured_outputs, an
enforced tool call) may reason first, as in vLLM: the grammar applies from after `</think>`
(StructuredOutput.reasoning_end_token_ids), and the reasoning parser splits the output as for
any other request. A prompt that already closed the reasoning — a template that turns thinking
off writes an empty `<think></think>` into it — needs no gate: the grammar starts at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raypaged.text.reasoning_parsers.base import THINK_END, THINK_START


def reasoning_gate(tokenizer: Any, prompt_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The token ids of `</think>` unless the prompt's last think tag is a closing one; ()."""
    end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
    start = tuple(tokenizer.encode(THINK_START, add_special_tokens=False))
    if not end:
        return ()
    return () if _last_index(prompt_token_ids, end) > _last_index(prompt_token_ids, start) else end


def _last_index(tokens: Sequence[int], pattern: tuple[int, ...]) -> int:
    """Where `pattern` last starts in `tokens`; -1 if nowhere."""
    n = len(pattern)
    for i in range(len(tokens) - n, -1, -1):
        if tuple(tokens[i:i + n]) == pattern:
            return i
    return -1
