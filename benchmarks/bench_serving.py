"""Online serving: Poisson arrivals over gRPC at several rates against `raypaged launch`, in two
modes on the same KV pool (issue 8's "Serving" benchmark, the shape of vLLM's
benchmark_serving.py), with one of two traces:

    python -m benchmarks.bench_serving                    # CPU-sized: the demo model, ~3 minutes
    python -m benchmarks.bench_serving --trace multiturn  # CPU-sized chat trace, ~4 minutes
    bash scripts/gpu.sh serving serving-multiturn         # the H200 runs: 8B-shaped, bf16, random weights

--trace sharegpt (default): modes paged and contiguous (`--kv-cache-mode contiguous`: every
request reserves max_model_len slots when it starts). Mode shed (overload): paged, with the front door shedding
past --shed-waiting-requests waiting calls or at --shed-kv-usage of the pool (RESOURCE_EXHAUSTED with
a Retry-After); run at rates past what the server sustains beside mode paged (the servers' default
bound of 1,024, which a burst never reaches), it shows what shedding buys the admitted calls: per
rate the calls shed, how fast they were answered, the Retry-After told, and the server's RSS.
For each rate, ascending, N requests are
sent with exponential gaps (seeded) and streamed: the simulator's ShareGPT-like trace (prompt ≈
160, output ≈ 340 tokens, lognormal tails), random prompt ids of the trace's lengths (fresh ids
at every rate, so the prefix cache cannot serve one rate from the last), each with max_tokens =
its output length and ignore_eos, so every request generates exactly that. Requests longer than
--max-total-len are dropped, as vLLM's benchmark drops ShareGPT's past 2,048 (scripts/gpu.sh
serving does the same; the CPU default, 512, keeps its tails short).

--trace multitenant: the chat trace over --system-prompts tenants' prompts (default 4), against
two data-parallel replicas (`--data-parallel-size 2`) in modes prefix, p2c and round-robin (the
`--routing-policy`), and one-engine: one replica with the pool of both (the hit rate the router
should come near). Per mode, from the server's per-replica metrics, each replica's share of the
requests and prefix-hit rate. On one GPU the two engines share the card (`--gpu-memory-utilization
0.45` each, after `--`).

--trace multiturn: modes prefix-cache and no-prefix-cache (`--no-enable-prefix-caching`), both
paged; `--modes prefix-cache,host-tier` compares the prefix cache without and with a host tier
of KV blocks behind the pool (`--kv-offload-size`; host-tier-swap adds swap preemption), at a pool
(`--num-kv-blocks`) a few times smaller than the trace's reusable KV: per rate, the tokens the
host tier served and the bytes moved each way, against the host-device copy bandwidth measured
at the start (pinned memory, CUDA only). At each rate conversations begin at Poisson times
(conversations per second) for --arrival-window-s, sharing one system prompt; each turn resends
the whole history with the replies as streamed back, after a think time (serving_chat.py says
exactly how). The defaults are CPU-sized for the demo model's 1,024-token context (system
prompt 128, user messages ≈ 24 and replies ≈ 32 tokens, 3–8 turns, capped at the model's
context, 0.5 / 1 / 2 conversations a second for 20 s); scripts/gpu.sh serving-multiturn runs
500 / 100 / 200, and serving-host-tier the same trace at a pool a few times smaller than its
reusable KV, the host tier off and on.

Per rate, as the client sees it: TTFT (send → first token), inter-token latency (the gap before
each streamed chunk, split over the chunk's tokens), TPOT ((E2E − TTFT) / (tokens − 1)), E2E;
p50/p90/p99 of each and of E2E / output tokens (the PagedAttention paper's normalized latency),
request and output-token throughput; from the server's Prometheus metrics the KV pool (gauges,
once a second) and the prefix-cache hit rate (its counters of prompt tokens looked up and found,
before and after the rate). A mode's sweep stops after the first rate whose p99 TTFT passes
--stop-ttft-s (the queue only grows from there). "Max rate" is the highest rate, going up, before
the first one whose p99 TTFT misses --slo-ttft-s. The first mode's pool size (profiled on CUDA)
is given to the second with --num-gpu-blocks-override, so both hold the same number of blocks.
Each mode records the settings its server runs with (lib/server_settings.py): asynchronous
scheduling, PDL, the GEMM epilogues and prefix caching as they take effect, and every flag.

Writes benchmarks/results/serving_<model>_<device>.json (serving_<model>-multiturn_<device>.json
for the chat trace; after every rate) and a PNG beside it. Flags after `--` go to `raypaged
launch` unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.common import (
    SHAPES,
    device_tag,
    environment,
    pinned_copy_bandwidth,
    write_config,
    write_json,
)
from benchmarks.lib.server_settings import effective_settings
from benchmarks.lib.sharegpt import BenchRequest, sharegpt_requests
from benchmarks.lib.synthetic_tokenizer import write_word_level_tokenizer
from benchmarks.serving_chat import ChatLoad, ChatShape, conversations_at, plan_conversations
from benchmarks.serving_load import Load, RequestLoad, drive, fresh_prompts, send
from benchmarks.serving_rate import run_rate
from benchmarks.serving_report import (
    max_rate_meeting,
    print_host_tier,
    print_rate,
    print_table,
    rate_unit,
    save_plot,
    should_stop,
)
from benchmarks.soak import LaunchedServer
from raypaged.client import Client

# Each trace's modes (the first two run by default; multitenant: all four), and the flags that make
# a server of each (after the user's, so they win). The host-tier modes also get --kv-offload-size.
TRACE_MODES = {"sharegpt": ("paged", "contiguous", "shed"),
               "multiturn": ("prefix-cache", "no-prefix-cache", "host-tier", "host-tier-swap"),
               "multitenant": ("prefix", "p2c", "round-robin", "one-engine")}
MODE_FLAGS = {
    "paged": ["--kv-cache-mode", "paged"],
    "contiguous": ["--kv-cache-mode", "contiguous"],
    "shed": ["--kv-cache-mode", "paged"],
    "prefix-cache": ["--kv-cache-mode", "paged", "--enable-prefix-caching"],
    "no-prefix-cache": ["--kv-cache-mode", "paged", "--no-enable-prefix-caching"],
    "host-tier": ["--kv-cache-mode", "paged", "--enable-prefix-caching", "--preemption-mode", "recompute"],
    "host-tier-swap": ["--kv-cache-mode", "paged", "--enable-prefix-caching", "--preemption-mode", "swap"],
    "prefix": ["--data-parallel-size", "2", "--routing-policy", "prefix"],
    "p2c": ["--data-parallel-size", "2", "--routing-policy", "p2c"],
    "round-robin": ["--data-parallel-size", "2", "--routing-policy", "round_robin"],
    "one-engine": ["--data-parallel-size", "1"],
}
# Replicas of a mode: one-engine gets the pool of all of them (its block count times this).
MODE_REPLICAS = {"prefix": 2, "p2c": 2, "round-robin": 2}
HOST_TIER_CPU_GIB = 0.25
# The demo model's context is 1,024 tokens: one contiguous reservation is 64 blocks of 16.
# 256 blocks hold four reservations, the regime bench_throughput's CPU run uses too. The chat
# trace has no contiguous mode: on CPU it keeps the server's default pool, where thinking
# conversations' histories stay cached.
CPU_NUM_KV_BLOCKS = 256
# On the demo model on 2 cores the chat trace's default shape saturates the CPU at ~1 conversation a second.
DEFAULT_RATES = {"sharegpt": "1,2,4,8,16,32", "multiturn": "0.5,1,2", "multitenant": "1"}
SHAREGPT_CPU_MAX_TOTAL_LEN = 512
# Mode shed: a waiting bound of a few seconds of the CPU run's throughput (~4 requests a
# second), against the servers' default of 1,024 (mode paged), which a burst never reaches.
SHED_WAITING_REQUESTS, SHED_KV_USAGE = 8, 0.95


def trace_requests(count: int, max_model_len: int, vocab_size: int, seed: int,
                   max_total_len: int | None) -> list[BenchRequest]:
    """The offline benchmark's requests: the seeded ShareGPT-like trace, clipped to max_model_len,
    without those longer than max_total_len."""
    return sharegpt_requests(count, max_model_len, vocab_size, seed, max_total_len)


def make_load(args: argparse.Namespace, info, seed: int, warm_up_count: int = 0) -> Load:
    """The trace's load for a server of `info` (its vocabulary and max_model_len): the sweep's,
    or with warm_up_count, that many requests (conversations) at the lowest rate."""
    if args.trace == "sharegpt":
        count = warm_up_count or args.num_requests
        return RequestLoad(trace_requests(count, info.max_model_len, info.vocab_size, seed,
                                          args.max_total_len), info.vocab_size, seed)
    cap = min(args.max_total_len or info.max_model_len, info.max_model_len)
    window_s = warm_up_count / min(args.rates) if warm_up_count else args.arrival_window_s
    count = max(conversations_at(rate, window_s) for rate in args.rates)
    return ChatLoad(plan_conversations(count, args.chat_shape, cap, seed), args.chat_shape, cap,
                    info.vocab_size, seed, window_s, args.system_prompts)


def warm_up(address: str, info, args: argparse.Namespace, count: int = 16) -> None:
    """A few short requests at once before the timed rates: the first prefill and decode shapes
    (Triton compiles on first use on a GPU) are not paid by the lowest rate's TTFT. ShareGPT-like
    prompt lengths, whatever the trace, and fresh ids: nothing of it is in any rate's prompts."""
    vocab_size = info.vocab_size
    warm = trace_requests(count, info.max_model_len, vocab_size, args.seed, args.max_total_len)
    prompts = fresh_prompts(warm, vocab_size, "warm-up")
    asyncio.run(drive(address, [0.0] * count, 1, lambda client, i, due: send(client, prompts[i], 8, due)))


