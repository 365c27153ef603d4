"""Applying a step's grammar bitmask to the logits, on the worker's device (torch only).

The bitmask is int32 [R, ceil(V/32)] (xgrammar's layout: token t allowed iff bit t % 32 of word
t // 32 is set), one row per constrained request of the step. Only the sampled rows of those
requests are touched: rows without a grammar pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["apply_grammar_bitmask", "unpack_bitmask"]


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [k, W] -> bool [k, vocab_size], True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    # & 1 after the (arithmetic) shift reads each bit, the sign bit included.
    allowed = (bits.unsqueeze(-1) >> shifts) & 1
    return allowed.view(bits.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, logit_rows: Sequence[int],
                          mask_rows: Sequence[int]) -> None:
    """In place: logits[logit_rows[i], t] = -inf for every token t that bitmask[mask_rows[i]]
    disallows. A row whose mask allows nothing becomes all -inf: it samples some token the
    grammar then rejects, which ends the request as a dead end (never unconstrained)."""
    if not logit_rows:
        return
    bits = _to_device(np.ascontiguousarray(bitmask[list(mask_rows)]), logits.device)
    allowed = unpack_bitmask(bits, logits.shape[1])
    rows = _to_device(np.array(logit_rows, dtype=np.int64), logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # non_blocking: a blocking copy would wait for the whole stream (the forward queued before
    # it), and the step's host work after it would no longer overlap the GPU. From pageable
    # memory the source is staged before the call returns, so the array may go at once.
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
