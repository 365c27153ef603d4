"""HostKVCache: this rank's host pool of KV blocks, and the copies of each step's KVTransfers.

The pool is one tensor [num_host_blocks, pairs, 2 (K, V), block_size, kv_heads, head_dim], so a
host block is contiguous over every K/V pair: one copy moves a run of consecutive host blocks.
Its pairs are the GPU pool's distinct K/V tensor pairs, not the model's layers: with KV-cache
groups (worker/kv_layout.py) the layers at one position of different groups share a pair, a
block id names one group's block in every pair, and so a host block holds exactly one GPU
block's bytes (Worker.bytes_per_block, what the host tier's size is counted in); a shared pair is
allocated and copied once. It is
pinned on CUDA (asynchronous copies need page-locked memory; release() unpins it), plain memory
on CPU. Each rank
holds its own heads; every rank applies the same transfers (the engine decided them once).

Order, on CUDA. All copies run on one side stream, which first waits for everything already
queued on the compute stream (the previous forward may still write a block that is offloaded
now). Offloads gather their GPU blocks into a staging tensor, then copy it to the host; loads copy
host blocks to a staging tensor, then scatter it into the GPU pools. The compute stream waits for
the gather only (the offloaded blocks may then be overwritten by this step's forward while the
staged copy drains to the host) unless the step's forward reads a block it loads, when it waits
for the loads too; loads it does not read (prefetches) overlap it, and the next step's forward
waits for them (wait_for_prefetches). A load after an offload in the same stream also reads what that offload wrote.
Nothing here runs inside a captured graph: the runner applies it before the step's forward.
Each wait goes through a timing event, and the copies are bracketed by two, so a CopyTimer
(worker/copy_timing.py) reads, lazily, how long the copies took and how long the compute stream
stalled on them; on CPU the copies are timed on the host's clock, all of it exposed.
An FP8 pool's blocks move as bytes (index_copy_ has no FP8 kernel; the copy is exact either way).
"""

from __future__ import annotations

import torch

from raypaged.core.outputs import KVCopyTimes, KVTransfers
from raypaged.kernels.kv_quant import is_fp8
from raypaged.worker.copy_timing import CopyTimer, CudaMark, WallMark
from raypaged.worker.kv_layout import unique_caches

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
_CHUNK = 32  # blocks per staging tensor (an 8B model's 16-token block: 2 MiB)


