"""The figures bench_serving.py reports: percentiles as vLLM's benchmark computes them, a
rate's latency distributions and throughput from the client's per-request timings, the highest
rate meeting the TTFT SLO, the KV pool's use from the server's gauges, the prefix-cache hit rate
from its counters; and their table and plot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

PERCENTILES = (50, 90, 99)


@dataclass
class Timing:
    """One request, seconds on the client's clock."""

    late_s: float  # sent this long after its Poisson time (a busy client would skew the load)
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    gaps_s: list[float] = field(default_factory=list)  # one per token after the first chunk's
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # of the prompt, served from the prefix cache (the usage's)
    error: str | None = None
    # A refused or failed call: seconds from sending to the error, and the Retry-After it carried.
    error_s: float = math.nan
    retry_after_s: float | None = None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default
    method), so the figures compare with vLLM's benchmark."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: list[float]) -> dict:
    """Mean and p50/p90/p99 in milliseconds."""
    summary = {"mean_ms": 1e3 * sum(values) / len(values) if values else math.nan}
    for q in PERCENTILES:
        summary[f"p{q}_ms"] = 1e3 * percentile(values, q)
    return summary


def max_rate_meeting(rates: list[dict], slo_ttft_s: float) -> float | None:
    """The highest rate, going up, before the first that misses the SLO (p99 TTFT ≥ slo, or a
    request that failed): a rate that passes only above a failing one is luck of the draw, not
    a rate the server sustains. None when the lowest rate already misses."""
    best = None
    for result in sorted(rates, key=lambda r: r["rate"]):
        if result["errors"] or not result["ttft"]["p99_ms"] < 1e3 * slo_ttft_s:
            break
        best = result["rate"]
    return best


def should_stop(result: dict, stop_ttft_s: float) -> bool:
    """Past this, higher rates only lengthen the queue: stop the mode's sweep. A call shed at the
    front door is the server bounding its queue, not a failure: a shedding server is swept on
    while the calls it admits start in time."""
    failed = result["errors"] - result.get("shed", 0)
    return bool(failed) or not result["ttft"]["p99_ms"] < 1e3 * stop_ttft_s


KV_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
             "kv_cache_blocks", "kv_cache_allocated_slots", "kv_cache_filled_slots",
             "kv_cache_unfilled_slots", "kv_cache_shared_saved_slots")


def kv_summary(samples: list[dict], block_size: int) -> dict:
    """Averages over the samples where requests run (ratios of sums): pool usage, filled /
    allocated slots, allocated-but-empty slots as a share of the pool and per running request."""
    busy = [s for s in samples if s["num_requests_running"]]
    if not busy:
        return {"samples": len(samples), "busy_samples": 0}
    pool = sum(s["kv_cache_blocks"] * block_size for s in busy)
    allocated = sum(s["kv_cache_allocated_slots"] for s in busy)
    filled = sum(s["kv_cache_filled_slots"] for s in busy)
    unfilled = sum(s["kv_cache_unfilled_slots"] for s in busy)
    running = sum(s["num_requests_running"] for s in busy)
    return {
        "samples": len(samples), "busy_samples": len(busy),
        "mean_pool_usage": sum(s["kv_cache_usage_perc"] for s in busy) / len(busy),
        "peak_pool_usage": max(s["kv_cache_usage_perc"] for s in busy),
        "kv_utilization": filled / allocated if allocated else 1.0,  # filled / allocated slots
        "pool_token_states": filled / pool,
        "waste_share_of_pool": unfilled / pool,
        "unfilled_slots_per_running_request": unfilled / running,
        "mean_running": running / len(busy),
        "peak_running": max(s["num_requests_running"] for s in busy),
        "mean_waiting": sum(s["num_requests_waiting"] for s in busy) / len(busy),
        "peak_waiting": max(s["num_requests_waiting"] for s in busy),
    }


