"""GrammarConstraint: one request's (one sample's) xgrammar GrammarMatcher, as core's Constraint.

The scheduler calls accept() with each token it appends and is_terminated() after; the engine
fills the request's row of the step's bitmask from it (fill()). Its accepted tokens are always
the request's output tokens (core/structured_output.py), so preemption needs no replay.

With a reasoning gate (StructuredOutput.reasoning_end_token_ids) the matcher sees nothing until
the output has produced the gate's token sequence: until then every token is allowed and
accepted, and the grammar starts with the token after it.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

__all__ = ["GrammarConstraint"]


class GrammarConstraint:
    def __init__(self, compiled: xgr.CompiledGrammar, matcher: xgr.GrammarMatcher | None = None,
                 reasoning_end: tuple[int, ...] = (), recent: tuple[int, ...] | None = None) -> None:
        """reasoning_end: the gate (empty: none). recent: the last tokens seen while the gate is
        closed (fork's state; None once it opened or when there is no gate)."""
        self.compiled = compiled
        # No rollback: tokens are never taken back once accepted (see the module docstring).
        self.matcher = matcher if matcher is not None else xgr.GrammarMatcher(compiled)
        self.reasoning_end = reasoning_end
        self._recent: tuple[int, ...] | None = recent if recent is not None else (
            () if reasoning_end and matcher is None else None)

    @property
    def reasoning(self) -> bool:
        """The gate is still closed: the output has not produced reasoning_end yet."""
        return self._recent is not None

    def accept(self, token_id: int) -> bool:
        if self._recent is not None:
            recent = (*self._recent, token_id)[-len(self.reasoning_end):]
            self._recent = None if recent == self.reasoning_end else recent
            return True
        if self.matcher.is_terminated():
            return False  # nothing follows the stop token
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return self._recent is None and bool(self.matcher.is_terminated())

    def fork(self) -> GrammarConstraint:
        return GrammarConstraint(self.compiled, self.matcher.fork(), self.reasoning_end, self._recent)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32, one bit a token)."""
        if self._recent is not None:
            bitmask[row].fill_(-1)  # every bit set: reasoning is free
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
