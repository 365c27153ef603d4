"""One rate of bench_serving against a running server: its load driven at that rate, the server's
KV gauges sampled while it runs and its counters before and after, summed up as one rate's record
(serving_report.py does the arithmetic)."""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.serving_load import Load
from benchmarks.serving_report import (
    KV_GAUGES,
    host_tier_summary,
    kv_summary,
    prefix_cache_summary,
    replica_summary,
    summarize_rate,
)
from benchmarks.soak import LaunchedServer, scrape
from raypaged.frontend.server import ServerConfig


async def sample_metrics(server: LaunchedServer, samples: list[dict], done: asyncio.Event,
                         interval_s: float = 1.0) -> None:
    """Scrapes the KV gauges until `done`, once a second (the frontend polls the engine's stats
    into them once a second: faster only repeats values), with the server's RSS (every process
    of its session) beside them. The scrape blocks, so it runs in a thread, off the loop that
    times the streams."""
    started = time.perf_counter()
    while not done.is_set():
        try:
            metrics = await asyncio.to_thread(scrape, server.metrics_url)
        except OSError:  # a failed scrape leaves a gap in the record, nothing more
            metrics = None
        if metrics is not None:
            sample = {"seconds": round(time.perf_counter() - started, 2)}
            sample.update({name: metrics.get(f"raypaged_{name}") for name in KV_GAUGES})
            rss = await asyncio.to_thread(server.rss_by_process)
            sample["server_rss_mib"] = round(sum(size for _, size in rss.values()) / 2**20, 1)
            samples.append(sample)
        try:
            await asyncio.wait_for(done.wait(), interval_s)
        except asyncio.TimeoutError:
            pass



def settled_scrape(metrics_url: str) -> dict[str, float]:
    """The metrics once the frontend has polled the engine since now: its counters (prefix
    cache, preemptions) are the engine's totals as of that poll."""
    time.sleep(ServerConfig.stats_interval_s + 0.5)
    return scrape(metrics_url)


def run_rate(server: LaunchedServer, info, load: Load, rate: float, args: argparse.Namespace) -> dict:
    samples: list[dict] = []

    async def measure():
        done = asyncio.Event()
        sampler = asyncio.create_task(sample_metrics(server, samples, done))
        try:
            return await load.run(server.address, rate, args.channels)
        finally:
            done.set()
            await sampler

    before = settled_scrape(server.metrics_url)
    ran = asyncio.run(measure())
    after = settled_scrape(server.metrics_url)
    result = summarize_rate(rate, ran.timings, ran.wall_s)
    result.update(ran.extra)
    preemptions = "raypaged_num_preemptions_total"
    result["preemptions"] = after.get(preemptions, 0) - before.get(preemptions, 0)
    result["prefix_cache"] = prefix_cache_summary(before, after, ran.timings)
    result["replicas"] = replica_summary(before, after)
    result["host_tier"] = host_tier_summary(before, after, ran.wall_s)
    result["kv"] = kv_summary(samples, info.block_size)
    result["kv_samples"] = samples
    rss = [x["server_rss_mib"] for x in samples]
    result["server_rss_mib"] = {"first": rss[0], "peak": max(rss), "last": rss[-1]} if rss else None
    return result