def prefix_cache_summary(before: dict[str, float], after: dict[str, float],
                         timings: list[Timing]) -> dict:
    """A rate's prefix cache, from the server's counters scraped before and after it (once the
    frontend's poll of the engine has caught up): prompt tokens looked up (`queries`, counted
    by the engine at each request's first allocation, as vLLM counts them) and of those found
    (`hits`). hit_rate = hits / queries; with prefix caching off the engine looks nothing up,
    and the rate is 0 (nothing was served from a cache) as long as prompts were processed. The
    per-request usage the client got (cached_tokens of prompt_tokens) is kept beside it."""
    def delta(name: str) -> float:
        return after.get(f"raypaged_{name}_total", 0.0) - before.get(f"raypaged_{name}_total", 0.0)

    queries, hits, prompt_tokens = delta("prefix_cache_queries"), delta("prefix_cache_hits"), \
        delta("prompt_tokens")
    done = [t for t in timings if t.error is None]
    client_prompt = sum(t.prompt_tokens for t in done)
    client_cached = sum(t.cached_tokens or 0 for t in done)
    return {
        "queries": queries, "hits": hits, "prompt_tokens": prompt_tokens,
        "hit_rate": hits / queries if queries else (0.0 if prompt_tokens else None),
        "client_prompt_tokens": client_prompt, "client_cached_tokens": client_cached,
        "client_cached_share": client_cached / client_prompt if client_prompt else None,
    }


def replica_summary(before: dict[str, float], after: dict[str, float]) -> list[dict] | None:
    """Per data-parallel replica over a rate, from the server's raypaged_dp_* counters: requests
    routed there (and their share), prompt blocks the router saw cached there when it chose, and
    the replica's own prefix-cache hit rate. None for a server of one engine."""
    replicas = sorted({key.split("replica=")[1] for key in after if key.startswith("raypaged_dp_routed_requests")},
                      key=int)
    if not replicas:
        return None

    def delta(name: str, replica: str) -> float:
        key = f"raypaged_dp_{name}_total,replica={replica}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    routed = {r: delta("routed_requests", r) for r in replicas}
    total = sum(routed.values()) or 1.0
    rows = []
    for r in replicas:
        queries, hits = delta("prefix_cache_queries", r), delta("prefix_cache_hits", r)
        blocks, matched = delta("routed_prompt_blocks", r), delta("routed_matched_blocks", r)
        rows.append({"replica": int(r), "routed": routed[r], "share": routed[r] / total,
                     "hit_rate": hits / queries if queries else None,
                     "router_matched_share": matched / blocks if blocks else None})
    return rows


def summarize_rate(rate: float, timings: list[Timing], wall_s: float) -> dict:
    done = [t for t in timings if t.error is None]
    shed = [t for t in timings if t.error is not None and t.error.startswith("RESOURCE_EXHAUSTED")]
    output_tokens = sum(t.output_tokens for t in done)
    tpot = [(t.e2e_s - t.ttft_s) / (t.output_tokens - 1) for t in done if t.output_tokens > 1]
    return {
        "rate": rate, "requests": len(timings), "completed": len(done),
        "errors": len(timings) - len(done),
        "error_examples": sorted({t.error for t in timings if t.error})[:5],
        "duration_s": wall_s,
        "request_throughput": len(done) / wall_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_s,
        "ttft": distribution([t.ttft_s for t in done]),
        "itl": distribution([g for t in done for g in t.gaps_s]),
        "tpot": distribution(tpot),
        # The PagedAttention paper's serving figure: E2E over output length, per request. Unlike
        # TTFT it rises once the batch outgrows the hardware, even while everything is admitted.
        "normalized_latency": distribution([t.e2e_s / t.output_tokens for t in done]),
        "e2e": distribution([t.e2e_s for t in done]),
        "send_lateness": distribution([t.late_s for t in timings]),
        # Overload: the calls shed at the front door (RESOURCE_EXHAUSTED), how fast they were
        # answered, and the Retry-After they were told.
        "shed": len(shed),
        "shed_answer": distribution([t.error_s for t in shed]),
        "shed_retry_after": distribution([t.retry_after_s for t in shed if t.retry_after_s is not None]),
    }


def rate_unit(record: dict) -> str:
    """What the swept rate counts: requests, or (the multi-turn trace) conversations begun."""
    return "conv/s" if record.get("trace") in ("multiturn", "multitenant") else "req/s"


def hit_rate(r: dict) -> float | None:
    return r.get("prefix_cache", {}).get("hit_rate")


