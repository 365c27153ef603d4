"""What the attention-kernel benchmark (benchmarks/bench_kernels.py) concludes from its rows: each
row's derived figures (bandwidth, TFLOP/s, the ratios to the peers), the issue's targets and
whether they are met, the table printed last, and the plot.

A row holds one case; row["impls"][name] one implementation, whose "seconds" exist only if its
check against the fp32 reference passed (status "ok"). A peer's figure is the better of its
kernels: FlashInfer's two decode kernels (CUDA cores, tensor cores), SDPA's two layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.lib.attention_peers import SDPA_DECODE_LAYOUTS, SDPA_PREFILL_LAYOUTS

# Issue 19's targets.
TARGETS = {
    # Decode shapes whose bytes exceed the floor below: raypaged's achieved bandwidth over the copy
    # bandwidth of the same run. Smaller problems are judged by their time against SDPA.
    "decode_frac_copy_min": 0.85,
    "decode_frac_copy_above_bytes": 200e6,
    # Mixed-length decode: FlashInfer's better kernel's time over raypaged's.
    "mixed_speedup_vs_flashinfer_min": 1.3,
    # Prefill with a cached prefix: FlashInfer's time over raypaged's.
    "extend_speedup_vs_flashinfer_min": 1.0,
    # Prefill without one: SDPA's time over raypaged's.
    "fresh_speedup_vs_sdpa_min": 0.95,
}
PEERS: dict[str, dict[str, tuple[str, ...]]] = {
    "decode": {"flashinfer": ("flashinfer_decode", "flashinfer_decode_tc"), "sdpa": SDPA_DECODE_LAYOUTS},
    "prefill": {"flashinfer": ("flashinfer_prefill",), "sdpa": SDPA_PREFILL_LAYOUTS},
}


def best(row: dict, names: tuple[str, ...]) -> tuple[str | None, float | None]:
    """The fastest of `names` that passed its check, and its seconds (None, None if none did)."""
    timed = [(row["impls"][n]["seconds"], n) for n in names if "seconds" in row["impls"].get(n, {})]
    if not timed:
        return None, None
    seconds, name = min(timed)
    return name, seconds


def add_figures(row: dict, section: str, copy_bw: float) -> None:
    """Per implementation (and raypaged's sweep, if any): µs and, for decode, TB/s and fraction of
    copy bandwidth (bytes = all a step must move), for prefill TFLOP/s; per peer: its best kernel
    and raypaged's speed-up over it (the peer's seconds over raypaged's: above 1, raypaged is
    faster)."""
    entries = [*row["impls"].values(), *row["impls"]["raypaged"].get("sweep", [])]
    for entry in entries:
        if "seconds" not in entry:
            continue
        seconds = entry["seconds"]
        entry["us"] = seconds * 1e6
        if section == "decode":
            entry["TBps"] = row["bytes"] / seconds / 1e12
            entry["frac_copy"] = row["bytes"] / seconds / copy_bw
        else:
            entry["TFLOPs"] = row["flops"] / seconds / 1e12
    ours = row["impls"]["raypaged"].get("seconds")
    for peer, names in PEERS[section].items():
        name, seconds = best(row, names)
        row[f"{peer}_best"] = name
        row[f"speedup_vs_{peer}"] = seconds / ours if ours and seconds else None
    if section == "decode":
        row["small"] = row["bytes"] <= TARGETS["decode_frac_copy_above_bytes"]


def _verdict(values: dict[str, float | None], minimum: float) -> dict:
    """Met when every case was measured (raypaged and the peer both checked and timed) and reaches
    the minimum."""
    failing = [name for name, v in values.items() if v is not None and v < minimum]
    unmeasured = [name for name, v in values.items() if v is None]
    return {"met": bool(values) and not failing and not unmeasured, "minimum": minimum, "values": values,
            "failing": failing, "unmeasured": unmeasured}


def targets_met(result: dict) -> dict:
    decode, prefill = result["decode"], result["prefill"]
    big = {r["name"]: r["impls"]["raypaged"].get("frac_copy") for r in decode if not r["small"]}
    mixed = {r["name"]: r["speedup_vs_flashinfer"] for r in decode if r["kind"] == "mixed"}
    extend = {r["name"]: r["speedup_vs_flashinfer"] for r in prefill if any(r["cached"])}
    fresh = {r["name"]: r["speedup_vs_sdpa"] for r in prefill if not any(r["cached"])}
    return {
        "decode_frac_copy": _verdict(big, TARGETS["decode_frac_copy_min"]),
        "mixed_speedup_vs_flashinfer": _verdict(mixed, TARGETS["mixed_speedup_vs_flashinfer_min"]),
        "extend_speedup_vs_flashinfer": _verdict(extend, TARGETS["extend_speedup_vs_flashinfer_min"]),
        "fresh_speedup_vs_sdpa": _verdict(fresh, TARGETS["fresh_speedup_vs_sdpa_min"]),
    }


def _time(impl: str, key: str = "us", fmt: str = ".1f") -> Callable[[dict], str]:
    """A column of one implementation's figure, or its status where it has none."""
    return lambda row: format(row["impls"][impl][key], fmt) if key in row["impls"][impl] else \
        row["impls"][impl]["status"][:7]


