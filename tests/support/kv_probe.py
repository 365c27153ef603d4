"""A probe on an in-process engine's KV pool: freed blocks poisoned, KV held measured.

Before every step the engine hands its workers, every block the KV manager holds for nobody and
that caches no prefix (a prefix hit may bring a cached one back) gets NaN in every slot of
every K/V pair of the pool. A kernel that reads a block after the manager gave it back (a
sliding group's block dropped too early, a stale table entry followed) then turns that row's
logits to NaN, and the greedy output leaves transformers'. The probe also records the most KV
bytes held at once and the blocks it poisoned.
"""

from __future__ import annotations

import torch

from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.engine.core import EngineCore
from raypaged.worker.kv_layout import unique_caches


class FreedBlockProbe:
    def __init__(self, engine: EngineCore) -> None:
        worker = engine.executor.worker  # an in-process engine (UniprocExecutor)
        self.pool = unique_caches(worker.runner.kv_caches)
        self.kv = engine.scheduler.kv_cache_manager
        self.bytes_per_block = worker.bytes_per_block()
        self.peak_bytes = 0
        self.poisoned: set[int] = set()  # every block poisoned at least once
        self._execute = engine.executor.execute_model
        engine.executor.execute_model = self._execute_poisoned  # type: ignore[method-assign]

    def _execute_poisoned(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        pool = self.kv.block_pool
        freed = [b for b in range(pool.num_blocks) if pool.ref_cnt[b] == 0 and pool.block_hash[b] is None]
        if freed:
            index = torch.tensor(freed)
            for k, v in self.pool:
                k[index] = float("nan")
                v[index] = float("nan")
            self.poisoned.update(freed)
        self.peak_bytes = max(self.peak_bytes, self.kv.stats().num_used_blocks * self.bytes_per_block)
        return self._execute(out)

    def check_pool_whole(self) -> None:
        """Every block is back in the pool, nothing held."""
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert not any(self.kv.block_pool.ref_cnt)
        assert self.kv.stats().allocated_slots == 0
