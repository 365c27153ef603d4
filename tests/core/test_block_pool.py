"""BlockPool: reference counts, the free queue's eviction order, and the prefix-cache map."""

import copy

import pytest

from raypaged.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from raypaged.core.errors import NoFreeBlocksError


def snapshot(pool: BlockPool):
    return (list(pool.ref_cnt), list(pool.block_hash), pool.free_block_ids(), copy.copy(pool._cached))


def full_hash(tokens, parent=None, salt=None):
    return hash_block_tokens(parent, tuple(tokens), (salt,) if salt else None)


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    assert pool.ref_cnt == [0] * 5 and pool.num_cached_blocks == 0


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3"])
def test_bad_pool_size(bad):
    with pytest.raises(ValueError):
        BlockPool(bad)


def test_get_new_blocks_takes_the_front_with_one_reference():
    pool = BlockPool(4)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.ref_cnt == [1, 1, 1, 0]
    assert pool.free_block_ids() == [3]


def test_asking_for_too_many_blocks_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    before = snapshot(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(2)
    assert snapshot(pool) == before


def test_uncached_blocks_are_reused_before_cached_ones_and_cached_ones_lru():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_block(a, full_hash([1, 2]))
    pool.cache_full_block(c, full_hash([3, 4]))
    pool.free_blocks([a])  # cached: back of the queue
    pool.free_blocks([b])  # uncached: front
    pool.free_blocks([c])  # cached, freed after a: evicted after a
    pool.free_blocks([d])  # uncached: front
    assert pool.free_block_ids() == [d, b, a, c]
    assert pool.get_new_blocks(3) == [d, b, a]
    # a was evicted: its contents left the prefix cache, c's stay.
    assert pool.get_cached_block(full_hash([1, 2])) is None
    assert pool.block_hash[a] is None
    assert pool.get_cached_block(full_hash([3, 4])) == c


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    h = full_hash([7, 7])
    pool.cache_full_block(a, h)
    pool.free_blocks([a])
    assert pool.get_cached_block(h) == a and a in pool.free_block_ids()
    pool.touch([a])
    assert pool.ref_cnt[a] == 1 and a not in pool.free_block_ids()
    pool.touch([a])
    assert pool.ref_cnt[a] == 2
    pool.free_blocks([a, a])
    assert pool.free_block_ids()[-1] == a  # back to the queue's cached end


def test_free_drops_one_reference_per_mention():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    pool.free_blocks([a])
    assert pool.ref_cnt[a] == 1 and a not in pool.free_block_ids()
    pool.free_blocks([a])
    assert pool.ref_cnt[a] == 0 and a in pool.free_block_ids()


@pytest.mark.parametrize("bad_free", [[0], [1, 1], [5], [-1], ["1"]])
def test_bad_free_changes_nothing(bad_free):
    pool = BlockPool(4)
    pool.get_new_blocks(2)  # blocks 0 and 1 held once each
    pool.free_blocks([0])
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.free_blocks(bad_free)  # 0 is free; 1 freed twice; out of range; not an int
    assert snapshot(pool) == before


def test_bad_touch_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.touch([0, 3])
    assert snapshot(pool) == before


def test_cache_full_block_rules():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = full_hash([1, 2, 3])
    assert pool.cache_full_block(a, h)
    assert pool.cache_full_block(a, h)  # idempotent
    before = snapshot(pool)
    assert not pool.cache_full_block(b, h)  # same contents computed twice: the first one stays
    assert snapshot(pool) == before
    with pytest.raises(ValueError):
        pool.cache_full_block(a, full_hash([9, 9, 9]))  # already caches other contents
    with pytest.raises(ValueError):
        pool.cache_full_block(2, full_hash([4]))  # free block
    assert snapshot(pool) == before


def test_caching_off_never_caches():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, full_hash([1]))
    assert pool.num_cached_blocks == 0 and pool.block_hash[a] is None


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, full_hash([1]))
    before = snapshot(pool)
    assert not pool.reset_prefix_cache()
    assert snapshot(pool) == before
    pool.free_blocks([a, b])
    block_hash_list = pool.block_hash
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.block_hash == [None] * 3
    assert pool.block_hash is block_hash_list  # cleared in place: the manager reads this list
    assert pool.num_free_blocks == 3


def test_block_hash_chains_over_the_whole_prefix():
    root1, root2 = full_hash([1, 2]), full_hash([3, 4])
    # Same tokens after different prefixes: different blocks.
    assert full_hash([5, 6], root1) != full_hash([5, 6], root2)
    assert full_hash([5, 6], root1).hash_value != full_hash([5, 6], root2).hash_value
    # Same prefix, same tokens: equal (a hit).
    assert full_hash([5, 6], full_hash([1, 2])) == full_hash([5, 6], root1)
    # A salt (extra key) separates otherwise equal blocks.
    assert full_hash([1, 2], salt="a") != full_hash([1, 2], salt="b") != full_hash([1, 2])


def test_a_hash_collision_cannot_produce_a_false_hit():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    real = BlockHash(12345, (1, 2), None)
    pool.cache_full_block(a, real)
    forged = BlockHash(12345, (9, 9), None)  # same hash value, other tokens
    assert pool.get_cached_block(forged) is None
    assert pool.get_cached_block(BlockHash(12345, (1, 2), ("salt",))) is None
    assert pool.get_cached_block(BlockHash(12345, (1, 2), None)) == a


def test_a_block_whose_hash_collides_with_a_cached_one_stays_uncached():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    real = BlockHash(12345, (1, 2), None)
    assert pool.cache_full_block(a, real)
    assert not pool.cache_full_block(b, BlockHash(12345, (9, 9), None))  # same hash value
    assert pool.block_hash[b] is None and pool.get_cached_block(real) == a
    pool.free_blocks([b, a])
    assert pool.get_new_blocks(1) == [b]  # uncached: reused first
    assert pool.get_cached_block(real) == a
