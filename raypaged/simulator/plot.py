"""The simulator's figure: where the pool goes (the paper's fig. 2, per trace) and how many
requests run concurrently over time."""

from __future__ import annotations

from pathlib import Path

from raypaged.simulator.report import PAPER_TOKEN_STATE_SHARE
from raypaged.simulator.simulate import BREAKDOWN, SimResult

COLORS = {"token_states": "#2b8a3e", "reserved": "#f59f00", "never_used": "#e8590c",
          "external_fragmentation": "#862e9c", "free": "#dee2e6"}
LABELS = {"token_states": "token states", "reserved": "reserved (future tokens)",
          "never_used": "never used (over-reserved / block tail)",
          "external_fragmentation": "external fragmentation", "free": "free"}


def save_plot(results: list[SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in results))
    fig, axes = plt.subplots(2, len(traces), figsize=(5.2 * len(traces), 8.5), squeeze=False)
    for col, trace in enumerate(traces):
        rows = [r for r in results if r.trace == trace]
        names = [r.allocator.replace("contiguous-", "contig-") for r in rows]

        ax = axes[0][col]
        bottom = [0.0] * len(rows)
        for category in BREAKDOWN:
            shares = [100 * r.pool_share(category, saturated=True) for r in rows]
            ax.bar(names, shares, bottom=bottom, color=COLORS[category])
            bottom = [b + s for b, s in zip(bottom, shares)]
        for x, r in enumerate(rows):
            share = 100 * r.pool_share("token_states", saturated=True)
            ax.text(x, share / 2, f"{share:.1f}%", ha="center", va="center", fontsize=9, color="white")
        ax.axhline(100 * PAPER_TOKEN_STATE_SHARE["vLLM"], color="black", ls=":", lw=1)
        ax.set_title(f"{trace}: KV pool while saturated")
        ax.set_ylabel("% of KV pool")
        ax.set_ylim(0, 100)
        ax.tick_params(axis="x", labelrotation=20)

        ax = axes[1][col]
        for r in rows:
            ax.plot([s.step for s in r.samples], [s.running for s in r.samples], lw=1,
                    label=r.allocator)
        ax.set_title(f"{trace}: running requests")
        ax.set_xlabel("engine step")
        ax.set_ylabel("concurrent requests")
        ax.legend(fontsize=8)
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS[c], label=LABELS[c]) for c in BREAKDOWN]
    fig.legend(handles=handles, loc="lower center", ncol=len(BREAKDOWN), fontsize=9,
               title="dotted line: the vLLM paper's 96.3% of KV memory holding token states",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_kv_groups_plot(report: dict, path: Path) -> None:
    """KV per request at each context: today's full allocation vs KV-cache groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"{row['context'] // 1024}k" for row in rows]
    series = [("full allocation (every layer)", "full_peak_bytes", "#868e96"),
              ("groups, peak (prefill chunk)", "grouped_peak_bytes", "#f59f00"),
              ("groups, decoding", "grouped_decode_bytes", "#2b8a3e")]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.27
    for k, (label, key, color) in enumerate(series):
        xs = [i + (k - 1) * width for i in range(len(rows))]
        values = [row[key] / (1 << 30) for row in rows]
        ax.bar(xs, values, width, label=label, color=color)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV of one request (GiB)")
    ax.set_yscale("log")
    ax.set_title(f"{report['model']['name']}: {len(report['groups'])} KV-cache groups of "
                 f"{report['group_size']} layers, block {report['block_size']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
