"""What a soak samples while its load runs, in a thread: the RSS of every process of the server's
session, its health, and (when asked) the Ray object store's bytes in use; and the summaries
that tell a leak (memory growing with the requests served) from warm-up."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from benchmarks.lib.launched_server import LaunchedServer
from raypaged.client import RequestError


def object_store_probe(gcs_address: str) -> Callable[[], int | None]:
    """A function that returns the bytes in use in the Ray object store of the cluster at
    `gcs_address` (every node's plasma store, summed), asking the raylets through the GCS without
    joining the cluster as a driver; None when they cannot be asked right now."""
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    # A local cluster that ray.init() started has token auth on, with the token this user's.
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    state = get_state_from_address(gcs_address)

    def probe() -> int | None:
        try:
            reply = get_memory_info_reply(state, timeout_seconds=5)
        except Exception:  # noqa: BLE001 - a raylet busy or restarting: one sample missing
            return None
        return int(reply.store_stats.object_store_bytes_used)

    return probe


class Sampler:
    """RSS and health (and, given a probe, the object store's bytes in use) sampled in a thread
    while the load runs."""

    def __init__(self, server: LaunchedServer, interval_s: float = 1.0,
                 object_store: Callable[[], int | None] | None = None) -> None:
        self.server = server
        self.interval_s = interval_s
        self.object_store = object_store
        self.object_store_bytes: list[tuple[float, int, int]] = []  # (time.monotonic(), requests done, bytes)
        self.rss: list[tuple[float, int, int]] = []  # (seconds, requests done, bytes)
        self.by_process: list[tuple[int, dict[int, tuple[str, int]]]] = []  # (requests done, per process)
        self.health: Counter = Counter()
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from raypaged.client import Client

        assert self.server.address is not None
        with Client(self.server.address) as client:
            while not self._stop.is_set():
                done, sizes = self.done, self.server.rss_by_process()
                self.rss.append((time.monotonic() - self._started, done, sum(rss for _, rss in sizes.values())))
                self.by_process.append((done, sizes))
                if self.object_store is not None and (used := self.object_store()) is not None:
                    self.object_store_bytes.append((time.monotonic(), done, used))
                try:
                    self.health[client.health(timeout=5)] += 1
                except RequestError as e:
                    self.health[e.code.name] += 1
                self._stop.wait(self.interval_s)


def rss_summary(samples: list[tuple[float, int, int]], num_requests: int) -> dict:
    """Memory after warm-up (the first 20% of requests) against the end of the run, and over the
    second half alone: a leak grows with the requests served (the second half grows as much as
    the first), warm-up does not. `curve` is (requests done, MiB) at about 20 points."""
    mib = 1024 * 1024

    def first_at(fraction: float) -> int:
        return next((b for _, done, b in samples if done >= fraction * num_requests), samples[-1][2])

    final, peak = samples[-1][2], max(b for *_, b in samples)
    step = max(1, len(samples) // 20)
    return {"after_warmup_mib": round(first_at(0.2) / mib, 1), "final_mib": round(final / mib, 1),
            "peak_mib": round(peak / mib, 1), "growth_mib": round((final - first_at(0.2)) / mib, 1),
            "growth_second_half_mib": round((final - first_at(0.5)) / mib, 1),
            "samples": len(samples),
            "curve": [(done, round(b / mib, 1)) for _, done, b in samples[::step]]}


def growth_by_process(samples: list[tuple[int, dict[int, tuple[str, int]]]], num_requests: int) -> dict:
    """MiB each process grew from the end of warm-up to the end, largest first (where the
    memory goes if the total grows; processes started or gone meanwhile count from or to 0),
    with the RSS curve (requests done, MiB) of the three that grew most."""
    start = next((sizes for done, sizes in samples if done >= 0.2 * num_requests), samples[0][1])
    end = samples[-1][1]
    growth = {}
    for pid in start.keys() | end.keys():
        growth[pid] = (end.get(pid, ("", 0))[1] - start.get(pid, ("", 0))[1]) / 2**20
    top = sorted(growth, key=lambda pid: -abs(growth[pid]))[:8]

    def label(pid: int) -> str:
        name, _ = end.get(pid) or start[pid]
        return f"{name} {pid}" + ("" if pid in start and pid in end else " (new)" if pid in end else " (gone)")

    step = max(1, len(samples) // 20)
    return {"growth_mib": {label(pid): round(growth[pid], 1) for pid in top},
            "curves_mib": {label(pid): [(done, round(sizes[pid][1] / 2**20, 1))
                                        for done, sizes in samples[::step] if pid in sizes]
                           for pid in top[:3]}}
