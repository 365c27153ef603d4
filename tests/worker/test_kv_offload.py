"""HostKVCache: a step's offloads then loads move exactly the named blocks of every layer's K and
V, on CPU (plain memory) and on CUDA (pinned memory, the copy stream, ordered with the forward)."""

from __future__ import annotations

import pytest
import torch

from raypaged.core.outputs import KVCopyTimes, KVTransfers
from raypaged.worker.kv_offload import HostKVCache, _runs


def pools(num_blocks: int, device: str, layers: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, 4, 2, 8)  # blocks, block_size, kv_heads, head_dim
    return [(torch.randn(shape, device=device), torch.randn(shape, device=device)) for _ in range(layers)]


def roundtrip(device: str, chunk: int | None = None) -> None:
    kv = pools(10, device)
    before = [(k.clone(), v.clone()) for k, v in kv]
    host = HostKVCache(6, kv)
    # Offload GPU blocks 7, 2, 3 to host blocks 4, 0, 1 (two runs); a load in the same step reads
    # host block 0, which the offload just wrote, into GPU block 9.
    host.apply(KVTransfers(offloads=[(7, 4), (2, 0), (3, 1)], loads=[(0, 9)]), kv)
    for (k, v), (k0, v0) in zip(kv, before):
        assert torch.equal(k[9], k0[2]) and torch.equal(v[9], v0[2])
    # The forward may now overwrite the offloaded blocks; they come back from the host.
    for k, v in kv:
        k[[7, 2, 3]] = 0.0
        v[[7, 2, 3]] = 0.0
    # Prefetches: not waited for by this step's forward, by the next one's.
    host.apply(KVTransfers(loads=[(4, 5), (1, 6), (0, 2)], loads_read_now=False), kv)
    host.wait_for_prefetches()
    for (k, v), (k0, v0) in zip(kv, before):
        for gpu, original in [(5, 7), (6, 3), (2, 2), (9, 2)]:
            assert torch.equal(k[gpu], k0[original]) and torch.equal(v[gpu], v0[original])
        for untouched in (0, 1, 4, 8):
            assert torch.equal(k[untouched], k0[untouched]) and torch.equal(v[untouched], v0[untouched])


def test_offload_then_load_on_cpu():
    roundtrip("cpu")


def test_many_blocks_are_staged_in_chunks(monkeypatch):
    monkeypatch.setattr("raypaged.worker.kv_offload._CHUNK", 2)
    kv = pools(12, "cpu", layers=2)
    before = [(k.clone(), v.clone()) for k, v in kv]
    host = HostKVCache(12, kv)
    host.apply(KVTransfers(offloads=[(i, 11 - i) for i in range(7)]), kv)
    host.apply(KVTransfers(loads=[(11 - i, i + 5) for i in range(7)]), kv)
    for (k, _), (k0, _) in zip(kv, before):
        assert all(torch.equal(k[i + 5], k0[i]) for i in range(7))


def test_layers_sharing_kv_pairs_are_allocated_and_copied_once():
    """With KV-cache groups the model's layers share the pool's K/V pairs (Gemma 2's three layers,
    three groups of one, share one pair). The host pool holds one block's bytes per block, as the host
    tier's size counts them, and a block of any group goes out and comes back whole."""
    from raypaged.core.kv_cache_groups import group_layers
    from raypaged.worker.kv_layout import KVLayout

    layout = KVLayout(group_layers([4, None, 4, None, 4, 4]), 6)  # 3 groups of 2 layers: 2 pairs
    assert layout.layers_per_block == 2
    pool = pools(8, "cpu", layers=layout.layers_per_block)
    per_layer = layout.per_layer(pool)
    # A view of the same storage is the same pair too.
    per_layer[3] = (per_layer[3][0].view(per_layer[3][0].shape), per_layer[3][1][:])
    host = HostKVCache(4, per_layer)
    assert host.blocks.shape[1] == 2  # not 6
    assert host.blocks[0].numel() * host.blocks.element_size() == 2 * 2 * pool[0][0][0].numel() * 4
    before = [(k.clone(), v.clone()) for k, v in pool]
    host.apply(KVTransfers(offloads=[(1, 0), (6, 3)]), per_layer)
    for kk, vv in pool:
        kk[[1, 6]] = 0.0
        vv[[1, 6]] = 0.0
    host.apply(KVTransfers(loads=[(0, 2), (3, 5)]), per_layer)
    for (kk, vv), (k0, v0) in zip(pool, before):
        assert torch.equal(kk[2], k0[1]) and torch.equal(vv[5], v0[6])
    with pytest.raises(ValueError, match="K/V pairs"):
        host.apply(KVTransfers(loads=[(0, 2)]), pools(8, "cpu", layers=3))


