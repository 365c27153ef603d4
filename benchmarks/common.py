"""What every benchmark shares: the environment record, the copy-bandwidth ceiling, JSON output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    """Commit, device and versions. On the GPU machine the tree has no .git: the launching
    command passes the commit in RAYPAGED_COMMIT."""
    commit = os.environ.get("RAYPAGED_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=RESULTS.parent, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    import transformers
    import triton

    return {
        "commit": commit,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
    }


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Device-to-device copy, bytes read + written per second (median of CUDA-event timings)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    if device.type != "cuda":
        import time

        times = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return 2 * nbytes / sorted(times)[2]
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def write_json(name: str, result: dict, out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or os.environ.get("RAYPAGED_RESULTS_DIR") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
