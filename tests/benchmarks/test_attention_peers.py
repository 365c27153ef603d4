"""FlashInfer's page table built from raypaged's block tables (benchmarks/lib/attention_peers.py):
read back through it, every request's tokens are the ones raypaged's pool holds for it. (The
FlashInfer wrappers themselves run only on the GPU.)"""

from __future__ import annotations

import torch

from benchmarks.lib.attention_peers import page_table
from raypaged.kernels.testing import random_paged_batch


def test_the_page_table_reads_back_each_request_in_order():
    block_size, lens = 16, [1, 16, 17, 40, 32, 5]
    batch = random_paged_batch(lens, 2, 8, block_size, generator=torch.Generator().manual_seed(0))
    indptr, indices, last = page_table(batch.block_tables, batch.seq_lens, block_size)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == [0, 1, 2, 4, 7, 9, 10]
    assert last.tolist() == [1, 16, 1, 8, 16, 5]
    for s, n in enumerate(lens):
        pages = indices[indptr[s]:indptr[s + 1]].long()
        tokens = batch.k_cache[pages].flatten(0, 1)[: (len(pages) - 1) * block_size + int(last[s])]
        assert len(tokens) == n
        assert torch.equal(tokens, batch.keys[s])  # finite: no poisoned slot is named
