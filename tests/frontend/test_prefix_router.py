"""The data-parallel router alone: longest prefix, load weighing, evictions forget, dead replicas,
host-tier residency at a lower weight."""

import pytest

from raypaged.core.block_pool import removed_event, stored_event
from raypaged.core.outputs import EngineLoad
from raypaged.frontend.prefix_router import Match, NoReplicaError, PrefixRouter

A = [11, 12, 13, 14]  # one prompt's four full blocks
B = [21, 22, 23]


def holding(router: PrefixRouter, replica: int, values: list[int]) -> None:
    router.apply_events(replica, [stored_event(v) for v in values])


def offloaded(router: PrefixRouter, replica: int, values: list[int]) -> None:
    """What an engine with a host tier reports when its GPU pool evicts these into the tier."""
    router.apply_events(replica, [e for v in values for e in (stored_event(v, host=True), removed_event(v))])


def test_longest_prefix_wins():
    router = PrefixRouter(3)
    holding(router, 0, A[:1])
    holding(router, 1, A[:3])
    holding(router, 2, [A[0], A[3]])  # not a prefix past the first block
    route = router.route(A)
    assert (route.replica, route.matched_blocks) == (1, 3)


def test_no_match_goes_to_the_least_loaded_and_a_routed_prefix_is_pending_there():
    router = PrefixRouter(2)
    first = router.route(A)
    assert first.replica == 0 and first.matched_blocks == 0
    # Before replica 0 reports A, a second request with A still finds it there (pending).
    assert router.route(A).replica == 0
    # Another prefix goes to the idle replica.
    assert router.route(B).replica == 1


def test_load_outweighs_the_prefix_past_the_balance_slack():
    router = PrefixRouter(2, balance_abs=2, balance_rel=0.0)
    holding(router, 0, A)
    routes = [router.route(A) for _ in range(8)]
    placed = [r.replica for r in routes]
    # Replica 0 takes the prefix until it is 2 requests ahead, then they alternate.
    assert placed[:3] == [0, 0, 0] and placed.count(1) >= 3
    loads = [s.in_flight for s in router.replicas]
    assert abs(loads[0] - loads[1]) <= 3
    for route in routes:
        router.finished(route)
    assert [s.in_flight for s in router.replicas] == [0, 0]
    assert not router.replicas[0].pending and not router.replicas[1].pending


def test_engine_waiting_queue_and_kv_pressure_count():
    router = PrefixRouter(2)
    holding(router, 0, A)
    router.update_load(0, EngineLoad(num_waiting=10, num_running=4, kv_usage=0.5))
    assert router.route(A).replica == 1  # the queue at 0 is past the slack
    router = PrefixRouter(2)
    holding(router, 0, A)
    router.update_load(0, EngineLoad(num_waiting=0, num_running=4, kv_usage=0.99))
    assert router.route(A).replica == 1  # 0's pool is full
    router.update_load(1, EngineLoad(num_waiting=0, num_running=4, kv_usage=0.99))
    assert router.route(A).replica == 0  # both full: the prefix decides again


def test_evictions_forget():
    router = PrefixRouter(2)
    holding(router, 1, A)
    router.apply_events(1, [removed_event(A[1])])
    assert router.matched_blocks(1, A) == 1
    # A stored-then-evicted value in one batch ends evicted; evicted-then-stored ends stored.
    router.apply_events(0, [stored_event(B[0]), removed_event(B[0]), removed_event(B[1]), stored_event(B[1])])
    assert router.replicas[0].cached == {B[1]}


def test_dead_replica_gets_nothing_and_comes_back_empty():
    router = PrefixRouter(2)
    holding(router, 0, A)
    router.mark_dead(0)
    assert router.route(A).replica == 1
    with pytest.raises(NoReplicaError):
        router.route(A, exclude=frozenset({1}))
    router.mark_alive(0)
    assert router.matched_blocks(0, A) == 0
    router.mark_dead(1)
    assert router.route(A).replica == 0


def test_round_robin_and_p2c_ignore_prefixes():
    router = PrefixRouter(3, "round_robin")
    holding(router, 2, A)
    assert [router.route(A).replica for _ in range(4)] == [0, 1, 2, 0]
    router.mark_dead(1)
    assert [router.route(A).replica for _ in range(3)] == [2, 0, 2]
    p2c = PrefixRouter(2, "p2c", seed=3)
    holding(p2c, 0, A)
    placed = [p2c.route(A).replica for _ in range(10)]
    assert placed.count(0) == placed.count(1) == 5  # two replicas: always the less loaded


def test_bad_settings():
    with pytest.raises(ValueError, match="routing policy"):
        PrefixRouter(2, "random")
    with pytest.raises(ValueError):
        PrefixRouter(0)
    with pytest.raises(ValueError, match="host_weight"):
        PrefixRouter(2, host_weight=1.5)