class HostKVCache:
    def __init__(self, num_blocks: int, like: KVCaches) -> None:
        """A host pool of num_blocks blocks shaped like the GPU pools `like` (per layer K, V of
        [num_gpu_blocks, block_size, kv_heads, head_dim]; layers sharing a pair count once)."""
        like = unique_caches(like)
        k0 = like[0][0]
        self.device = k0.device
        self.on_cuda = self.device.type == "cuda"
        self.as_bytes = is_fp8(k0.dtype)
        self.blocks = torch.empty((num_blocks, len(like), 2, *k0.shape[1:]),
                                  dtype=torch.uint8 if self.as_bytes else k0.dtype)
        self._registered = False
        self.stream = None
        self._loaded: CudaMark | None = None  # after loads no forward has waited for yet
        self.timer = CopyTimer()
        if self.on_cuda:
            # Page-locked by registering the plain allocation: torch's pinned allocator (pin_memory=)
            # rounds every allocation up to a power of two, which at tens of GiB is real memory.
            nbytes = self.blocks.numel() * self.blocks.element_size()
            if nbytes:
                _check(torch.cuda.cudart().cudaHostRegister(self.blocks.data_ptr(), nbytes, 0), "register")
                self._registered = True
            self.stream = torch.cuda.Stream(self.device)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    def release(self) -> None:
        """Unpin the pool (after every copy is done) before its memory goes back."""
        if self._registered:
            torch.cuda.synchronize(self.device)
            _check(torch.cuda.cudart().cudaHostUnregister(self.blocks.data_ptr()), "unregister")
            self._registered = False
        self.blocks = torch.empty(0)

    def apply(self, transfers: KVTransfers, kv_caches: KVCaches) -> None:
        """Offloads, then loads (KVTransfers' order), ordered with the compute stream. kv_caches:
        per layer, as the pool was built from (shared pairs once)."""
        kv_caches = unique_caches(kv_caches)
        if len(kv_caches) != self.blocks.shape[1]:
            raise ValueError(f"{len(kv_caches)} K/V pairs for a host pool of {self.blocks.shape[1]}")
        if self.as_bytes:
            kv_caches = [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in kv_caches]
        if self.stream is None:
            began = WallMark()
            self._offload(transfers.offloads, kv_caches)
            self._load(transfers.loads, kv_caches)
            ended = WallMark()
            self.timer.copied(began, ended)
            self.timer.stalled(began, ended)  # synchronous: the step waited for all of it
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        read_now = transfers.loads and transfers.loads_read_now
        with torch.cuda.stream(self.stream):
            # After the wait for the compute stream: what it times is the copies alone.
            start = CudaMark(self.stream)
            gathered = self._offload(transfers.offloads, kv_caches)
            if not read_now:
                assert gathered is not None
                self._wait(compute, gathered)
            self._load(transfers.loads, kv_caches)
            end = CudaMark(self.stream)
            self.timer.copied(start, end)
            if transfers.loads and not read_now:  # prefetches: the next step's forward waits
                self._loaded = end
        if read_now:
            self._wait(compute, end)  # as wait_stream: end is the stream's last work

    def wait_for_prefetches(self) -> None:
        """Before a step's forward (every step): the compute stream waits for the loads the
        previous step let overlap its forward."""
        if self._loaded is not None:
            self._wait(torch.cuda.current_stream(self.device), self._loaded)
            self._loaded = None

    def copy_times(self) -> KVCopyTimes:
        """This rank's copy and exposed seconds so far: the copies whose events are done (a
        step's are, typically, by the next step; never waited for here)."""
        return self.timer.totals()

    def _wait(self, compute: torch.cuda.Stream, awaited: CudaMark) -> None:
        """The compute stream waits for `awaited`; the timer gets where it stood when it did."""
        self.timer.stalled(CudaMark(compute), awaited)
        compute.wait_event(awaited.event)

    def _offload(self, pairs: list[tuple[int, int]], kv_caches: KVCaches) -> CudaMark | None:
        """Copy GPU blocks to host blocks. Returns (CUDA) the mark after the last gather."""
        gathered: CudaMark | None = None
        chunks = _chunks(sorted(pairs, key=lambda pair: pair[1]))  # by host block: runs copy at once
        for i, chunk in enumerate(chunks):
            gpu_ids = self._ids([gpu for gpu, _ in chunk])
            staged = torch.stack([torch.stack((k.index_select(0, gpu_ids), v.index_select(0, gpu_ids)), dim=1)
                                  for k, v in kv_caches], dim=1)
            if self.stream is not None and i == len(chunks) - 1:
                gathered = CudaMark(self.stream)
            self._to_host(staged, [host for _, host in chunk])
        if self.stream is not None and not chunks:
            gathered = CudaMark(self.stream)
        return gathered

    def _to_host(self, staged: torch.Tensor, host_ids: list[int]) -> None:
        for start, host_start, count in _runs(host_ids):
            self.blocks[host_start:host_start + count].copy_(staged[start:start + count],
                                                             non_blocking=self.on_cuda)

    def _load(self, pairs: list[tuple[int, int]], kv_caches: KVCaches) -> None:
        """Copy host blocks into GPU blocks (no GPU block twice)."""
        for chunk in _chunks(sorted(pairs)):  # by host block
            staged = torch.empty((len(chunk), *self.blocks.shape[1:]), dtype=self.blocks.dtype,
                                 device=self.device)
            for start, host_start, count in _runs([host for host, _ in chunk]):
                staged[start:start + count].copy_(self.blocks[host_start:host_start + count],
                                                  non_blocking=self.on_cuda)
            gpu_ids = self._ids([gpu for _, gpu in chunk])
            for layer, (k, v) in enumerate(kv_caches):
                k.index_copy_(0, gpu_ids, staged[:, layer, 0])
                v.index_copy_(0, gpu_ids, staged[:, layer, 1])

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64).to(self.device)


def _check(status: object, what: str) -> None:
    code = getattr(status, "value", status)  # an enum in some torch builds, an int in others
    if code != 0:
        raise RuntimeError(f"cudaHost{what.capitalize()} of the host KV pool failed: error {code}")


def _chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """At most _CHUNK blocks staged at once: the staging tensor is device memory the KV pool's
    sizing did not leave room for."""
    return [pairs[i:i + _CHUNK] for i in range(0, len(pairs), _CHUNK)]


def _runs(sorted_ids: list[int]) -> list[tuple[int, int, int]]:
    """(index, first id, length) of each run of consecutive ids in an ascending list."""
    runs: list[tuple[int, int, int]] = []
    for index, block in enumerate(sorted_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((index, block, 1))
    return runs
