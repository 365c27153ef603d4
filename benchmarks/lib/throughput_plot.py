"""The offline throughput benchmark's PNG: output tok/s of every precision and KV mode beside
transformers (measured in the run) and any published figure (hatched, labelled as published),
then the KV pool and the running batch over each run."""

from __future__ import annotations

from pathlib import Path

COLORS = ("tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown")
LINESTYLES = {"paged": "-", "contiguous": ":"}


def bars_of(result: dict) -> list[tuple[str, float, str, bool]]:
    """(label, output tok/s, colour, published) for each bar, in drawing order."""
    bars = []
    for i, (precision, runs) in enumerate(result["precisions"].items()):
        for mode in result["modes"]:
            if mode in runs:
                bars.append((f"raypaged\n{precision} {mode}", runs[mode]["output_tokens_per_s"],
                             COLORS[i % len(COLORS)], False))
    if "hf_generate" in result:
        bars.append((f"transformers\n{result['hf_generate']['dtype']}, static",
                     result["hf_generate"]["output_tokens_per_s"], "tab:gray", False))
    for peer in result.get("published_peers", []):
        bars.append((f"{peer['engine']} {peer['precision']}\n{peer['gpu']}, published",
                     peer["output_tokens_per_s"], "white", True))
    return bars


def save_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, pool, running) = plt.subplots(1, 3, figsize=(17, 4.8))
    drawn = bars_of(result)
    for x, (_, value, color, published) in enumerate(drawn):
        bars.bar(x, value, color=color, edgecolor="black" if published else color,
                 hatch="//" if published else None)
        bars.text(x, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=8)
    bars.set_xticks(range(len(drawn)), [d[0] for d in drawn], fontsize=7)
    bars.set_ylabel("output tokens / s")
    workload = result["workload"]
    bars.set_title(f"{workload['num_requests']} {workload['description']}, {result['shape']} "
                   f"({result['env']['device']})", fontsize=9)
    for i, (precision, runs) in enumerate(result["precisions"].items()):
        for mode in result["modes"]:
            if mode not in runs:
                continue
            run, color = runs[mode], COLORS[i % len(COLORS)]
            pool_slots = run["num_kv_blocks"] * result["block_size"]
            t = [s["seconds"] for s in run["samples"]]
            style = LINESTYLES.get(mode, "-")
            pool.plot(t, [s["allocated_slots"] / pool_slots for s in run["samples"]], color=color,
                      linestyle=style, label=f"{precision} {mode}")
            running.plot(t, [s["running"] for s in run["samples"]], color=color, linestyle=style,
                         label=f"{precision} {mode}")
    pool.set_xlabel("seconds")
    pool.set_ylabel("share of the KV pool held")
    pool.set_title("KV pool over the run (each precision's own pool)", fontsize=9)
    pool.legend(fontsize=7)
    running.set_xlabel("seconds")
    running.set_ylabel("running requests")
    running.set_title("batch size over the run", fontsize=9)
    running.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