def test_runs_of_consecutive_ids():
    assert _runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]
    assert _runs([]) == []


@pytest.mark.gpu
def test_offload_then_load_on_cuda_with_pinned_memory_and_a_copy_stream():
    assert torch.cuda.is_available()
    host = HostKVCache(2, pools(2, "cuda"))
    assert host.blocks.is_pinned() and host.stream is not None
    host.release()
    roundtrip("cuda")


def test_on_cpu_the_copies_are_timed_and_all_of_it_exposed():
    kv = pools(10, "cpu")
    host = HostKVCache(6, kv)
    assert host.copy_times() == KVCopyTimes()
    host.apply(KVTransfers(offloads=[(7, 4), (2, 0)], loads=[(0, 9)]), kv)
    first = host.copy_times()
    assert first.copy_s > 0 and first.exposed_s == first.copy_s and first.hidden_s == 0
    assert host.copy_times() == first  # read again: nothing counted twice
    host.apply(KVTransfers(loads=[(4, 5)], loads_read_now=False), kv)  # synchronous too on CPU
    host.wait_for_prefetches()
    second = host.copy_times()
    assert second.copy_s > first.copy_s and second.exposed_s == second.copy_s


@pytest.mark.gpu
def test_on_cuda_prefetches_overlap_the_forward_and_loads_read_now_do_not():
    """A prefetch-only step's loads run beside the compute stream's work and the next step's
    wait finds them done: mostly hidden. Loads the step reads are waited for at once: mostly
    exposed: the compute stream and the copies both wait for the previous forward, then the
    former for the latter. (Ratios of the split, from the copies' own events, not durations.)"""
    assert torch.cuda.is_available()
    kv = [(torch.randn((64, 16, 8, 128), device="cuda"), torch.randn((64, 16, 8, 128), device="cuda"))
          for _ in range(8)]  # 32 blocks: 32 MiB each way
    host = HostKVCache(64, kv)
    host.apply(KVTransfers(offloads=[(i, i) for i in range(32)]), kv)
    torch.cuda.synchronize()
    before = host.copy_times()
    assert before.copy_s > 0 and host.timer.num_unread == 0

    host.apply(KVTransfers(loads=[(i, 32 + i) for i in range(32)], loads_read_now=False), kv)
    a = torch.randn((4096, 4096), device="cuda")
    for _ in range(50):  # the forward: far longer than the loads
        a = (a @ a).tanh_()
    host.wait_for_prefetches()
    torch.cuda.synchronize()
    prefetch = host.copy_times()
    copy_s, exposed_s = prefetch.copy_s - before.copy_s, prefetch.exposed_s - before.exposed_s
    assert copy_s > 0 and exposed_s < 0.25 * copy_s

    for _ in range(10):  # the previous forward: the copies start once it is done
        a = (a @ a).tanh_()
    host.apply(KVTransfers(loads=[(i, i) for i in range(32)]), kv)  # read now
    torch.cuda.synchronize()
    read_now = host.copy_times()
    copy_s, exposed_s = read_now.copy_s - prefetch.copy_s, read_now.exposed_s - prefetch.exposed_s
    assert copy_s > 0 and exposed_s > 0.5 * copy_s
    host.release()
