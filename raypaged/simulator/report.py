"""The simulator's table, its JSON record and the comparison with the PagedAttention paper."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from raypaged.simulator.simulate import SimConfig, SimResult
from raypaged.simulator.traces import Trace

# Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention" (SOSP 2023), fig. 2: share of KV memory holding token states.
PAPER_TOKEN_STATE_SHARE = {"Orca (Max)": 0.204, "Orca (Pow2)": 0.268, "Orca (Oracle)": 0.382,
                           "vLLM": 0.963}

COLUMNS = [  # header, width, how to get the cell from a summary dict
    ("trace", 13, lambda s: s["trace"]),
    ("allocator", 17, lambda s: s["allocator"]),
    ("KV util", 7, lambda s: _pct(s["saturated"]["kv_utilization"])),
    ("tokens/pool", 11, lambda s: _pct(s["saturated"]["pool_token_states"])),
    ("int.frag", 8, lambda s: _pct(s["saturated"]["internal_fragmentation"])),
    ("ext.frag", 8, lambda s: _pct(s["saturated"]["external_fragmentation"])),
    ("mean run", 8, lambda s: f"{s['saturated']['mean_running']:.1f}"),
    ("peak run", 8, lambda s: str(s["peak_running"])),
    ("steps", 7, lambda s: str(s["steps_to_drain"])),
    ("saturated", 9, lambda s: _pct(s["saturated_steps"] / max(1, s["engine_steps"]))),
    ("preempt", 7, lambda s: str(s["preemptions"])),
    ("shared saved", 14, lambda s: _saved(s)),
]


def _saved(s: dict) -> str:
    if s["allocator"] != "paged":
        return "-"  # contiguous reservations share nothing
    return f"{s['mean_shared_saved_slots']:.0f} ({_pct(s['mean_shared_saved_slots'] / s['pool_slots'])})"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_table(summaries: list[dict]) -> str:
    header = "  ".join(f"{name:>{w}}" for name, w, _ in COLUMNS)
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append("  ".join(f"{get(s):>{w}}" for _, w, get in COLUMNS))
    return "\n".join(lines)


def format_legend() -> str:
    return (
        "Averages over saturated steps (some request waiting: memory is the limit; `saturated` is\n"
        "their share of the steps, and with none the averages are over every step).\n"
        "KV util = filled / allocated slots; tokens/pool = filled slots / whole pool (the paper's\n"
        "measure); int.frag = allocated-but-unfilled / pool; ext.frag = free blocks no run the next\n"
        "request needs can use / pool; shared saved = mean slots (and share of the pool) that prefix\n"
        "sharing saves over every request holding its own copy."
    )


def paper_comparison(summaries: list[dict]) -> str:
    """Where our token-state shares land against the paper's fig. 2."""
    ours: dict[str, list[float]] = {}
    for s in summaries:
        ours.setdefault(s["allocator"], []).append(s["saturated"]["pool_token_states"])
    paper = ", ".join(f"{k} {_pct(v)}" for k, v in PAPER_TOKEN_STATE_SHARE.items())
    lines = [f"PagedAttention paper (fig. 2), KV memory holding token states: {paper}.",
             "Ours (share of the pool holding token states while saturated, range over traces):"]
    for allocator, values in ours.items():
        lo, hi = min(values), max(values)
        lines.append(f"  {allocator:>17}: " + (_pct(lo) if lo == hi else f"{_pct(lo)}–{_pct(hi)}"))
    return "\n".join(lines)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_record(path: Path, command: str, body: dict) -> None:
    """A result file: how it was made (command, commit, versions, time), then `body`."""
    record = {
        "command": command,
        "commit": _git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    } | body
    path.write_text(json.dumps(record, indent=2) + "\n")


def write_json(path: Path, config: SimConfig, traces: list[Trace], results: list[SimResult],
               command: str, seed: int, arrival_rate: float) -> None:
    write_record(path, command, {
        "config": asdict(config) | {"seed": seed, "arrival_rate_per_step": arrival_rate},
        "traces": [t.summary() for t in traces],
        "results": [r.summary() for r in results],
        "paper_token_state_share": PAPER_TOKEN_STATE_SHARE,
    })
