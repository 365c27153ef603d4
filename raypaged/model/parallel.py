"""Tensor-parallel state and collectives, all in one place (gpt-fast style).

Every TP layer asks this module for its rank and world size and calls its collectives, so the
whole model runs unchanged at tp = 1 (every collective is then a no-op) and at tp = N (the worker
calls `init_tensor_parallel` after `torch.distributed.init_process_group`).

The state is per process: one worker process is one TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelState:
    rank: int = 0
    world_size: int = 1
    # None with world_size > 1 means "slice weights like rank `rank` but never communicate":
    # enough to load a shard (tests, offline inspection), an error if a collective is reached.
    group: dist.ProcessGroup | None = None


_state = TensorParallelState()


def init_tensor_parallel(
    rank: int | None = None,
    world_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> TensorParallelState:
    """Set this process's TP rank, size and group.

    With no arguments after `dist.init_process_group`, the default (world) group is the TP group.
    With explicit rank/world_size and no group, weights are sliced for that rank but collectives
    raise: useful to load and inspect one shard without a process group.
    """
    global _state
    if rank is None or world_size is None:
        if not dist.is_available() or not dist.is_initialized():
            if rank is None and world_size is None:
                _state = TensorParallelState()
                return _state
            raise ValueError("give both rank and world_size, or init torch.distributed first")
        group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for world size {world_size}")
    _state = TensorParallelState(rank=rank, world_size=world_size, group=group)
    return _state


def reset_tensor_parallel() -> None:
    """Back to a single rank (tp = 1)."""
    global _state
    _state = TensorParallelState()


def get_tp_state() -> TensorParallelState:
    return _state


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.world_size


def _group_for_collective() -> dist.ProcessGroup:
    if _state.group is None:
        raise RuntimeError(
            f"tensor-parallel collective at world size {_state.world_size} without a process "
            "group: call init_tensor_parallel() after torch.distributed.init_process_group()"
        )
    return _state.group


def tp_all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum `x` (or reduce it by `op`) over TP ranks (in place when tp > 1; returned unchanged
    at tp = 1)."""
    if _state.world_size == 1:
        return x
    dist.all_reduce(x, op=op, group=_group_for_collective())
    return x


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """TP rank 0's `x` on every rank (in place; unchanged at tp = 1)."""
    if _state.world_size == 1:
        return x
    group = _group_for_collective()
    dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if _state.world_size == 1:
        return x
    group = _group_for_collective()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)
