"""Where an offline run's steps spend their time (bench_throughput --profile-steps): a window of
engine steps in the middle of the run — mixed prefill chunks and decodes, as the workload makes
them — traced with torch.profiler, the GPU's kernels summed by family per step.

What it answers: why one precision's steps are slower than another's on the same requests (FP8
weights + FP8 KV against bf16, issue 22: GEMMs, the activations' quantization, attention over
the FP8 pool, or the rest). The window's steps run under the profiler, so its wall time per step
is a little above the untraced run's; the families' shares are what to read. On CPU there are no
CUDA kernels: the window records its wall time and the engine's batch, families stay empty.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.lib.common import sync
from benchmarks.lib.trace import cuda_kernels, kernel_family

TOP_KERNELS = 16


class StepProfiler:
    """Traces the engine steps numbered [start, start + count) of one run (1-based, as counted
    by the run's loop), if the run gets that far; `result` is None until the window is done."""

    def __init__(self, start: int, count: int, device: torch.device) -> None:
        if start < 1 or count < 1:
            raise ValueError(f"a step window needs start >= 1 and count >= 1, got {start}, {count}")
        self.start, self.count, self.device = start, count, device
        self.result: dict[str, Any] | None = None
        self._profile: profile | None = None
        self._began = 0.0
        self._batch_at_start: tuple[int, int] = (0, 0)

    def before_step(self, step: int, running: int, waiting: int) -> None:
        """Called before the loop's step number `step` with the engine's running / waiting count."""
        if step != self.start:
            return
        sync(self.device)
        cuda = self.device.type == "cuda"
        self._profile = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self._profile.__enter__()
        self._batch_at_start = (running, waiting)
        self._began = time.perf_counter()

    def after_step(self, step: int, running: int, waiting: int) -> None:
        """Called after step number `step`; closes the window after its last step."""
        if self._profile is None or step != self.start + self.count - 1:
            return
        sync(self.device)
        wall_s = time.perf_counter() - self._began
        self._profile.__exit__(None, None, None)
        self.result = summarize(self._profile, self.count, wall_s, self._batch_at_start, (running, waiting))
        self._profile = None


def summarize(prof: profile, steps: int, wall_s: float, batch_at_start: tuple[int, int],
              batch_at_end: tuple[int, int]) -> dict[str, Any]:
    """The window's record: ms per step of wall time, of GPU busy time, per kernel family and
    per kernel (the top ones), and the batch at its two ends."""
    kernels = {name: us / 1e3 for name, us in cuda_kernels(prof)[0].items()}
    families: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        families[kernel_family(name)] += ms / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {
        "steps": steps, "wall_ms_per_step": wall_s * 1e3 / steps,
        "busy_ms_per_step": sum(kernels.values()) / steps,
        "families_ms_per_step": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms_per_step": [(name[:120], ms / steps) for name, ms in top],
        "running_waiting_at_start": list(batch_at_start), "running_waiting_at_end": list(batch_at_end),
    }
