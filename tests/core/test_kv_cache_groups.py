"""KV-cache groups: grouping layers, the one-full-group seam, and the HybridKVCacheManager under
random sequences of add / step / finish / preempt / fork / prefix hit over random group mixes.

A shadow of the device (ContentModel) records which token's K/V each (block, slot) holds, applies
the copy-on-write pairs, and checks every read a step's queries make — a full layer reads every
earlier position, a sliding layer of window W the positions (p - W, p] — so a block freed while
still in the window and reused by another request, or a prefix hit on other tokens, fails.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raypaged.core.async_scheduler import make_scheduler
from raypaged.core.block_hashing import ROOT_HASH
from raypaged.core.errors import InvalidRequestError
from raypaged.core.hybrid_kv_cache_manager import NULL_BLOCK_ID, HybridKVCacheManager
from raypaged.core.kv_cache_groups import (
    FULL_ATTENTION,
    KVCacheGroupSpec,
    group_layers,
    make_kv_cache_manager,
)
from raypaged.core.kv_cache_manager import KVCacheManager, cdiv
from tests.core.test_properties import EOS, VOCAB, operations, scheduler_configs
from tests.support.core_fakes import (
    OutputLog,
    ShadowEngine,
    ShadowWorker,
    make_request,
    prefix_ids,
)

FAST = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=3000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PREFIXES = ([1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [3, 3, 3, 3, 3, 3, 3, 3], [])


def test_gemma3_layers_group_into_equal_groups():
    windows = ([1024] * 5 + [None]) * 4 + [1024, 1024]  # 26 layers, as Gemma 3 1B: 22 local, 4 global
    groups = group_layers(windows)
    assert groups[0] == KVCacheGroupSpec(None, (5, 11, 17, 23))
    assert [g.sliding_window for g in groups] == [None] + [1024] * 6
    assert all(len(g.layer_ids) == 4 for g in groups[:-1]) and len(groups[-1].layer_ids) == 2
    assert sorted(i for g in groups for i in g.layer_ids) == list(range(26))
    assert group_layers([None] * 3) == (KVCacheGroupSpec(None, (0, 1, 2)),)


def test_one_full_group_is_the_plain_manager():
    assert type(make_kv_cache_manager(8, 4)) is KVCacheManager
    assert type(make_kv_cache_manager(8, 4, group_layers([None, None]))) is KVCacheManager
    assert type(make_kv_cache_manager(8, 4, [KVCacheGroupSpec(8)])) is HybridKVCacheManager
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheGroupSpec(0)


def test_sliding_group_frees_out_of_window_blocks():
    kv = HybridKVCacheManager(32, 2, [KVCacheGroupSpec(None), KVCacheGroupSpec(4)])
    r = make_request("a", list(range(1, 10)))
    assert kv.allocate_slots(r, 9) == [0, 1, 2, 3, 4]
    r.num_computed_tokens = 9
    for _ in range(7):
        r.append_output_token(7)
        kv.allocate_slots(r, 1)
        full, local = kv.get_group_block_ids("a")
        assert NULL_BLOCK_ID not in full and len(full) == len(local) == cdiv(r.num_tokens, 2)
        live = [b for b in local if b != NULL_BLOCK_ID]
        # A query at p reads (p - 4, p]: the blocks of positions p-3 .. p.
        p = r.num_computed_tokens
        assert local.index(live[0]) == (p - 3) // 2 and len(live) <= cdiv(4, 2) + 1
        r.num_computed_tokens += 1
    stats = kv.stats()
    assert stats.group_blocks == (8, 2) and stats.num_used_blocks == 10
    kv.free(r)
    assert kv.num_free_blocks == 32


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_groups_hash_with_the_configured_chain(algo):
    """Each group's prefix chain is prefix_caching_hash_algo's: the routed (first full) group's
    the plain chain, the others' keyed by the group's index (and the salt): sha256 values are the
    same in every process, which data parallelism relies on."""
    from raypaged.core.block_hashing import block_hasher

    kv = make_kv_cache_manager(16, 2, [KVCacheGroupSpec(None), KVCacheGroupSpec(4)], hash_algo=algo)
    r = make_request("a", [5, 6, 7, 8, 9])
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    kv.cache_blocks(r, 5)
    hasher = block_hasher(algo)
    for g, keys in ((0, None), (1, (1,))):
        hashes = kv._requests["a"].groups[g].hashes
        first = hasher(ROOT_HASH, (5, 6), keys)
        assert [h.hash_value for h in hashes[:2]] == [first, hasher(first, (7, 8), keys)]
    kv.free(r)


@pytest.mark.parametrize("windows", [(4, None), (None, 4), (4,)])
@pytest.mark.parametrize("salt", [None, "tenant"])
def test_a_grouped_engine_reports_the_routers_hashes(windows, salt):
    """What a data-parallel router hashes of a prompt (prefix_hash_values) is what a grouped
    engine's cache events report: the routed group's chain only, stored and then evicted."""
    from raypaged.core.block_hashing import block_hasher, prefix_hash_values
    from raypaged.core.block_pool import read_event

    B, prompt = 2, [5, 6, 7, 8, 9, 10, 11]
    kv = make_kv_cache_manager(12, B, [KVCacheGroupSpec(w) for w in windows], hash_algo="sha256")
    kv.record_cache_events()
    r = make_request("a", prompt, salt=salt)
    kv.allocate_slots(r, len(prompt))
    r.num_computed_tokens = len(prompt)
    kv.cache_blocks(r, len(prompt))
    expected = prefix_hash_values(prompt, B, salt, block_hasher("sha256"))
    stored = [read_event(e) for e in kv.take_cache_events()]
    assert all(e.stored and not e.host for e in stored)
    assert [e.hash_value for e in stored] == expected
    kv.free(r)
    kv.block_pool.get_new_blocks(kv.num_free_blocks)  # every cached block of every group evicted
    removed = [read_event(e) for e in kv.take_cache_events()]
    assert not any(e.stored for e in removed) and sorted(e.hash_value for e in removed) == sorted(expected)


# ---- random sequences ---------------------------------------------------------------------------

class ContentModel:
    """What each physical (block, slot) holds: the prefix id of the token whose K/V is there."""

    def __init__(self, block_size: int) -> None:
        self.B = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            for off in range(self.B):
                if (src, off) in self.slots:
                    self.slots[(dst, off)] = self.slots[(src, off)]
                else:
                    self.slots.pop((dst, off), None)

    def step(self, kv: HybridKVCacheManager, request, start: int, n: int) -> None:
        """Write positions start .. start+n-1 in every group, then check every read."""
        B, ids = self.B, prefix_ids(request.all_token_ids)
        tables = kv.get_group_block_ids(request.request_id)
        for table in tables:
            for p in range(start, start + n):
                assert table[p // B] != NULL_BLOCK_ID, "writing into a dropped block"
                self.slots[(table[p // B], p % B)] = ids[p]
        for spec, table in zip(kv.groups, tables):
            for p in range(start, start + n):
                low = 0 if spec.sliding_window is None else max(0, p - spec.sliding_window + 1)
                for j in range(low, p + 1):
                    block = table[j // B]
                    assert block != NULL_BLOCK_ID, f"position {j} in the window of {p} was dropped"
                    assert self.slots.get((block, j % B)) == ids[j], f"read {j} for {p}: wrong K/V"


def check(kv: HybridKVCacheManager, running: dict, last_step: dict | None, max_step: int = 0) -> None:
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


group_mixes = st.lists(st.one_of(st.none(), st.integers(1, 9)), min_size=1, max_size=4).map(
    lambda ws: tuple(KVCacheGroupSpec(w) for w in ws))
op_lists = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "finish", "preempt",
                                               "fork"]), st.integers(0, 1000)), min_size=4, max_size=70)


def run_sequence(groups, block_size: int, num_blocks: int, caching: bool, ops, seed: int) -> None:
    rng = random.Random(seed)
    kv = HybridKVCacheManager(num_blocks, block_size, groups, enable_prefix_caching=caching)
    model = ContentModel(block_size)
    running: dict[str, object] = {}
    last_step: dict[str, tuple[int, int]] = {}
    waiting: list = []

    def admit(r) -> None:
        hits, num_hit = kv.get_computed_blocks(r)
        assert num_hit < r.num_tokens and num_hit == len(hits) * block_size
        n = rng.randint(1, r.num_tokens - num_hit)
        blocks = kv.allocate_slots(r, n, hits)
        if blocks is None:
            waiting.append(r)
            return
        assert blocks[:len(hits)] == hits
        r.num_computed_tokens = num_hit
        model.apply_copies(kv.take_block_copies())
        model.step(kv, r, num_hit, n)  # also checks the hit blocks hold this request's prefix
        r.num_computed_tokens += n
        kv.cache_blocks(r, r.num_computed_tokens)
        running[r.request_id] = r
        last_step[r.request_id] = (num_hit, n)

    for k, (op, a) in enumerate(ops):
        ids = sorted(running)
        if op == "add" or not ids:
            prefix = PREFIXES[a % 3]
            prompt = prefix[:rng.randint(0, len(prefix))] + [rng.randrange(8) for _ in range(rng.randint(1, 8))]
            admit(make_request(f"r{k}", prompt, salt=rng.choice([None, None, "s"])))
        elif op == "step":
            r = running[ids[a % len(ids)]]
            if r.num_computed_tokens == r.num_tokens:
                if r.num_tokens >= 48:
                    continue
                r.append_output_token(rng.randrange(8))
            start = r.num_computed_tokens
            n = rng.randint(1, r.num_tokens - start)
            if kv.allocate_slots(r, n) is None:
                continue
            model.apply_copies(kv.take_block_copies())
            model.step(kv, r, start, n)
            r.num_computed_tokens += n
            kv.cache_blocks(r, r.num_computed_tokens)
            last_step[r.request_id] = (start, n)
        elif op in ("finish", "preempt"):
            r = running.pop(ids[a % len(ids)])
            kv.free(r)
            if op == "preempt":
                r.num_computed_tokens = 0
                waiting.append(r)
        elif op == "fork":
            parent = running[ids[a % len(ids)]]
            child = make_request(f"r{k}", list(parent.all_token_ids), salt=parent.cache_salt)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent, child)
            running[child.request_id] = child
            last_step[child.request_id] = last_step[parent.request_id]
        if waiting and rng.random() < 0.5:
            admit(waiting.pop(0))
        check(kv, running, last_step)
    for r in list(running.values()):
        kv.free(r)
    assert kv.num_free_blocks == num_blocks and not any(kv.block_pool.ref_cnt)
    assert kv.stats().allocated_slots == 0 and not kv._requests.keys() - {r.request_id for r in waiting}


@FAST
@given(groups=group_mixes, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(8, 60),
       caching=st.booleans(), ops=op_lists, seed=st.integers(0, 2**32 - 1))
def test_hybrid_random_sequences(groups, block_size, num_blocks, caching, ops, seed):
    run_sequence(groups, block_size, num_blocks, caching, ops, seed)


@pytest.mark.slow
@SLOW
@given(groups=group_mixes, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(8, 60),
       caching=st.booleans(), ops=op_lists, seed=st.integers(0, 2**32 - 1))
def test_hybrid_random_sequences_many(groups, block_size, num_blocks, caching, ops, seed):
    run_sequence(groups, block_size, num_blocks, caching, ops, seed)


def run_both(block_size: int, num_blocks: int, caching: bool, ops, seed: int) -> None:
    """The hybrid manager with one full group hands out exactly the plain manager's blocks."""
    rng = random.Random(seed)
    plain = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    hybrid = HybridKVCacheManager(num_blocks, block_size, FULL_ATTENTION, enable_prefix_caching=caching)
    running: dict[str, tuple] = {}  # id -> (plain's request, hybrid's request)

    def same(a, b) -> None:
        assert a == b
        assert plain.block_pool.free_block_ids() == hybrid.block_pool.free_block_ids()
        assert plain.take_block_copies() == hybrid.take_block_copies()

    for k, (op, a) in enumerate(ops):
        ids = sorted(running)
        if op == "add" or not ids:
            prompt = PREFIXES[a % 3][:rng.randint(0, 14)] + [rng.randrange(8) for _ in range(rng.randint(1, 6))]
            pair = tuple(make_request(f"r{k}", prompt) for _ in range(2))
            hits = [m.get_computed_blocks(r) for m, r in zip((plain, hybrid), pair)]
            same(hits[0], hits[1])
            n = rng.randint(1, len(prompt) - hits[0][1])
            got = [m.allocate_slots(r, n, h[0]) for m, r, h in zip((plain, hybrid), pair, hits)]
            same(got[0], got[1])
            if got[0] is not None:
                for r in pair:
                    r.num_computed_tokens = hits[0][1] + n
                running[f"r{k}"] = pair
        elif op == "step":
            pair = running[ids[a % len(ids)]]
            if pair[0].num_computed_tokens == pair[0].num_tokens:
                token = rng.randrange(8)
                for r in pair:
                    r.append_output_token(token)
            n = rng.randint(1, pair[0].num_tokens - pair[0].num_computed_tokens)
            got = [m.allocate_slots(r, n) for m, r in zip((plain, hybrid), pair)]
            same(got[0], got[1])
            if got[0] is not None:
                for m, r in zip((plain, hybrid), pair):
                    r.num_computed_tokens += n
                    m.cache_blocks(r, r.num_computed_tokens)
        elif op in ("finish", "preempt"):
            pair = running.pop(ids[a % len(ids)])
            for m, r in zip((plain, hybrid), pair):
                m.free(r)
            same(None, None)
        else:
            parent = running[ids[a % len(ids)]]
            child = tuple(make_request(f"r{k}", list(p.all_token_ids)) for p in parent)
            for m, p, c in zip((plain, hybrid), parent, child):
                c.num_computed_tokens = p.num_computed_tokens
                m.fork(p, c)
            running[f"r{k}"] = child
        for rid in running:
            assert plain.get_block_ids(rid) == hybrid.get_block_ids(rid)
            assert plain.pop_rewritten(rid) == hybrid.pop_rewritten(rid)
        sp, sh = plain.stats(), hybrid.stats()
        assert (sp.allocated_slots, sp.filled_slots, sp.logical_slots, sp.prefix_cache_hits) == \
            (sh.allocated_slots, sh.filled_slots, sh.logical_slots, sh.prefix_cache_hits)


