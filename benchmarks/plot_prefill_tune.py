"""Plot a prefill tuning run (scripts/gpu_prefill_tune.sh's JSON): TFLOP/s of every variant at
each size, beside torch SDPA and the 0.8x SDPA target, all measured in that one run.

    python benchmarks/plot_prefill_tune.py [benchmarks/results/kernels_h200_tune_prefill2.json]

Writes the PNG beside the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT = Path(__file__).resolve().parent / "results" / "kernels_h200_tune_prefill2.json"


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    run = json.loads(path.read_text())
    sizes = sorted(run["sdpa"], key=int)
    variants = sorted(run["timings"], key=lambda v: -run["timings"][v][sizes[0]]["TFLOPs"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(sizes)
    for k, size in enumerate(sizes):
        values = [run["timings"][v][size]["TFLOPs"] for v in variants]
        xs = [i + k * width for i in range(len(variants))]
        ax.bar(xs, values, width, label=f"{int(size):,} tokens")
        sdpa = run["sdpa"][size]["TFLOPs"]
        ax.hlines([sdpa, 0.8 * sdpa], -0.5, len(variants), colors=f"C{k}",
                  linestyles=["-", ":"], linewidth=1)
    ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(variants))])
    from raypaged.kernels.paged_prefill import CUDA_DEFAULT

    def label(v: str) -> str:
        if v == CUDA_DEFAULT:
            return f"{v} (default)"
        return f"{v} (default in that run)" if v == run.get("default_variant") else v

    ax.set_xticklabels([label(v) for v in variants], rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s (causal, bf16, 32 q / 8 kv heads, d 128)")
    ax.set_title(f"paged prefill variants on the {run['env']['device']} ({run['env']['commit']}); "
                 "lines: SDPA (solid), 0.8x SDPA (dotted)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
