"""A ShadowWorker with a host tier of blocks: it applies each step's transfers (offloads, then
loads; prefetched loads only after the forward) to a host pool of its own, so the read check of
every K/V proves a host hit brings back the reader's own prefix. Shared by the tiered managers'
property tests (tests/core/test_tiered_kv_cache.py, tests/core/test_tiered_hybrid_kv_cache.py).
"""

from __future__ import annotations

from raypaged.core.outputs import SchedulerOutput
from tests.support.core_fakes import ShadowWorker


class TierShadowWorker(ShadowWorker):
    """A ShadowWorker with a host pool: each step's offloads, then loads, before the rest."""

    def __init__(self, num_host_blocks: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host: list[list[int | None] | None] = [None] * num_host_blocks
        self.num_offloads = self.num_loads = self.num_prefetched = 0

    def _execute(self, out: SchedulerOutput):
        transfers = out.kv_transfers
        if transfers is not None:
            assert transfers, "an empty KVTransfers is sent as None"
            hosts = [host for _, host in transfers.offloads]
            gpus = [gpu for _, gpu in transfers.loads]
            assert len(set(hosts)) == len(hosts) and len(set(gpus)) == len(gpus)
            for gpu, host in transfers.offloads:
                assert None not in self.kv[gpu], f"offloading block {gpu}, which is not full"
                self.host[host] = list(self.kv[gpu])
            loads = [(host, gpu, self.host[host]) for host, gpu in transfers.loads]
            assert all(data is not None for _, _, data in loads), "loading a host block holding nothing"
            if transfers.loads_read_now:
                self._load(loads)
            self.num_offloads += len(transfers.offloads)
            self.num_loads += len(transfers.loads)
        result = super()._execute(out)
        if transfers is not None and not transfers.loads_read_now:
            # Prefetches overlap the forward: as if they landed only after it (a read of one
            # in this step would read the block's old contents, and fail the read check).
            self._load(loads)
            self.num_prefetched += len(loads)
        return result

    def _load(self, loads) -> None:
        for _, gpu, data in loads:
            self.kv[gpu] = list(data)