def run_mode(mode: str, launch_args: list[str], num_blocks: int | None,
             args: argparse.Namespace, record: dict, save) -> None:
    """One server in `mode`; the rates ascending until one passes --stop-ttft-s."""
    flags = [*launch_args, *MODE_FLAGS[mode]]
    if mode.startswith("host-tier"):
        flags += ["--kv-offload-size", str(args.kv_offload_size)]
    if mode == "shed":
        flags += ["--max-waiting-requests", str(args.shed_waiting_requests),
                  "--shed-kv-usage", str(args.shed_kv_usage)]
    if num_blocks:
        # The pool of every replica together: one engine with it all, or an equal share each.
        total = num_blocks * (1 if mode in MODE_REPLICAS else 2 if args.trace == "multitenant" else 1)
        flags += ["--num-gpu-blocks-override", str(total)]
    started = time.perf_counter()
    server = LaunchedServer(flags)
    try:
        server.wait_ready(args.start_timeout_s)
        with Client(server.address) as client:
            health = client.health(timeout=10)
            info = client.model_info()
        if health != "SERVING":
            raise RuntimeError(f"{mode} server is {health}")
        load = make_load(args, info, args.seed)
        mode_record = record.setdefault(mode, {})
        mode_record.update({
            "launch_args": flags, "settings": effective_settings(flags),
            "start_seconds": time.perf_counter() - started,
            "num_kv_blocks": info.num_blocks, "block_size": info.block_size,
            "max_model_len": info.max_model_len, "model": info.name, "rates": [],
            "trace": load.summary(),
        })
        print(f"[{mode}] serving: {info.num_blocks} KV blocks of {info.block_size}, max_model_len "
              f"{info.max_model_len}, started in {mode_record['start_seconds']:.0f} s; "
              f"{mode_record['settings']['effective']}", flush=True)
        warm_up(server.address, info, args)
        unit = rate_unit(record)
        if args.warmup_rate_requests:
            # One untimed pass at the lowest rate with real lengths: on a fresh GPU machine the
            # first minutes pay one-off costs (kernel size specializations compiling) that the
            # short warm-up does not reach (the H200 run at fc27d85: p99 TTFT 5.1 s at its first
            # rate, 54 ms at the next). Kept in the JSON, never counted.
            warm = make_load(args, info, args.seed + 1, args.warmup_rate_requests)
            mode_record["warmup_rate"] = run_rate(server, info, warm, min(args.rates), args)
        for rate in args.rates:
            used = time.perf_counter() - started
            # Its arrivals, then about as long as the last rate's slowest to finish: past the
            # budget, the rate is not started (scripts/gpu.sh gives each mode a share).
            tail_s = load.tail_s(mode_record["rates"][-1]) if mode_record["rates"] else 0.0
            if args.mode_budget_s and used + load.arrival_span_s(rate) + tail_s > args.mode_budget_s:
                mode_record["skipped_rates_for_budget"] = [r for r in args.rates if r >= rate]
                print(f"[{mode}] {used:.0f} s used of the {args.mode_budget_s:.0f} s budget: "
                      f"rates from {rate:g} {unit} skipped", flush=True)
                break
            result = run_rate(server, info, load, rate, args)
            mode_record["rates"].append(result)
            best = max_rate_meeting(mode_record["rates"], args.slo_ttft_s)
            mode_record["max_rate_under_slo"] = best
            # Every tested rate met the SLO: the server's real limit lies above the sweep.
            mode_record["max_rate_is_lower_bound"] = best == rate
            save()
            print_rate(mode, result, unit)
            if should_stop(result, args.stop_ttft_s):
                mode_record["stopped_after_rate"] = rate
                print(f"[{mode}] stopping the sweep: p99 TTFT {result['ttft']['p99_ms'] / 1e3:.1f} s "
                      f"(limit {args.stop_ttft_s} s), {result['errors']} errors", flush=True)
                break
        mode_record["server_exit_code"] = server.stop()
    finally:
        server.kill()


