"""The prefix cache's hash chain: sha256 means the same in every process, salts stay apart, and
the pool's cache events say exactly what entered and left it."""

import os
import subprocess
import sys

import pytest

from raypaged.core.block_hashing import (
    HASH_ALGOS,
    ROOT_HASH,
    block_hasher,
    encode_block,
    prefix_hash_values,
    sha256_block_hash,
)
from raypaged.core.block_pool import BlockPool, hash_block_tokens, read_event
from raypaged.core.kv_cache_manager import KVCacheManager
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams

B = 4
PROMPT = list(range(100, 114))  # three full blocks and two tokens
_IN_CHILD = ("from raypaged.core.block_hashing import prefix_hash_values, block_hasher; "
             "print(prefix_hash_values({p}, {b}, 'tenant-a', block_hasher('{a}')))")


def _values_in_child(algo: str, seed: str) -> list[int]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", _IN_CHILD.format(p=PROMPT, b=B, a=algo)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return [int(v) for v in out.strip().strip("[]").split(",")]


@pytest.mark.integration  # starts processes
def test_sha256_chain_is_the_same_in_processes_of_other_hash_seeds():
    here = prefix_hash_values(PROMPT, B, "tenant-a", block_hasher("sha256"))
    assert _values_in_child("sha256", "1") == here == _values_in_child("sha256", "2")
    # What makes sha256 necessary: Python's hash of a salted tuple differs between them.
    assert _values_in_child("builtin", "1") != _values_in_child("builtin", "2")


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_salts_and_prefixes_stay_apart(algo):
    hasher = block_hasher(algo)
    plain = prefix_hash_values(PROMPT, B, None, hasher)
    salted_a = prefix_hash_values(PROMPT, B, "a", hasher)
    salted_b = prefix_hash_values(PROMPT, B, "b", hasher)
    assert len(plain) == 3
    assert not set(plain) & set(salted_a) and not set(salted_a) & set(salted_b)
    # The chain: the second block's value depends on the first block's tokens.
    other_first = prefix_hash_values([0] + PROMPT[1:], B, None, hasher)
    assert other_first[1] != plain[1]


def test_encoding_is_canonical_and_unambiguous():
    assert encode_block(ROOT_HASH, (1, 2), ("ab", "c")) != encode_block(ROOT_HASH, (1, 2), ("a", "bc"))
    assert encode_block(ROOT_HASH, (1, 2), None) != encode_block(ROOT_HASH, (1, 2), ("",))
    assert encode_block(-5, (1,), (3,)) != encode_block(5, (1,), (3,))
    assert sha256_block_hash(7, (1, 2, 3), None) == sha256_block_hash(7, (1, 2, 3), None)
    with pytest.raises(TypeError):
        encode_block(0, (1,), (1.5,))


def test_sha256_is_the_digest_of_the_canonical_encoding_and_its_values_do_not_change():
    import hashlib

    for parent, tokens, keys in [(ROOT_HASH, (1, 2, 3, 70000), None), (-5, (9,) * 16, ("tenant", 3)),
                                 (2**255 + 1, (), ()), (7, tuple(range(64)), ("",))]:
        digest = hashlib.sha256(encode_block(parent, tokens, keys)).digest()  # OpenSSL's
        assert sha256_block_hash(parent, tokens, keys) == int.from_bytes(digest, "little")
    # Engines and frontends of other versions compare these values: they stay put.
    assert sha256_block_hash(ROOT_HASH, (1, 2, 3, 70000), None) % 2**64 == 2145811306714358956
    assert sha256_block_hash(-5, (9,) * 16, ("tenant", 3)) % 2**64 == 16573771487054497805


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_manager_hashes_blocks_as_the_frontend_does(algo):
    manager = KVCacheManager(16, B, hash_algo=algo)
    request = Request("r", PROMPT, SamplingParams(max_tokens=4), cache_salt="t")
    assert manager.allocate_slots(request, len(PROMPT)) is not None
    request.num_computed_tokens = len(PROMPT)
    manager.cache_blocks(request, len(PROMPT))
    values = [h.hash_value for h in manager._requests["r"].block_hashes]
    assert values == prefix_hash_values(PROMPT, B, "t", block_hasher(algo))


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        KVCacheManager(4, B, hash_algo="md5")


def test_events_record_stores_evictions_and_resets_in_order():
    pool = BlockPool(2)
    assert pool.take_events() == []
    h1 = hash_block_tokens(None, (1, 2), None, block_hasher("sha256"))
    h2 = hash_block_tokens(h1, (3, 4), None, block_hasher("sha256"))
    a, = pool.get_new_blocks(1)
    pool.cache_full_block(a, h1)
    assert pool.take_events() == []  # not recording: nothing kept
    pool.record_events()
    b, = pool.get_new_blocks(1)
    pool.cache_full_block(b, h2)
    pool.free_blocks([a, b])
    pool.get_new_blocks(1)  # evicts a (freed first): h1 leaves the cache
    events = [read_event(e) for e in pool.take_events()]
    assert events == [(h2.hash_value, True, False), (h1.hash_value, False, False)]
    assert pool.take_events() == []
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert [read_event(e) for e in pool.take_events()] == [(h2.hash_value, False, False)]