def _ratio(peer: str) -> Callable[[dict], str]:
    return lambda row: f"{row[f'speedup_vs_{peer}']:.2f}x" if row[f"speedup_vs_{peer}"] else "-"


def _sdpa_time(layouts: tuple[str, ...]) -> Callable[[dict], str]:
    return lambda row: _time(row.get("sdpa_best") or layouts[0])(row)


COLUMNS: dict[str, list[tuple[str, Callable[[dict], str]]]] = {
    "decode": [("MB", lambda row: f"{row['bytes'] / 1e6:.0f}"), ("raypaged", _time("raypaged")),
               ("%copy", _time("raypaged", "frac_copy", ".0%")), ("FI cuda", _time("flashinfer_decode")),
               ("FI tc", _time("flashinfer_decode_tc")), ("SDPA", _sdpa_time(SDPA_DECODE_LAYOUTS)),
               ("vs FI", _ratio("flashinfer")), ("vs SDPA", _ratio("sdpa"))],
    "prefill": [("TFLOP", lambda row: f"{row['flops'] / 1e12:.3f}"), ("raypaged", _time("raypaged")),
                ("TFLOP/s", _time("raypaged", "TFLOPs", ".0f")), ("FI", _time("flashinfer_prefill")),
                ("SDPA", _sdpa_time(SDPA_PREFILL_LAYOUTS)), ("vs FI", _ratio("flashinfer")),
                ("vs SDPA", _ratio("sdpa"))],
}


def table(result: dict) -> list[str]:
    """The summary: µs per implementation (or why there is none), raypaged's share of the copy
    bandwidth or TFLOP/s, and its speed-ups over the peers' best; then the targets."""
    lines = [f"copy {result['copy_TBps']:.2f} TB/s   commit {str(result['env'].get('commit'))[:10]}"
             f"   FlashInfer: {result['flashinfer']}"]
    for section, columns in COLUMNS.items():
        lines.append(f"{section + ' case':<40}" + "".join(f" {title:>9}" for title, _ in columns))
        for row in result[section]:
            lines.append(f"{row['name']:<40}" + "".join(f" {cell(row):>9}" for _, cell in columns))
    for name, verdict in result.get("targets_met", {}).items():
        lines.append(f"target {name} >= {verdict['minimum']}: {'met' if verdict['met'] else 'NOT met'}"
                     f"{'  failing ' + ', '.join(verdict['failing']) if verdict['failing'] else ''}"
                     f"{'  unmeasured ' + ', '.join(verdict['unmeasured']) if verdict['unmeasured'] else ''}")
    return lines


def _bars(ax: Any, rows: list[dict], key: str) -> None:
    """Grouped bars of `key` per case: raypaged, FlashInfer's best kernel, SDPA's best layout (0
    where one has no figure: absent, n/a or failed; the JSON says which)."""
    width = 0.27
    for k, (peer, label) in enumerate([("raypaged", "raypaged"), ("flashinfer", "FlashInfer (better kernel)"),
                                       ("sdpa", "torch SDPA, contiguous")]):
        values = []
        for row in rows:
            name = "raypaged" if peer == "raypaged" else row.get(f"{peer}_best")
            values.append(row["impls"][name].get(key, 0.0) if name else 0.0)
        ax.bar([x + (k - 1) * width for x in range(len(rows))], values, width, label=label)
    ax.set_xticks(range(len(rows)), [row["name"].replace("_q", "\nq", 1) for row in rows], fontsize=6, rotation=90)


def plot(result: dict, path: Path) -> None:
    """Decode: each implementation's share of the copy bandwidth per case; prefill: TFLOP/s per
    case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [3, 1]})
    _bars(ax1, result["decode"], "frac_copy")
    ax1.axhline(1.0, color="k", ls="--", lw=1, label=f"copy, {result['copy_TBps']:.2f} TB/s")
    ax1.axhline(TARGETS["decode_frac_copy_min"], color="grey", ls=":", lw=1, label="target (> 200 MB)")
    ax1.set_ylabel("bytes that must move / time, over copy bandwidth")
    ax1.set_title(f"paged decode, bf16 — {result['env']['device']}")
    ax1.legend(fontsize=7, loc="upper right")
    _bars(ax2, result["prefill"], "TFLOPs")
    ax2.set_ylabel("TFLOP/s")
    ax2.set_title("causal prefill / extend, bf16")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
