"""The HybridKVCacheManager (KV-cache groups: full and sliding-window layers over one pool): a
sliding group frees out-of-window blocks, each group's prefix chain and the routed group's cache
events, random sequences of add / step / finish / preempt / fork / prefix hit over random group
mixes, and the real scheduler over it (tests/support/group_sequences.py).

A shadow of the device (ContentModel) records which token's K/V each (block, slot) holds, applies
the copy-on-write pairs, and checks every read a step's queries make — a full layer reads every
earlier position, a sliding layer of window W the positions (p - W, p] — so a block freed while
still in the window and reused by another request, or a prefix hit on other tokens, fails.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raypaged.core.block_hashing import ROOT_HASH
from raypaged.core.hybrid_kv_cache_manager import NULL_BLOCK_ID, HybridKVCacheManager
from raypaged.core.kv_cache_groups import KVCacheGroupSpec, make_kv_cache_manager
from raypaged.core.kv_cache_manager import cdiv
from tests.support.core_fakes import make_request, prefix_ids
from tests.support.group_sequences import (
    FAST,
    PREFIXES,
    SLOW,
    check_group_invariants,
    op_lists,
    run_scheduler_on_groups,
    windows_lists,
)
from tests.support.scheduler_sequences import operations, scheduler_configs


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


group_mixes = st.lists(st.one_of(st.none(), st.integers(1, 9)), min_size=1, max_size=4).map(
    lambda ws: tuple(KVCacheGroupSpec(w) for w in ws))


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
        check_group_invariants(kv, running, last_step)
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
