"""Prometheus metrics, `raypaged_*`, one-to-one with vLLM's `vllm:*` where vLLM has the metric.

Same meaning, type and histogram buckets as vLLM v1 (vllm/v1/metrics/loggers.py), so dashboards
map over by renaming the prefix; counters get prometheus_client's `_total` suffix as vLLM's do.
Beyond vLLM: the paging waste the block design is about — KV slots allocated but not (yet)
filled, and slots saved by prefix sharing — read from the engine's KVCacheStats.

Two sources feed them: the frontend's own view of each request (token counts and latencies, as
the client experiences them) and a periodic poll of the engine's scheduler stats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

if TYPE_CHECKING:
    from raypaged.core.scheduler import SchedulerStats

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
HOST_COPY_KINDS = ("copy", "exposed")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class FrontendMetrics:
    """All metrics of one frontend, in a registry of their own (several servers can live in one
    process, as in tests). Label values: the served model's name and an engine index (a Ray
    Serve replica sets its own)."""

    # Families whose label values are known only per call (a code, a reason, a tenant).
    PER_CALL_FAMILIES = ("request_errors", "requests_shed", "tenant_requests", "tenant_prompt_tokens",
                         "tenant_generation_tokens", "tenant_requests_refused", "tenant_requests_in_flight",
                         "kv_cache_group_blocks")

    def __init__(self, model_name: str, max_model_len: int, engine: str = "0",
                 registry: CollectorRegistry | None = None) -> None:
        # As vLLM: no `_created` series beside every counter and histogram (process-wide).
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        names = ["model_name", "engine"]
        values = (model_name, engine)

        def make(kind, name: str, doc: str, **kwargs):
            metric = kind(f"raypaged_{name}", doc, names, registry=self.registry, **kwargs)
            return metric.labels(*values)

        # Scheduler state (polled from the engine).
        self.num_requests_running = make(
            Gauge, "num_requests_running",
            "Number of requests in model execution batches.")
        self.num_requests_waiting = make(
            Gauge, "num_requests_waiting",
            "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = make(
            Gauge, "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = make(
            Counter, "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = make(
            Counter, "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.")
        # The host tier of KV blocks (--kv-offload-size); zero without one.
        self.host_cache_hits = make(
            Counter, "host_cache_hits",
            "Of the prefix cache hits, tokens found in the host tier (the rest: in GPU memory).")
        self.kv_offloaded_bytes = make(
            Counter, "kv_offloaded_bytes", "KV bytes copied from GPU to host memory, all ranks.")
        self.kv_loaded_bytes = make(
            Counter, "kv_loaded_bytes", "KV bytes copied from host to GPU memory, all ranks.")
        self.kv_host_free_blocks = make(
            Gauge, "kv_host_free_blocks", "Host-tier KV blocks that hold nothing.")
        # Time of those copies on the slowest rank: kind="copy", the copy stream's; kind="exposed",
        # of it what the forward waited for (the rest, copy - exposed, overlapped the forward).
        # Two running totals, each monotone; their difference is not a counter of its own.
        self.kv_host_copy_seconds = Counter(
            "raypaged_kv_host_copy_seconds",
            "Seconds of the host tier's KV copies (slowest rank), kind copy: all of it; kind "
            "exposed: what the forward waited for (on CPU: all of it).",
            names + ["kind"], registry=self.registry)
        self._host_copy_seconds = {kind: self.kv_host_copy_seconds.labels(*values, kind)
                                   for kind in HOST_COPY_KINDS}
        self.num_preemptions = make(
            Counter, "num_preemptions",
            "Cumulative number of preemption from the engine.")
        # Paging waste (raypaged only). Slots are token positions; a shared block counts once.
        self.kv_cache_blocks = make(Gauge, "kv_cache_blocks", "KV-cache blocks in the pool.")
        self.kv_cache_free_blocks = make(
            Gauge, "kv_cache_free_blocks",
            "KV-cache blocks not held by any request.")
        self.kv_cache_allocated_slots = make(
            Gauge, "kv_cache_allocated_slots",
            "KV-cache slots in blocks held by requests.")
        self.kv_cache_filled_slots = make(
            Gauge, "kv_cache_filled_slots",
            "Allocated KV-cache slots that hold a computed token.")
        self.kv_cache_unfilled_slots = make(
            Gauge, "kv_cache_unfilled_slots",
            "Allocated KV-cache slots that hold nothing (yet): the paging waste, about one "
            "block tail per request.")
        self.kv_cache_shared_saved_slots = make(
            Gauge, "kv_cache_shared_saved_slots",
            "KV-cache slots saved by sharing blocks (prefix cache, parallel sampling).")
        # The pool's size in memory, per rank (an FP8 pool: one byte a value, twice the blocks).
        self.kv_cache_block_bytes = make(
            Gauge, "kv_cache_block_bytes",
            "Bytes one KV-cache block takes on each rank (all layers, K and V).")
        self.kv_cache_bytes = make(Gauge, "kv_cache_bytes",
                                   "Bytes of the KV-cache pool on each rank.")
        self.kv_cache_element_bytes = make(
            Gauge, "kv_cache_element_bytes",
            "Bytes of one cached K or V value: 2 for bf16/fp16, 1 for an FP8 pool.")

        # Models whose layers differ: blocks held per KV-cache group (core/kv_cache_groups.py),
        # by group index and window ("full" for full attention). No series with one group.
        self.kv_cache_group_blocks = Gauge(
            "raypaged_kv_cache_group_blocks",
            "KV-cache blocks held per KV-cache group (layers of one attention kind).",
            names + ["group", "window"], registry=self.registry)

        # Requests, as the frontend sees them.
        self.prompt_tokens = make(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(
            Counter, "generation_tokens",
            "Number of generation tokens processed.")
        self.request_success = Counter("raypaged_request_success",
                                       "Count of successfully processed requests.",
                                       names + ["finished_reason"], registry=self.registry)
        self._success = {reason: self.request_success.labels(*values, reason)
                         for reason in FINISH_REASONS}
        self.request_errors = Counter("raypaged_request_errors",
                                      "Requests refused or failed, by gRPC status code.",
                                      names + ["code"], registry=self.registry)
        self.streams_replayed = make(Counter, "streams_replayed",
                                     "Streams that went on on a new engine after theirs died.")
        self.requests_shed = Counter("raypaged_requests_shed",
                                     "Requests refused under overload (429 / RESOURCE_EXHAUSTED), by reason.",
                                     names + ["reason"], registry=self.registry)
        # Per tenant (API key, frontend/tenants.py): labelled by its name as well.
        tenant_names = names + ["tenant"]
        self.tenant_requests = Counter("raypaged_tenant_requests", "Requests admitted, per tenant.",
                                       tenant_names, registry=self.registry)
        self.tenant_prompt_tokens = Counter("raypaged_tenant_prompt_tokens",
                                            "Prompt tokens of the requests admitted, per tenant.",
                                            tenant_names, registry=self.registry)
        self.tenant_generation_tokens = Counter("raypaged_tenant_generation_tokens",
                                                "Tokens generated, per tenant.", tenant_names,
                                                registry=self.registry)
        self.tenant_requests_refused = Counter(
            "raypaged_tenant_requests_refused",
            "Requests refused with 429 / RESOURCE_EXHAUSTED, per tenant and reason (its own "
            "limits, or the server's overload shedding).", tenant_names + ["reason"], registry=self.registry)
        self.tenant_requests_in_flight = Gauge("raypaged_tenant_requests_in_flight",
                                               "Requests in flight, per tenant.", tenant_names,
                                               registry=self.registry)
        self._values = values
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = make(
            Histogram, "request_prompt_tokens",
            "Number of prefill tokens processed.", buckets=token_buckets)
        self.request_generation_tokens = make(
            Histogram, "request_generation_tokens",
            "Number of generation tokens processed.", buckets=token_buckets)
        self.request_params_n = make(
            Histogram, "request_params_n",
            "Histogram of the n request parameter.", buckets=N_BUCKETS)
        self.request_params_max_tokens = make(
            Histogram, "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.", buckets=token_buckets)
        self.time_to_first_token = make(
            Histogram, "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS)
        self.inter_token_latency = make(
            Histogram, "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", buckets=ITL_BUCKETS)
        self.e2e_request_latency = make(
            Histogram, "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", buckets=REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = make(
            Histogram, "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            buckets=REQUEST_LATENCY_BUCKETS)

        self._last_engine_totals: dict[str, float] = {}

    def record_kv_pool(self, model_info: dict) -> None:
        """The pool's size from the engine's model_info (set once: it never changes)."""
        block_bytes = model_info.get("kv_cache_bytes_per_block")
        if block_bytes is None:
            return
        self.kv_cache_block_bytes.set(block_bytes)
        self.kv_cache_bytes.set(block_bytes * model_info["num_blocks"])
        self.kv_cache_element_bytes.set(model_info["kv_cache_element_bytes"])

    def record_engine_stats(self, stats: SchedulerStats) -> None:
        kv = stats.kv_cache
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(kv.usage)
        self.kv_cache_blocks.set(kv.num_blocks)
        self.kv_cache_free_blocks.set(kv.num_free_blocks)
        self.kv_cache_allocated_slots.set(kv.allocated_slots)
        self.kv_cache_filled_slots.set(kv.filled_slots)
        self.kv_cache_unfilled_slots.set(kv.unfilled_slots)
        self.kv_cache_shared_saved_slots.set(kv.shared_saved_slots)
        for group, (blocks, window) in enumerate(zip(kv.group_blocks, kv.group_windows)):
            self.kv_cache_group_blocks.labels(
                *self._values, str(group), "full" if window is None else str(window)).set(blocks)
        self._add_engine_total("prefix_cache_queries", kv.prefix_cache_queries,
                               self.prefix_cache_queries)
        self._add_engine_total("prefix_cache_hits", kv.prefix_cache_hits, self.prefix_cache_hits)
        self._add_engine_total("num_preemptions", stats.num_preemptions, self.num_preemptions)
        self._add_engine_total("host_cache_hits", kv.host_cache_hits, self.host_cache_hits)
        self._add_engine_total("kv_offloaded_bytes", kv.offloaded_bytes, self.kv_offloaded_bytes)
        self._add_engine_total("kv_loaded_bytes", kv.loaded_bytes, self.kv_loaded_bytes)
        self.kv_host_free_blocks.set(kv.num_host_free_blocks)
        for kind, seconds in zip(HOST_COPY_KINDS, (kv.host_copy_s, kv.host_copy_exposed_s)):
            self._add_engine_total(f"kv_host_copy_seconds/{kind}", seconds,
                                   self._host_copy_seconds[kind])

    def _add_engine_total(self, name: str, total: float, counter) -> None:
        """The engine keeps running totals; the counter gets what was added since the last poll
        (all of it when the total went down: a restarted engine counts from zero)."""
        last = self._last_engine_totals.get(name, 0)
        counter.inc(total - last if total >= last else total)
        self._last_engine_totals[name] = total

    def record_error(self, code_name: str) -> None:
        self.request_errors.labels(*self._values, code_name).inc()

    def record_shed(self, reason: str) -> None:
        """A request shed by the front door (frontend/load_shedding.py SHED_REASONS)."""
        self.requests_shed.labels(*self._values, reason).inc()

    def record_tenant_admitted(self, tenant: str, num_prompt_tokens: int) -> None:
        self.tenant_requests.labels(*self._values, tenant).inc()
        self.tenant_prompt_tokens.labels(*self._values, tenant).inc(num_prompt_tokens)

    def record_tenant_tokens(self, tenant: str, generated: int) -> None:
        self.tenant_generation_tokens.labels(*self._values, tenant).inc(generated)

    def record_tenant_refused(self, tenant: str, reason: str) -> None:
        """reason: frontend/rate_limit.py REASONS or frontend/load_shedding.py SHED_REASONS."""
        self.tenant_requests_refused.labels(*self._values, tenant, reason).inc()

    def record_tenant_in_flight(self, tenant: str, in_flight: int) -> None:
        self.tenant_requests_in_flight.labels(*self._values, tenant).set(in_flight)

    def track(self, num_prompt_tokens: int, n: int, max_tokens: int) -> RequestTracker:
        self.request_params_n.observe(n)
        self.request_params_max_tokens.observe(max_tokens)
        return RequestTracker(self, num_prompt_tokens)


@dataclass
class RequestTracker:
    """One request's timings. Times are the frontend's: what its client experiences."""

    metrics: FrontendMetrics
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)  # per sample
    num_generated: dict[int, int] = field(default_factory=dict)

    def on_tokens(self, sample_index: int, num_tokens: int, queue_time_s: float | None) -> None:
        now = time.monotonic()
        metrics = self.metrics
        if queue_time_s is not None:
            metrics.request_queue_time.observe(queue_time_s)
        if num_tokens == 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.time_to_first_token.observe(now - self.arrival)
            metrics.prompt_tokens.inc(self.num_prompt_tokens)
        last = self.last_token_at.get(sample_index)
        if last is not None:
            metrics.inter_token_latency.observe(now - last)
        self.last_token_at[sample_index] = now
        self.num_generated[sample_index] = self.num_generated.get(sample_index, 0) + num_tokens
        metrics.generation_tokens.inc(num_tokens)

    def on_finished(self, sample_index: int, finish_reason: str) -> None:
        """Each sample counts as a request once it finishes, as vLLM v1 counts its samples."""
        metrics = self.metrics
        metrics._success[finish_reason].inc()
        metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)
        metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        metrics.request_generation_tokens.observe(self.num_generated.get(sample_index, 0))
