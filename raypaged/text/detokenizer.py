"""Incremental detokenization: token ids arrive a few at a time, text leaves as settled deltas.

Decoding each new token on its own is wrong in two ways: a character's UTF-8 bytes can be split
across byte-level tokens (each half decodes to U+FFFD), and SentencePiece-style tokenizers drop
or add a leading space depending on what precedes a token. So, as vLLM does, we decode a small
window — some already-emitted tokens as context, then the new ones — and emit only the text
past the context. Trailing U+FFFDs are held back until a later token shows whether they were
parts of a character; everything before them is final.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Already-emitted tokens decoded before the new ones, so that a leading space or a merge comes
# out as when the whole sequence is decoded (more than one: some may decode to nothing, like
# skipped special tokens, and a Strip decoder would then eat the new text's leading space).
CONTEXT_TOKENS = 5
# The window is trimmed once this many tokens before its start have no further use.
_TRIM_AT = 64


class IncrementalDetokenizer:
    """One sample's text. `push(new_ids)` returns the newly settled text; `flush()` returns what
    is still held back (at the end of the sample: bytes that never became a character). Joined,
    the deltas equal decoding the whole output in the context of the prompt."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # ids[prefix:read]: context already emitted; ids[read:]: tokens whose text is (partly)
        # pending. emitted_past_read counts characters of the pending part already released.
        self._ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        # The context must start on a character boundary: a window starting inside a character
        # decodes its first bytes as U+FFFD, and a byte-fallback decoder then spoils the whole run
        # of byte tokens after them, the output's too.
        while self._ids and self._decode(self._ids).startswith(REPLACEMENT_CHAR):
            del self._ids[0]
        self._prefix = 0
        self._read = len(self._ids)
        # Offsets where the text was settled: character boundaries, so a window may start there
        # (one starting inside a character would decode its first bytes as U+FFFD).
        self._boundaries: list[int] = [0]
        self._emitted_past_read = 0
        self._prefix_text: str | None = None
        self.num_output_tokens = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Everything still held back; call once, when the sample ends."""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces (" ." -> "."): it depends on what follows, so windows would not
        # join up. vLLM streams without it too.
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _advance(self, final: bool) -> str:
        ids = self._ids
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix:self._read])
        text = self._decode(ids[self._prefix:])
        # Trailing U+FFFDs may be the first bytes of a character a later token completes: a
        # byte-level decoder makes one U+FFFD of an incomplete tail, a byte-fallback decoder one
        # per byte of the whole run of byte tokens. Hold back the run; the text before it is final.
        end = len(text.rstrip(REPLACEMENT_CHAR)) if not final else len(text)
        pending_char = end < len(text)
        start = len(self._prefix_text) + self._emitted_past_read
        delta = text[start:end] if end > start else ""
        if pending_char:
            self._emitted_past_read += len(delta)
            return delta
        # Settled: the window moves on to the latest boundary that leaves CONTEXT_TOKENS of context.
        self._read = len(ids)
        boundaries = self._boundaries
        boundaries.append(self._read)
        while len(boundaries) > 1 and self._read - boundaries[1] >= CONTEXT_TOKENS:
            boundaries.pop(0)
        self._prefix = boundaries[0]
        self._emitted_past_read = 0
        self._prefix_text = None
        if self._prefix >= _TRIM_AT:
            shift = self._prefix
            del ids[:shift]
            self._read -= shift
            self._boundaries = [b - shift for b in boundaries]
            self._prefix = 0
        return delta
