"""A decode step's integer inputs, host → GPU: one pageable copy per array (`.to(device,
non_blocking=True)` from numpy, what the ModelRunner does) against packing them into pinned
buffers sent with one copy per dtype (DeviceStaging below). Host time per step, the GPU idle at
the start of each as between steps.

    python -m benchmarks.bench_staging        # needs CUDA; scripts/gpu.sh staging

Writes staging_<device>.json to $OUT when set (the device machine's), else benchmarks/results/.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.lib.common import device_tag, environment, write_json

# The alternative measured here (and dropped from the ModelRunner for losing): pack the step's
# arrays into one pinned host buffer per dtype and send each with one asynchronous copy.
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


class DeviceStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._device: dict[torch.dtype, torch.Tensor] = {}
        # The last copy out of each host buffer: it must finish before the buffer is rewritten
        # (a TP rank other than 0 never waits for its step's results, so nothing else orders it).
        self._copied: dict[torch.dtype, torch.cuda.Event] = {}

    def upload(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """Device tensors equal to `arrays` (cast to dtype), in order and of the same shapes.
        They stay valid until the next upload of the same dtype."""
        if not self.on_cuda:  # the CPU path reads the arrays where they are
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=_NUMPY[dtype])) for a in arrays]
        total = sum(a.size for a in arrays)
        host, dev = self._buffers(dtype, max(total, 1))
        event = self._copied.get(dtype)
        if event is not None:
            event.synchronize()
        flat = host.numpy()
        offset = 0
        for a in arrays:
            flat[offset:offset + a.size] = a.reshape(-1)
            offset += a.size
        dev[:total].copy_(host[:total], non_blocking=True)
        if event is None:
            event = self._copied[dtype] = torch.cuda.Event()
        event.record()
        views, offset = [], 0
        for a in arrays:
            views.append(dev[offset:offset + a.size].view(a.shape))
            offset += a.size
        return views

    def _buffers(self, dtype: torch.dtype, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        host = self._host.get(dtype)
        if host is None or host.numel() < size:
            capacity = max(size, 2 * (host.numel() if host is not None else 4096))
            event = self._copied.get(dtype)
            if event is not None:  # the old buffers may still be in flight
                event.synchronize()
            host = self._host[dtype] = torch.empty(capacity, dtype=dtype, pin_memory=True)
            self._device[dtype] = torch.empty(capacity, dtype=dtype, device=self.device)
        return host, self._device[dtype]



def step_arrays(batch: int, context: int = 1024, block_size: int = 16):
    rng = np.random.default_rng(batch)
    width = -(-context // block_size)
    seq_lens = np.full(batch, context, dtype=np.int64)
    positions = seq_lens - 1
    tables = rng.integers(0, 50_000, size=(batch, width)).astype(np.int32)
    slots = tables[np.arange(batch), positions // block_size].astype(np.int64) * block_size + positions % block_size
    ids = rng.integers(0, 128_000, size=batch).astype(np.int64)
    starts = np.arange(batch + 1, dtype=np.int64)
    return [ids, positions, slots], [seq_lens, starts, tables]


def host_us(fn, iterations: int = 500) -> float:
    times = []
    for _ in range(iterations):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> int:
    device = torch.device("cuda")
    staging = DeviceStaging(device)
    result = {"env": environment(), "rows": []}
    for batch in (1, 64, 256):
        longs, ints = step_arrays(batch)

        def pageable(longs=longs, ints=ints):
            [torch.from_numpy(a).to(device, non_blocking=True) for a in longs]
            [torch.from_numpy(a.astype(np.int32)).to(device, non_blocking=True) for a in ints]

        def staged(longs=longs, ints=ints):
            staging.upload(longs, torch.int64)
            staging.upload(ints, torch.int32)

        for fn in (pageable, staged):
            fn()
        row = {"batch": batch, "pageable_us": host_us(pageable), "staged_us": host_us(staged)}
        result["rows"].append(row)
        print(f"batch {batch}: six pageable copies {row['pageable_us']:.0f} us, "
              f"staged {row['staged_us']:.0f} us", flush=True)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None  # the GPU machine's $OUT
    name = f"staging_{device_tag()}"
    print(f"wrote {write_json(name, result, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
