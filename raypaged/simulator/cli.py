"""`raypaged simulate`: replay synthetic traces through the real scheduler with the paged KV
manager and with contiguous max-length reservations, and report where the memory goes.

add_parser() only declares arguments; the simulator is imported inside run(), so other
sub-commands start fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from raypaged.config.sections import KV_CACHE_DTYPES, kv_cache_value_bytes

TRACE_CHOICES = ("sharegpt", "fixed", "shared-prefix", "all")
ALLOCATOR_CHOICES = ("paged", "contiguous", "contiguous-pow2", "contiguous-oracle")
DEFAULT_OUT = Path("benchmarks/results")
_LAYERED_OPTIONS = ("model", "contexts", "block_size", "max_num_batched_tokens", "kv_cache_dtype", "out",
                    "no_plot")


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
    p.add_argument("--num-blocks", type=_positive_int, default=1000,
                   help="KV pool size in blocks of a 16-bit KV cache (the memory the pool takes)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="auto: 16-bit K/V (bf16); fp8*: one byte a value, so the same memory holds "
                        "twice the blocks (uniform) and a request's KV takes half the bytes (gemma3)")
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--max-model-len", type=_positive_int, default=2048)
    p.add_argument("--max-num-seqs", type=_positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="Poisson arrivals in requests per engine step; 0: all at step 0 (offline)")
    p.add_argument("--allocators", nargs="+", choices=ALLOCATOR_CHOICES, default=list(ALLOCATOR_CHOICES),
                   help="contiguous reserves max_model_len; -pow2 / -oracle reserve the request's "
                        "own length rounded to a power of two / exactly (Orca's variants)")
    p.add_argument("--model", choices=("uniform", "gemma3"), default="uniform",
                   help="uniform: every layer full attention, the traces' report; gemma3: a "
                        "Gemma-3-27B-shaped model (5 sliding layers of window 1024 : 1 full), KV per "
                        "request at --contexts, full allocation vs KV-cache groups")
    p.add_argument("--contexts", type=_positive_int, nargs="+", default=[8192, 32768, 131072],
                   help="contexts of the gemma3 report")
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
        if args.model == "uniform" and key == "contexts" or \
                args.model != "uniform" and key not in _LAYERED_OPTIONS:
            continue  # options the report does not read
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    if args.model != "uniform":
        return run_kv_groups(args)
    from tqdm import tqdm

    from raypaged.simulator.report import format_legend, format_table, paper_comparison, write_json
    from raypaged.simulator.simulate import SimConfig, simulate
    from raypaged.simulator.traces import TRACE_NAMES, make_trace

    # The same memory holds 2 / (bytes a value) times the 16-bit pool's blocks.
    num_blocks = args.num_blocks * 2 // kv_cache_value_bytes(args.kv_cache_dtype)
    if num_blocks != args.num_blocks:
        print(f"KV cache {args.kv_cache_dtype}: {num_blocks} blocks in the memory of "
              f"{args.num_blocks} 16-bit ones")
    config = SimConfig(num_blocks=num_blocks, block_size=args.block_size,
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

    def plot(path: Path) -> None:
        from raypaged.simulator.plot import save_plot

        save_plot(results, path)

    _write(args, "simulate_memory", lambda path: write_json(
        path, config, traces, results, command_line(args), args.seed, args.arrival_rate), plot)
    return 0


def _write(args: argparse.Namespace, stem: str, write: Callable[[Path], None],
           plot: Callable[[Path], None]) -> None:
    """The report's JSON (and its PNG unless --no-plot) under --out."""
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{stem}.json"
    write(json_path)
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        png_path = args.out / f"{stem}.png"
        plot(png_path)
        print(f"wrote {png_path}")


def run_kv_groups(args: argparse.Namespace) -> int:
    """The layered-model report: KV per request, full allocation vs KV-cache groups."""
    from raypaged.simulator.kv_groups import MODELS, format_report, kv_per_request
    from raypaged.simulator.report import write_record

    model = dataclasses.replace(MODELS[args.model],
                                dtype_bytes=kv_cache_value_bytes(args.kv_cache_dtype))
    report = kv_per_request(model, block_size=args.block_size,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            contexts=tuple(args.contexts))
    print(format_report(report))

    def plot(path: Path) -> None:
        from raypaged.simulator.plot import save_kv_groups_plot

        save_kv_groups_plot(report, path)

    _write(args, "simulate_kv_groups", lambda path: write_record(path, command_line(args), report), plot)
    return 0