def shed_text(r: dict) -> str:
    """The overload part of a rate's line: empty when nothing was shed."""
    if not r.get("shed"):
        return ""
    return (f"shed {r['shed']} (answered in p99 {r['shed_answer']['p99_ms']:.0f} ms, Retry-After p50 "
            f"{r['shed_retry_after']['p50_ms'] / 1e3:.0f} s); ")


def print_rate(mode: str, r: dict, unit: str = "req/s") -> None:
    kv = r["kv"]
    rate_hits = hit_rate(r)
    hits = "" if rate_hits is None else f"prefix-cache hits {rate_hits:.1%}; "
    conversations = r.get("conversations")
    done = (f"{conversations['completed']}/{conversations['count']} conversations, "
            if conversations else "")
    print(f"[{mode}] {r['rate']:g} {unit}: {done}{r['completed']}/{r['requests']} requests in "
          f"{r['duration_s']:.1f} s, {r['output_tokens_per_s']:.0f} out tok/s; TTFT p50/p99 "
          f"{r['ttft']['p50_ms']:.0f}/{r['ttft']['p99_ms']:.0f} ms, ITL p50/p99 "
          f"{r['itl']['p50_ms']:.0f}/{r['itl']['p99_ms']:.0f} ms, E2E p99 {r['e2e']['p99_ms'] / 1e3:.1f} s; "
          f"{hits}{shed_text(r)}running {kv.get('mean_running', 0):.1f} (peak {kv.get('peak_running', 0)}), "
          f"pool {kv.get('mean_pool_usage', 0):.0%}; send late p99 {r['send_lateness']['p99_ms']:.0f} ms",
          flush=True)


# ---- table and plot -----------------------------------------------------------------------------

