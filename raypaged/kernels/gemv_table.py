"""Tuned launch configs of the skinny GEMM (gemv.py), one JSON table per GPU model.

`benchmarks/bench_gemv.py --tune-rows 64 --table raypaged/kernels/configs/gemv_<device>.json` sweeps the
kernel's launch configs on each weight shape of a model at a padded row count, times the best
against cuBLAS in the same run and records, per (dtype, out, in, rows), which one was faster and
the config: ops.linear then sends a product of that shape to the kernel only where it won. A
shape the table does not list falls back to gemv.py's default rule. Like the tuned configs vLLM
keeps per device for its fused MoE kernels, a table is measured data, committed beside the code.

Format: {"device": name, "env": {...}, "entries": [{"dtype", "out", "in", "rows", "backend":
"triton" | "cublas", "config": {...}, "triton_TBps", "cublas_TBps"}]}. The fused W8A8 kernel
(gemm_w8a8.py) keeps its entries here too, under its own dtype key "float8_e4m3fn_w8a8", with
"backend": "triton" | "engine" (the path the engine runs without it) and the times of both.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def table_path(device_name: str, directory: Path = CONFIG_DIR) -> Path:
    """Where the table of a GPU model lives: "NVIDIA H200" -> configs/gemv_nvidia_h200.json."""
    return directory / f"gemv_{re.sub(r'[^a-z0-9]+', '_', device_name.lower()).strip('_')}.json"


def _key(dtype: str, out_features: int, in_features: int, rows: int) -> tuple:
    return dtype, out_features, in_features, rows


@functools.cache
def _load(path: Path) -> dict[tuple, dict]:
    if not path.exists():
        return {}
    table = json.loads(path.read_text())
    return {_key(e["dtype"], e["out"], e["in"], e["rows"]): e for e in table["entries"]}


def lookup(device_name: str, dtype: str, out_features: int, in_features: int, rows: int,
           directory: Path = CONFIG_DIR) -> dict | None:
    """The table's entry for a [rows, in] x [out, in]ᵀ product in `dtype` ("bfloat16") on the
    named GPU model, or None. `rows` is the padded row count (16, 32, 64)."""
    return _load(table_path(device_name, directory)).get(_key(dtype, out_features, in_features, rows))


def record(path: Path, device_name: str, env: dict, entries: list[dict]) -> None:
    """Add `entries` to the table at `path` (replacing those of the same key) and write it."""
    table: dict[str, Any] = (json.loads(path.read_text()) if path.exists()
                             else {"device": device_name, "entries": []})
    if table["device"] != device_name:
        raise ValueError(f"{path} is the table of {table['device']}, not {device_name}")
    merged = {_key(e["dtype"], e["out"], e["in"], e["rows"]): e for e in table["entries"] + entries}
    table["env"] = env
    table["entries"] = sorted(merged.values(), key=lambda e: (e["dtype"], e["rows"], e["out"], e["in"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    _load.cache_clear()