def test_a_block_evicted_to_the_host_tier_is_still_held_and_one_dropped_there_is_gone():
    router = PrefixRouter(2)
    holding(router, 0, A)
    offloaded(router, 0, A[2:])  # its GPU pool evicted the last two blocks into the host tier
    assert router.replicas[0].cached == set(A[:2]) and router.replicas[0].host_cached == set(A[2:])
    assert router.match(0, A) == Match(gpu=2, host=2) and router.matched_blocks(0, A) == 4
    route = router.route(A)
    assert (route.replica, route.matched_blocks, route.host_matched_blocks) == (0, 4, 2)
    router.finished(route)
    router.apply_events(0, [removed_event(A[3], host=True)])  # the host tier dropped one
    assert router.match(0, A) == Match(2, 1)
    # Loaded back onto the GPU (the host copy stays): a GPU hit again.
    router.apply_events(0, [stored_event(A[2])])
    assert router.match(0, A) == Match(3, 0)
    # The engine's lookup order: GPU hits first, the host run after them; a host block before
    # the GPU's first miss only counts from where the GPU run ends.
    router.apply_events(1, [stored_event(B[0], host=True), stored_event(B[1])])
    assert router.match(1, B) == Match(0, 1)
    router.mark_dead(0)
    assert not router.replicas[0].host_cached


def test_a_host_hit_weighs_less_than_a_gpu_hit_but_more_than_none():
    router = PrefixRouter(3, balance_abs=10)
    offloaded(router, 0, A)  # all four blocks in 0's host tier
    holding(router, 1, A[:3])  # three on 1's GPU
    assert router.route(A).replica == 1  # 3 GPU blocks > 4 host blocks at weight 0.5
    router = PrefixRouter(3, balance_abs=10)
    offloaded(router, 0, A)
    holding(router, 1, A[:1])
    assert router.route(A).replica == 0  # 4 host blocks at 0.5 > 1 GPU block
    router = PrefixRouter(2, balance_abs=10, host_weight=1.0)  # a copy as good as a hit
    offloaded(router, 0, A)
    holding(router, 1, A[:3])
    assert router.route(A).replica == 0
    # Nothing anywhere but the host tier of the busier replica: still its host hits, within the slack.
    router = PrefixRouter(2)
    offloaded(router, 1, B)
    router.update_load(1, EngineLoad(num_waiting=1, num_running=2, kv_usage=0.3))
    assert router.route(B).replica == 1


def test_metrics_count_per_replica_and_merge_sums_engines():
    from prometheus_client import CollectorRegistry

    from raypaged.core.kv_cache_interface import KVCacheStats
    from raypaged.core.scheduler import SchedulerStats
    from raypaged.frontend.router_metrics import RouterMetrics, merge_stats

    def stats(hits: int) -> SchedulerStats:
        return SchedulerStats(1, 2, 0, KVCacheStats(10, 4, 16, 96, 90, 100, 10, 64, hits))

    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, "m")
    router = PrefixRouter(2)
    holding(router, 1, A)
    router.route(A)
    router.route(A)  # balanced: both go to 1, which holds A
    metrics.record(router, {0: stats(0), 1: stats(48)})
    metrics.record(router, {0: stats(0), 1: stats(48)})  # totals, not increments: no double count

    def value(name: str, replica: str) -> float | None:
        return registry.get_sample_value(f"raypaged_dp_{name}", {"model_name": "m", "replica": replica})

    assert value("routed_requests_total", "1") == 2 and value("routed_requests_total", "0") == 0
    assert value("routed_matched_blocks_total", "1") == 8
    assert value("routed_host_matched_blocks_total", "1") == 0 and value("known_cached_blocks", "1") == 4
    offloaded(router, 0, B)
    router.route(B)
    metrics.record(router, {0: stats(0), 1: stats(48)})
    assert value("routed_host_matched_blocks_total", "0") == 3 and value("known_host_cached_blocks", "0") == 3
    assert value("prefix_cache_hits_total", "1") == 48 and value("in_flight_requests", "1") == 2
    merged = merge_stats([stats(0), stats(48)])
    assert (merged.num_waiting, merged.kv_cache.num_blocks, merged.kv_cache.prefix_cache_hits) == (4, 20, 48)
    # Engines with KV-cache groups: the windows as each has them, the groups' blocks added up.
    grouped = [SchedulerStats(1, 0, 0, KVCacheStats(10, 4, 16, 96, 90, 100, 10, 64, 0, group_blocks=(3, 2),
                                                    group_windows=(None, 8))) for _ in range(2)]
    merged = merge_stats(grouped)
    assert merged.kv_cache.group_blocks == (6, 4) and merged.kv_cache.group_windows == (None, 8)