def test_the_host_tier_reports_what_enters_and_leaves_it():
    from raypaged.core.host_block_pool import HostBlockPool
    from raypaged.core.tiered_kv_cache_manager import TieredKVCacheManager

    sha = block_hasher("sha256")
    h1 = hash_block_tokens(None, (1, 2), None, sha)
    h2 = hash_block_tokens(h1, (3, 4), None, sha)
    h3 = hash_block_tokens(h2, (5, 6), None, sha)
    host = HostBlockPool(2)
    host.store(h1)
    assert host.take_events() == []  # not recording
    host.record_events()
    for block_hash in (h2, h1):  # h1 is there already: no event
        host_id, _ = host.store(block_hash)
        host.unpin([host_id])
    host.unpin([0])
    host.store(h3)  # evicts the least recently used unpinned block, h2
    assert [read_event(e) for e in host.take_events()] == [
        (h2.hash_value, True, True), (h2.hash_value, False, True), (h3.hash_value, True, True)]
    host.unpin([1])
    host.reset()
    assert sorted(read_event(e) for e in host.take_events()) == sorted(
        [(h1.hash_value, False, True), (h3.hash_value, False, True)])
    # The tiered manager: a cached block the GPU pool evicts leaves the GPU and enters the host
    # tier, in one batch of its events.
    manager = TieredKVCacheManager(4, B, num_host_blocks=4)
    manager.record_cache_events()
    request = Request("r", PROMPT, SamplingParams(max_tokens=1))
    assert manager.allocate_slots(request, len(PROMPT)) is not None
    request.num_computed_tokens = len(PROMPT)
    manager.cache_blocks(request, len(PROMPT))
    manager.free(request)
    values = prefix_hash_values(PROMPT, B, None, sha)
    assert [read_event(e) for e in manager.take_cache_events()] == [(v, True, False) for v in values]
    other = Request("o", list(range(500, 516)), SamplingParams(max_tokens=1))
    assert manager.allocate_slots(other, 16) is not None  # the whole pool: every cached block evicted
    events = [read_event(e) for e in manager.take_cache_events()]
    assert sorted(events) == sorted([(v, False, False) for v in values] + [(v, True, True) for v in values])


def test_builtin_values_may_be_negative_and_still_decode():
    from raypaged.core.block_pool import removed_event, stored_event

    for value in (-(2**63), -1, 0, 2**255 + 3):
        for host in (False, True):
            assert read_event(stored_event(value, host)) == (value, True, host)
            assert read_event(removed_event(value, host)) == (value, False, host)


def _counting(manager) -> list[int]:
    """Wrap the manager's chain function; the list grows by one per block hashed."""
    calls: list[int] = []
    hasher = manager._hasher

    def counted(parent, token_ids, extra_keys):
        calls.append(1)
        return hasher(parent, token_ids, extra_keys)

    manager._hasher = counted
    return calls


@pytest.mark.parametrize("kind", ["paged", "tiered-recompute", "tiered-swap"])
def test_a_block_is_hashed_once_across_preemption(kind):
    from raypaged.core.tiered_kv_cache_manager import TieredKVCacheManager

    manager = (KVCacheManager(16, B) if kind == "paged" else
               TieredKVCacheManager(16, B, num_host_blocks=8, swap_preemption=kind == "tiered-swap"))
    calls = _counting(manager)
    request = Request("r", PROMPT, SamplingParams(max_tokens=8), cache_salt="t")
    assert manager.get_computed_blocks(request) == ([], 0)  # (hashed up to its first miss)
    assert manager.allocate_slots(request, len(PROMPT)) is not None
    request.num_computed_tokens = len(PROMPT)
    manager.cache_blocks(request, len(PROMPT))
    assert len(calls) == 3  # the prompt's three full blocks
    for token in (7, 8):  # decodes fill the fourth block
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.cache_blocks(request, request.num_computed_tokens)
    assert len(calls) == 4
    manager.free_preempted(request)
    request.num_computed_tokens = 0
    # Resumption: the lookup finds every full block again without hashing any of them.
    blocks, num_tokens = manager.get_computed_blocks(request)
    assert num_tokens == 3 * B and len(calls) == 4  # (its last token is left to compute)
    hashes = [h.hash_value for h in manager._requests["r"].block_hashes]
    assert hashes == prefix_hash_values(request.all_token_ids, B, "t", block_hasher("sha256"))
    manager.free(request)
    assert "r" not in manager._requests  # ended: nothing kept


def test_preemption_keeps_no_hash_of_a_block_with_a_token_in_flight():
    from raypaged.core.request import PLACEHOLDER_TOKEN_ID

    manager = KVCacheManager(16, B, hash_algo="builtin")  # (sha256 cannot even encode one)
    request = Request("r", PROMPT, SamplingParams(max_tokens=8))
    assert manager.allocate_slots(request, len(PROMPT)) is not None
    request.num_computed_tokens = len(PROMPT)
    manager.cache_blocks(request, len(PROMPT))
    request.append_output_token(PLACEHOLDER_TOKEN_ID)  # asynchronous scheduling's next token
    request.append_output_token(PLACEHOLDER_TOKEN_ID)
    manager._hash_blocks(manager._requests["r"], 4)  # a block reaching the placeholders
    manager.free_preempted(request)
    assert len(manager._requests["r"].block_hashes) == 3
