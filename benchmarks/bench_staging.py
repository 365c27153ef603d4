"""A decode step's integer inputs, host → GPU: one pageable copy per array (`.to(device,
non_blocking=True)` from numpy, the ModelRunner before DeviceStaging) against DeviceStaging's
packed pinned copies. Host time per step, the GPU idle at the start of each as between steps.

    python benchmarks/bench_staging.py        # needs CUDA

Writes benchmarks/results/staging_<device>.json.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_json  # noqa: E402

from raypaged.worker.staging import DeviceStaging  # noqa: E402


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

        def pageable():
            [torch.from_numpy(a).to(device, non_blocking=True) for a in longs]
            [torch.from_numpy(a.astype(np.int32)).to(device, non_blocking=True) for a in ints]

        def staged():
            staging.upload(longs, torch.int64)
            staging.upload(ints, torch.int32)

        for fn in (pageable, staged):
            fn()
        row = {"batch": batch, "pageable_us": host_us(pageable), "staged_us": host_us(staged)}
        result["rows"].append(row)
        print(f"batch {batch}: six pageable copies {row['pageable_us']:.0f} us, "
              f"staged {row['staged_us']:.0f} us", flush=True)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None  # the GPU machine's $OUT
    name = "staging_" + torch.cuda.get_device_name().split()[-1].lower()
    print(f"wrote {write_json(name, result, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