@FAST
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 40), caching=st.booleans(),
       ops=op_lists, seed=st.integers(0, 2**32 - 1))
def test_one_full_group_hands_out_the_plain_managers_blocks(block_size, num_blocks, caching, ops, seed):
    run_both(block_size, num_blocks, caching, ops, seed)


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
        check(kv, {r.request_id: r for r in scheduler.running}, None, config.max_num_batched_tokens)
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


@FAST
@given(config=scheduler_configs(), windows=windows_lists, ops=operations, seed=st.integers(0, 2**32 - 1),
       async_scheduling=st.booleans(), with_full=st.booleans())
def test_scheduler_on_groups_random_sequences(config, windows, ops, seed, async_scheduling, with_full):
    run_scheduler_on_groups(dataclasses.replace(config, async_scheduling=async_scheduling), windows,
                            ops, seed, with_full)


@pytest.mark.slow
@SLOW
@given(config=scheduler_configs(), windows=windows_lists, ops=operations, seed=st.integers(0, 2**32 - 1),
       async_scheduling=st.booleans(), with_full=st.booleans())
def test_scheduler_on_groups_random_sequences_many(config, windows, ops, seed, async_scheduling,
                                                   with_full):
    run_scheduler_on_groups(dataclasses.replace(config, async_scheduling=async_scheduling), windows,
                            ops, seed, with_full)
