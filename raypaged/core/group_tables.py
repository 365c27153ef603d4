"""Every KV-cache group's block ids in a step's SchedulerOutput, for models whose layers differ.

The scheduler builds its output from group 0's table alone (block_ids, new_block_ids: what its
slot accounting reads). A manager with several groups (HybridKVCacheManager) grows every
group's table by the same count in the same allocation, so once the step is scheduled the
other groups' entries are each table's tail of that length: attach_group_tables adds them,
whole for a request sent new, the appended tail for a cached one. One group: nothing to add.
"""

from __future__ import annotations

from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.outputs import SchedulerOutput


def attach_group_tables(out: SchedulerOutput, kv: KVCacheManagerInterface) -> None:
    """Fill out's per-group block ids from kv (after the step's allocations, before it is sent)."""
    if kv.num_groups == 1:
        return
    tables = kv.get_group_block_ids
    for new in out.scheduled_new_reqs:
        new.group_block_ids = tables(new.req_id)
        if new.group_block_ids[0] != new.block_ids:
            raise RuntimeError(f"request {new.req_id!r}: group 0's table changed after it was sent")
    cached = out.scheduled_cached_reqs
    grown = out.group_new_block_ids
    for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
        if new_blocks:
            grown[req_id] = tables(req_id, len(new_blocks))
