"""Where the KV memory goes while an engine serves: its scheduler's KVCacheStats sampled every few
steps (KVSample) and their averages over the run (memory_summary)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVSample:
    seconds: float  # since the requests were submitted
    step: int
    running: int
    waiting: int
    used_blocks: int
    allocated_slots: int
    filled_slots: int
    shared_saved_slots: int


def sample_kv(engine, seconds: float, step: int) -> KVSample:
    stats = engine.scheduler.stats()
    kv = stats.kv_cache
    return KVSample(seconds, step, stats.num_running, stats.num_waiting, kv.num_used_blocks,
                    kv.allocated_slots, kv.filled_slots, kv.shared_saved_slots)


def memory_summary(samples: list[KVSample], pool_slots: int, block_size: int) -> dict:
    """Averages over the sampled steps (ratios of sums). "While waiting": only the steps where
    some request waits for memory or a seat, i.e. where the allocator is what limits."""

    def averages(chosen: list[KVSample]) -> dict:
        if not chosen:
            return {}
        allocated = sum(s.allocated_slots for s in chosen)
        filled = sum(s.filled_slots for s in chosen)
        running = sum(s.running for s in chosen)
        pool = pool_slots * len(chosen)
        return {
            "steps_sampled": len(chosen),
            "mean_running": running / len(chosen),
            "pool_usage": sum(s.used_blocks for s in chosen) * block_size / pool,
            "pool_token_states": filled / pool,  # the PagedAttention paper's fig. 2 measure
            "kv_utilization": filled / allocated if allocated else 1.0,  # filled / allocated
            "waste_share_of_pool": (allocated - filled) / pool,
            "unfilled_slots_per_running_request": (allocated - filled) / running if running else 0.0,
            "mean_shared_saved_slots": sum(s.shared_saved_slots for s in chosen) / len(chosen),
        }

    return {"all_steps": averages(samples),
            "while_waiting": averages([s for s in samples if s.waiting]),
            "peak_running": max((s.running for s in samples), default=0),
            "block_size": block_size}
