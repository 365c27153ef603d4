"""Per-group KV usage in the metrics: a model whose layers differ reports the blocks each
KV-cache group holds, from the engine's stats (no server: FrontendMetrics alone)."""

from __future__ import annotations

from raypaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
from raypaged.core.kv_cache_groups import KVCacheGroupSpec
from raypaged.core.scheduler import SchedulerStats
from raypaged.frontend.metrics import FrontendMetrics
from tests.support.core_fakes import make_request


def test_blocks_per_group_are_reported_by_group_and_window():
    kv = HybridKVCacheManager(32, 2, [KVCacheGroupSpec(None), KVCacheGroupSpec(4)])
    request = make_request("a", list(range(1, 10)))
    kv.allocate_slots(request, 9)
    request.num_computed_tokens = 9
    for _ in range(6):  # decoding past the window: the sliding group gives blocks back
        request.append_output_token(7)
        kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    metrics = FrontendMetrics("m", 64)
    metrics.record_engine_stats(SchedulerStats(1, 0, 0, kv.stats()))
    sample = metrics.registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert sample("raypaged_kv_cache_group_blocks", {**labels, "group": "0", "window": "full"}) == 8
    assert sample("raypaged_kv_cache_group_blocks", {**labels, "group": "1", "window": "4"}) == 3
    assert sample("raypaged_kv_cache_blocks", labels) == 32
