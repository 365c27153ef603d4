"""`raypaged simulate`: replay synthetic traces through the real scheduler with the paged KV
manager and with contiguous max-length reservations, and report where the memory goes.

add_parser() only declares arguments; the simulator is imported inside run(), so other
sub-commands start fast.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

TRACE_CHOICES = ("sharegpt", "fixed", "shared-prefix", "all")
ALLOCATOR_CHOICES = ("paged", "contiguous", "contiguous-pow2", "contiguous-oracle")
DEFAULT_OUT = Path("benchmarks/results")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="KV memory simulator: paged vs contiguous allocation on synthetic traces",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", choices=TRACE_CHOICES, default="all")
    p.add_argument("--num-requests", type=_positive_int, default=500)
    p.add_argument("--num-blocks", type=_positive_int, default=1000, help="KV pool size in blocks")
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--max-model-len", type=_positive_int, default=2048)
    p.add_argument("--max-num-seqs", type=_positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="Poisson arrivals in requests per engine step; 0: all at step 0 (offline)")
    p.add_argument("--allocators", nargs="+", choices=ALLOCATOR_CHOICES, default=list(ALLOCATOR_CHOICES),
                   help="contiguous reserves max_model_len; -pow2 / -oracle reserve the request's "
                        "own length rounded to a power of two / exactly (Orca's variants)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the JSON and PNG")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def command_line(args: argparse.Namespace) -> str:
    """The full command that reproduces this run, every option spelled out."""
    parts = ["raypaged", "simulate"]
    for key, value in vars(args).items():
        if key in ("command", "run", "no_progress") or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from raypaged.simulator.report import format_legend, format_table, paper_comparison, write_json
    from raypaged.simulator.simulate import SimConfig, simulate
    from raypaged.simulator.traces import TRACE_NAMES, make_trace

    config = SimConfig(num_blocks=args.num_blocks, block_size=args.block_size,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    names = TRACE_NAMES if args.trace == "all" else (args.trace,)
    try:
        traces = [make_trace(n, args.num_requests, args.max_model_len, seed=args.seed,
                             arrival_rate=args.arrival_rate) for n in names]
        results = []
        for trace in traces:
            for allocator in args.allocators:
                with tqdm(desc=f"{trace.name:>13} {allocator:>17}", unit=" steps",
                          disable=args.no_progress, leave=False, file=sys.stderr) as bar:
                    results.append(simulate(trace, allocator, config, on_step=bar.update))
    except ValueError as e:  # a bad combination of sizes: say which, no traceback
        print(f"raypaged simulate: error: {e}", file=sys.stderr)
        return 2

    summaries = [r.summary() for r in results]
    print(format_table(summaries))
    print(format_legend())
    print()
    print(paper_comparison(summaries))

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "simulate_memory.json"
    write_json(json_path, config, traces, results, command_line(args), args.seed, args.arrival_rate)
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        from raypaged.simulator.plot import save_plot

        png_path = args.out / "simulate_memory.png"
        save_plot(results, png_path)
        print(f"wrote {png_path}")
    return 0