# ---- the model ----------------------------------------------------------------------------------

def model_launch_args(args: argparse.Namespace, tmp: Path) -> list[str]:
    if args.shape is None:
        return []  # the built-in demo model
    dtype = args.dtype or "bfloat16"
    directory = write_config(args.shape, dtype, tmp)
    write_word_level_tokenizer(directory, SHAPES[args.shape]["vocab_size"])
    return ["--model", str(directory), "--load-format", "dummy", "--dtype", dtype,
            "--served-model-name", args.shape]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="a random-weights Llama of this shape (default: the built-in demo model)")
    parser.add_argument("--dtype", default=None, help="with --shape (default bfloat16)")
    parser.add_argument("--trace", choices=sorted(TRACE_MODES), default="sharegpt",
                        help="independent ShareGPT-like requests, or multi-turn conversations")
    parser.add_argument("--rates", default=None,
                        help="rates, comma-separated (swept ascending): requests per second "
                             f"(default {DEFAULT_RATES['sharegpt']}), or with --trace multiturn "
                             f"conversations begun per second (default {DEFAULT_RATES['multiturn']})")
    parser.add_argument("--num-requests", type=int, default=24, help="sharegpt: requests per rate")
    parser.add_argument("--max-total-len", type=int, default=None,
                        help="sharegpt: drop requests whose prompt + output exceed this (vLLM's "
                             f"benchmark: 2048; 0: keep all; default {SHAREGPT_CPU_MAX_TOTAL_LEN}, "
                             "which keeps the CPU run's tails short). multiturn: a conversation "
                             "ends before the turn that would pass it (default and most: the "
                             "server's max_model_len)")
    chat = parser.add_argument_group("--trace multiturn (CPU-sized defaults)")
    chat.add_argument("--arrival-window-s", type=float, default=20.0,
                      help="conversations begin for this long at each rate (rate x window of "
                           "them); a few conversations long, so the load reaches its level")
    chat.add_argument("--system-prompt-len", type=int, default=128,
                      help="tokens of the system prompt every conversation shares")
    chat.add_argument("--system-prompts", type=int, default=None,
                      help="tenants' system prompts, conversation i uses prompt i mod this "
                           "(default 1; --trace multitenant 4)")
    chat.add_argument("--user-turn-mean", type=float, default=24.0,
                      help="mean tokens of a user message (lognormal)")
    chat.add_argument("--reply-mean", type=float, default=32.0,
                      help="mean tokens of a reply, the turn's max_tokens (lognormal)")
    chat.add_argument("--turns", default="3,8", help="MIN,MAX turns of a conversation (uniform)")
    chat.add_argument("--think-time-s", type=float, default=1.0,
                      help="mean pause between a reply and the next turn (exponential)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help=f"pool size in blocks for both modes (default on CPU {CPU_NUM_KV_BLOCKS} "
                             "for sharegpt, the server's own for multiturn; on CUDA the first "
                             "server's profiled pool)")
    parser.add_argument("--modes", default=None,
                        help="comma list, of the trace's modes (default its first two: "
                             + "; ".join(f"{t}: {','.join(m)}" for t, m in TRACE_MODES.items())
                             + "). host-tier: prefix caching with a host tier of "
                             "--kv-offload-size GiB behind the pool (-swap: and swap preemption); "
                             "it pays when the trace's reusable KV outgrows the pool (--num-kv-blocks)")
    parser.add_argument("--shed-waiting-requests", type=int, default=SHED_WAITING_REQUESTS,
                        help="mode shed: the front door's waiting bound (--max-waiting-requests)")
    parser.add_argument("--shed-kv-usage", type=float, default=SHED_KV_USAGE,
                        help="mode shed: shed while the pool is this full and requests wait")
    parser.add_argument("--kv-offload-size", type=float, default=HOST_TIER_CPU_GIB,
                        help="GiB per rank of the host-tier modes' host pool")
    parser.add_argument("--slo-ttft-s", type=float, default=1.0)
    parser.add_argument("--stop-ttft-s", type=float, default=10.0,
                        help="stop a mode's sweep after a rate whose p99 TTFT passes this")
    parser.add_argument("--mode-budget-s", type=float, default=None,
                        help="start no rate whose arrivals would end past this many seconds of "
                             "the mode's server (start-up included)")
    parser.add_argument("--warmup-rate-requests", type=int, default=0,
                        help="before the sweep, this many requests (multiturn: conversations) at "
                             "the lowest rate, untimed")
    parser.add_argument("--channels", type=int, default=4, help="gRPC connections of the client")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--name", default=None,
                        help="results file serving_<name>.json (default: <model>_<device>, "
                             "<model>-multiturn_<device> for the chat trace)")
    parser.add_argument("--out", default=None, help="directory for the JSON and PNG")
    parser.add_argument("launch_args", nargs=argparse.REMAINDER,
                        help="after --: flags for raypaged launch (e.g. --max-num-seqs 512)")
    args = parser.parse_args(argv)
    args.rates = sorted(float(r) for r in (args.rates or DEFAULT_RATES[args.trace]).split(",") if r)
    if not args.rates or min(args.rates) <= 0:
        parser.error("--rates: positive numbers")
    modes = TRACE_MODES[args.trace]
    default_modes = modes if args.trace == "multitenant" else modes[:2]
    args.modes = [m for m in args.modes.split(",") if m] if args.modes else list(default_modes)
    if not args.modes or any(m not in modes for m in args.modes):
        parser.error(f"--modes with --trace {args.trace}: a comma list of {', '.join(modes)}")
    args.launch_args = [a for a in args.launch_args if a != "--"]
    if args.system_prompts is None:
        args.system_prompts = 4 if args.trace == "multitenant" else 1
    if args.max_total_len is None and args.trace == "sharegpt":
        args.max_total_len = SHAREGPT_CPU_MAX_TOTAL_LEN
    args.max_total_len = args.max_total_len or None
    try:
        low, high = (int(t) for t in args.turns.split(","))
        args.chat_shape = ChatShape(args.system_prompt_len, args.user_turn_mean, args.reply_mean,
                                    low, high, args.think_time_s)
        if args.trace != "sharegpt":  # against max_model_len too, once the server says it
            args.chat_shape.validate(args.max_total_len or args.system_prompt_len + 2)
    except ValueError as e:
        parser.error(f"--trace multiturn: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    args = parse_args(argv)
    on_cuda = device_tag() != "cpu"
    cpu_blocks = CPU_NUM_KV_BLOCKS if args.trace == "sharegpt" else None
    num_blocks = args.num_kv_blocks or (None if on_cuda else cpu_blocks)
    model = args.shape or "demo"
    suffix = f"-{args.trace}" if args.trace != "sharegpt" else ""
    name = args.name or f"{model}{suffix}_{device_tag()}"
    record: dict = {"env": environment(), "load_average_1_5_15min_at_start": os.getloadavg(),
                    "model": model, "trace": args.trace,
                    "args": {k: v for k, v in vars(args).items() if k != "chat_shape"},
                    "slo_ttft_s": args.slo_ttft_s}

    def save() -> Path:  # after every rate: a run cut short keeps what it measured
        record["num_kv_blocks"] = num_blocks
        record["wall_seconds"] = time.perf_counter() - began
        record["load_average_1_5_15min_at_end"] = os.getloadavg()
        return write_json(f"serving_{name}", record, Path(args.out) if args.out else None)

    if on_cuda and any(m.startswith("host-tier") for m in args.modes):
        record["host_device_copy_gb_per_s"] = pinned_copy_bandwidth()  # what the tier's bytes compare to
    with tempfile.TemporaryDirectory() as tmp:
        launch_args = model_launch_args(args, Path(tmp)) + args.launch_args
        for mode in args.modes:
            run_mode(mode, launch_args, num_blocks, args, record, save)
            # The next mode gets exactly this pool (per replica: info reports replica 0's).
            num_blocks = record[mode]["num_kv_blocks"]
            if args.trace == "multitenant" and mode not in MODE_REPLICAS:
                num_blocks //= 2
    path = save()
    print_table(record, args.modes, args.slo_ttft_s)
    print_host_tier(record, args.modes)
    save_plot(record, args.modes, args.slo_ttft_s, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name} in {record['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
