"""Per-replica metrics of data parallelism (`raypaged_dp_*`, labelled by replica index), and the
replicas' scheduler stats summed into one engine's for the frontend's usual metrics."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge

from raypaged.core.kv_cache_interface import KVCacheStats
from raypaged.core.scheduler import SchedulerStats
from raypaged.frontend.prefix_router import PrefixRouter


def merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several engines' stats as one engine's: counts and slots summed (usage is then the pools'
    together)."""
    kv = [s.kv_cache for s in stats]
    # Replicas of one model share the block size and the groups' windows; per-group block
    # counts add up group by group.
    same = ("block_size", "group_windows", "group_blocks")
    summed = {f.name: sum(getattr(k, f.name) for k in kv) for f in dataclasses.fields(KVCacheStats)
              if f.name not in same}
    group_blocks = tuple(sum(blocks) for blocks in zip(*(k.group_blocks for k in kv)))
    return SchedulerStats(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                          sum(s.num_preemptions for s in stats),
                          KVCacheStats(block_size=kv[0].block_size, group_windows=kv[0].group_windows,
                                       group_blocks=group_blocks, **summed))


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "replica"]
        self._model_name = model_name

        def make(kind, name: str, doc: str):
            return kind(f"raypaged_dp_{name}", doc, labels, registry=registry)

        self.routed = make(Counter, "routed_requests", "Requests the router sent to the replica.")
        self.prompt_blocks = make(Counter, "routed_prompt_blocks",
                                  "Full prompt blocks of the requests routed to the replica.")
        self.matched_blocks = make(Counter, "routed_matched_blocks",
                                   "Of those, blocks the router saw cached (or pending) at the replica when it chose.")
        self.host_matched_blocks = make(Counter, "routed_host_matched_blocks",
                                        "Of those, blocks it saw in the replica's host tier (not on its GPU).")
        self.prefix_queries = make(Counter, "prefix_cache_queries",
                                   "The replica's prefix cache queries, in prompt tokens.")
        self.prefix_hits = make(Counter, "prefix_cache_hits",
                                "The replica's prefix cache hits, in prompt tokens.")
        self.in_flight = make(Gauge, "in_flight_requests", "Requests routed to the replica, not ended.")
        self.alive = make(Gauge, "replica_alive", "1 while the replica's engine is up.")
        self.cached_blocks = make(Gauge, "known_cached_blocks",
                                  "Block hashes the router knows the replica's prefix cache holds.")
        self.host_cached_blocks = make(Gauge, "known_host_cached_blocks",
                                       "Block hashes the router knows the replica's host tier holds.")
        self._last: dict[tuple[str, int], int] = {}

    def record(self, router: PrefixRouter, stats: dict[int, SchedulerStats]) -> None:
        """Totals since start become counter increments (a restarted engine counts from zero)."""
        for index, state in enumerate(router.replicas):
            values = (self._model_name, str(index))
            self._add("routed", index, state.routed, self.routed.labels(*values))
            self._add("prompt_blocks", index, state.prompt_blocks, self.prompt_blocks.labels(*values))
            self._add("matched_blocks", index, state.matched_blocks, self.matched_blocks.labels(*values))
            self._add("host_matched_blocks", index, state.host_matched_blocks,
                      self.host_matched_blocks.labels(*values))
            self.in_flight.labels(*values).set(state.in_flight)
            self.alive.labels(*values).set(1 if state.alive else 0)
            self.cached_blocks.labels(*values).set(len(state.cached))
            self.host_cached_blocks.labels(*values).set(len(state.host_cached))
            if index in stats:
                kv = stats[index].kv_cache
                self._add("queries", index, kv.prefix_cache_queries, self.prefix_queries.labels(*values))
                self._add("hits", index, kv.prefix_cache_hits, self.prefix_hits.labels(*values))

    def _add(self, name: str, index: int, total: int, counter) -> None:
        last = self._last.get((name, index), 0)
        counter.inc(total - last if total >= last else total)
        self._last[(name, index)] = total
