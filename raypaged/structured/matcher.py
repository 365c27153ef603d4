"""GrammarConstraint: one request's (one sample's) xgrammar GrammarMatcher, as core's Constraint.

The scheduler calls accept() with each token it appends and is_terminated() after; the engine
fills the request's row of the step's bitmask from it (fill()). Its accepted tokens are always
the request's output tokens (core/structured_output.py), so preemption needs no replay.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

__all__ = ["GrammarConstraint"]


class GrammarConstraint:
    def __init__(self, compiled: xgr.CompiledGrammar,
                 matcher: xgr.GrammarMatcher | None = None) -> None:
        self.compiled = compiled
        # No rollback: tokens are never taken back once accepted (see the module docstring).
        self.matcher = matcher if matcher is not None else xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return False  # nothing follows the stop token
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fork(self) -> GrammarConstraint:
        return GrammarConstraint(self.compiled, self.matcher.fork())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32, one bit a token)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