def save_plot(record: dict, modes: list[str], slo_ttft_s: float, path: Path) -> None:
    """TTFT p99 and p50 against the rate, then (the multi-turn trace) the prefix-cache hit rate
    or (ShareGPT-like) the normalized latency, throughput and the batch size, one line a mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chat = record.get("trace") in ("multiturn", "multitenant")
    fig, (ttft, second, tput, running) = plt.subplots(1, 4, figsize=(20, 4.5))
    for mode, color in zip(modes, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        rates = record.get(mode, {}).get("rates", [])
        x = [r["rate"] for r in rates]
        ttft.plot(x, [r["ttft"]["p99_ms"] / 1e3 for r in rates], "o-", color=color, label=f"{mode} p99")
        ttft.plot(x, [r["ttft"]["p50_ms"] / 1e3 for r in rates], "o--", color=color, alpha=0.6,
                  label=f"{mode} p50")
        if chat:
            shown = [(r["rate"], rate_hits) for r in rates if (rate_hits := hit_rate(r)) is not None]
            second.plot([a for a, _ in shown], [100 * b for _, b in shown], "o-", color=color, label=mode)
        else:
            second.plot(x, [r["normalized_latency"]["mean_ms"] for r in rates], "o-", color=color,
                        label=mode)
        tput.plot(x, [r["output_tokens_per_s"] for r in rates], "o-", color=color, label=mode)
        running.plot(x, [r["kv"].get("mean_running", 0) for r in rates], "o-", color=color, label=mode)
    ttft.axhline(slo_ttft_s, color="gray", linestyle=":", label=f"{slo_ttft_s:g} s")
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT (s)")
    ttft.set_title(f"{record['model']}, {record.get('trace', 'sharegpt')} ({record['env']['device']})")
    if chat:
        second.set_ylabel("prompt tokens from the prefix cache (%)")
        second.set_ylim(0, 100)
        second.set_title("prefix-cache hit rate")
    else:
        second.set_ylabel("mean E2E / output tokens (ms)")
        second.set_title("normalized latency")
    tput.set_ylabel("output tokens / s")
    tput.set_title("throughput")
    running.set_ylabel("mean running requests")
    running.set_title(f"batch size ({record.get('num_kv_blocks')} KV blocks)")
    unit = rate_unit(record)
    for ax in (ttft, second, tput, running):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("conversations begun / s" if unit == "conv/s" else "request rate (req/s)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def host_tier_summary(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """A rate's host tier of KV blocks, from the server's counters: prompt tokens served from the
    host tier (of the prefix-cache hits), and the bytes copied each way (all ranks), also per
    second of the rate; the copies' seconds (slowest rank) and of them those the forward waited
    for (exposed; the rest overlapped it). Zeros for a server without a host tier."""
    def delta(name: str, labels: str = "") -> float:
        key = f"raypaged_{name}_total{labels}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    offloaded, loaded = delta("kv_offloaded_bytes"), delta("kv_loaded_bytes")
    copy_s, exposed_s = (delta("kv_host_copy_seconds", f",kind={kind}") for kind in ("copy", "exposed"))
    return {"host_hits": delta("host_cache_hits"), "offloaded_bytes": offloaded, "loaded_bytes": loaded,
            "offload_gb_per_s": offloaded / wall_s / 1e9 if wall_s else None,
            "load_gb_per_s": loaded / wall_s / 1e9 if wall_s else None,
            "copy_s": copy_s, "exposed_s": exposed_s}


def print_host_tier(record: dict, modes: list[str]) -> None:
    """One line per rate of each mode whose host tier moved anything."""
    bandwidth = record.get("host_device_copy_gb_per_s")
    for mode in modes:
        for r in record.get(mode, {}).get("rates", []):
            tier, hits = r.get("host_tier"), r["prefix_cache"]["hits"]
            if not tier or not (tier["offloaded_bytes"] or tier["loaded_bytes"]):
                continue
            share = f" ({tier['host_hits'] / hits:.0%} of the hits)" if hits else ""
            copy_s = tier.get("copy_s")  # absent from results before the copies were timed
            times = (f"; copies {copy_s:.3g} s, {tier['exposed_s']:.3g} s of it exposed"
                     if copy_s else "")
            print(f"host tier, {mode} at {r['rate']:g}: {tier['host_hits']:,.0f} prompt tokens from host"
                  f"{share}; {tier['offload_gb_per_s']:.3g} GB/s out, {tier['load_gb_per_s']:.3g} GB/s in"
                  + (f" (copies measured at {bandwidth})" if bandwidth else "") + times)


def print_table(record: dict, modes: list[str], slo_ttft_s: float) -> None:
    unit = rate_unit(record)
    print(f"\n| mode | {unit} | req/s | out tok/s | TTFT p50 / p99 | ITL p50 / p99 | E2E p50 / p99 "
          "| E2E per token | prefix-cache hits | mean running | pool used | filled / held |\n"
          + "| --- " * 12 + "|")
    for mode in modes:
        for r in record.get(mode, {}).get("rates", []):
            kv = r["kv"]
            rate_hits = hit_rate(r)
            print(f"| {mode} | {r['rate']:g} | {r['request_throughput']:.2f} | {r['output_tokens_per_s']:,.0f} "
                  f"| {r['ttft']['p50_ms']:,.0f} / {r['ttft']['p99_ms']:,.0f} ms "
                  f"| {r['itl']['p50_ms']:.1f} / {r['itl']['p99_ms']:.1f} ms "
                  f"| {r['e2e']['p50_ms'] / 1e3:.1f} / {r['e2e']['p99_ms'] / 1e3:.1f} s "
                  f"| {r['normalized_latency']['mean_ms']:.0f} ms "
                  f"| {'-' if rate_hits is None else f'{rate_hits:.1%}'} "
                  f"| {kv.get('mean_running', 0):.1f} | {kv.get('mean_pool_usage', 0):.0%} "
                  f"| {kv.get('kv_utilization', 0):.1%} |")
    for mode in modes:
        for r in record.get(mode, {}).get("rates", []):
            if r.get("replicas"):
                print(f"{mode} at {r['rate']:g} {unit}: " + "; ".join(
                    f"replica {x['replica']} {x['share']:.0%} of requests, hit rate "
                    f"{'-' if x['hit_rate'] is None else format(x['hit_rate'], '.1%')}" for x in r["replicas"]))
    for mode in modes:
        mode_record = record.get(mode, {})
        best = mode_record.get("max_rate_under_slo")
        above = " (every tested rate: the limit is higher)" if mode_record.get("max_rate_is_lower_bound") else ""
        print(f"max rate with p99 TTFT < {slo_ttft_s:g} s, {mode}: "
              f"{'none of the tested rates' if best is None else f'{best:g} {unit}'}{above}")
