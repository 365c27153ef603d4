"""KV-cache groups: grouping layers by window, and the one-full-group seam (make_kv_cache_manager
gives the plain manager, and the hybrid manager over one full group hands out exactly its blocks
under random sequences of add / step / finish / preempt / fork / prefix hit).

The hybrid manager over other group mixes: tests/core/test_hybrid_kv_cache_manager.py.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raypaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
from raypaged.core.kv_cache_groups import (
    FULL_ATTENTION,
    KVCacheGroupSpec,
    group_layers,
    make_kv_cache_manager,
)
from raypaged.core.kv_cache_manager import KVCacheManager
from tests.support.core_fakes import make_request
from tests.support.group_sequences import FAST, PREFIXES, op_lists


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
