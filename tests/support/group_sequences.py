"""KV-cache groups under the real scheduler: the brute-force check of a grouped manager's
bookkeeping, and the runner that drives the scheduler over random mixes of full and sliding
groups (run_scheduler_on_groups).

Shared by the grouped managers' property tests (tests/core/test_hybrid_kv_cache_manager.py,
tests/core/test_tiered_hybrid_kv_cache.py), which run it over the hybrid manager and its tiered
variant with their own workers.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from raypaged.core.async_scheduler import make_scheduler
from raypaged.core.errors import InvalidRequestError
from raypaged.core.hybrid_kv_cache_manager import NULL_BLOCK_ID, HybridKVCacheManager
from raypaged.core.kv_cache_groups import KVCacheGroupSpec
from raypaged.core.kv_cache_manager import cdiv
from tests.support.core_fakes import OutputLog, ShadowEngine, ShadowWorker, make_request
from tests.support.scheduler_sequences import EOS, VOCAB, examples

FAST = examples(150)
SLOW = examples(3000)  # scripts/test-slow

# The managers' own sequences (no scheduler): what each step does, to prompts over PREFIXES.
op_lists = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "finish", "preempt",
                                               "fork"]), st.integers(0, 1000)), min_size=4, max_size=70)
PREFIXES = ([1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [3, 3, 3, 3, 3, 3, 3, 3], [])


def check_group_invariants(kv: HybridKVCacheManager, running: dict, last_step: dict | None,
                           max_step: int = 0) -> None:
    """Refcounts, the free queue, waste and the window bounds. last_step (request -> (start, n)
    of its latest step) checks the dropped prefix exactly; without it, the bound for steps of
    at most max_step tokens."""
    pool, B = kv.block_pool, kv.block_size
    refs = [0] * kv.num_blocks
    owner: dict[int, int] = {}
    for rid, r in running.items():
        tables = kv.get_group_block_ids(rid)
        for g, (spec, table) in enumerate(zip(kv.groups, tables)):
            c = r.num_computed_tokens
            assert len(table) == cdiv(c, B) and len(table) * B - c < B, "waste over a block tail"
            live = [b for b in table if b != NULL_BLOCK_ID]
            assert len(set(live)) == len(live)
            for b in live:
                refs[b] += 1
                assert owner.setdefault(b, g) == g, "a block in two groups"
            if spec.sliding_window is not None and last_step is None:
                assert len(live) <= cdiv(spec.sliding_window - 1 + max_step, B) + 1
            elif spec.sliding_window is not None:
                W = spec.sliding_window
                start, n = last_step[rid]
                first = max(0, start - W + 1) // B
                assert all(b == NULL_BLOCK_ID for b in table[:first]), "an out-of-window block kept"
                assert len(live) <= cdiv(W - 1 + n, B) + 1
                if n <= 1:
                    assert len(live) <= cdiv(W, B) + 1
    assert pool.ref_cnt == refs
    assert sorted(pool.free_block_ids()) == [b for b in range(kv.num_blocks) if refs[b] == 0]
    stats = kv.stats()
    assert sum(stats.group_blocks) == stats.num_used_blocks
    assert stats.filled_slots <= stats.allocated_slots


def run_scheduler_on_groups(config, windows, ops, seed: int, with_full: bool = True,
                            make_kv=HybridKVCacheManager, make_worker=ShadowWorker,
                            check_more=lambda kv, scheduler: None):
    """The real scheduler (n > 1 forks, aborts, preemption, chunking, async) over sliding groups,
    after a full one or not. The ShadowWorker applies every group's tables as the scheduler
    output carries them (core/group_tables.py) and checks each group's reads over its window.
    make_kv(num_blocks, block_size, groups, caching, max_tokens_per_step=) builds the manager,
    make_worker(num_blocks, block_size, sample, rng, one_behind=, windows=) the worker;
    check_more(kv, scheduler) runs after every check. Returns the manager."""
    rng = random.Random(seed)
    groups = tuple(KVCacheGroupSpec(w) for w in ((None,) if with_full else ()) + tuple(windows))
    kv = make_kv(config.num_blocks, config.block_size, groups, config.enable_prefix_caching,
                 max_tokens_per_step=config.max_num_batched_tokens)
    scheduler = make_scheduler(config, kv)
    worker = make_worker(config.num_blocks, config.block_size, lambda *_: rng.randrange(VOCAB), rng,
                         one_behind=config.async_scheduling,
                         windows=tuple(g.sliding_window for g in groups))
    engine, log = ShadowEngine(scheduler, worker), OutputLog()

    def checked() -> None:
        log.note(scheduler)
        check_group_invariants(kv, {r.request_id: r for r in scheduler.running}, None, config.max_num_batched_tokens)
        for rid in scheduler._on_workers:  # the worker's tables: the manager's, where it holds a block
            for held, told in zip(kv.get_group_block_ids(rid), worker.requests[rid].group_block_ids):
                assert len(held) == len(told)
                assert all(a == b for a, b in zip(held, told) if a != NULL_BLOCK_ID), rid
        assert all(not any(t) for r in scheduler.waiting
                   for t in kv.get_group_block_ids(r.request_id)), "a waiting request holds blocks"
        check_more(kv, scheduler)

    for k, op in enumerate(ops):
        if op[0] == "add":
            _, prompt, params, salt, priority = op
            try:
                scheduler.add_request(make_request(f"r{k}", prompt, eos=EOS, salt=salt,
                                                   priority=priority, arrival=float(k), **params))
            except InvalidRequestError:
                pass
        elif op[0] == "step":
            log.add(engine.step())
        elif scheduler.requests:
            ids = sorted(set(scheduler.requests) | set(scheduler._groups))
            log.add(scheduler.abort_requests(ids[op[1] % len(ids)]))
        checked()
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        log.add(engine.step())
        checked()
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == config.num_blocks and not any(kv.block_pool.ref_cnt)
    assert not kv._requests and kv.stats().allocated_slots == 0
    log.check_all_finished(scheduler)
    return kv


windows_lists = st.lists(st.integers(1, 9), min_size=1, max_size=3)
