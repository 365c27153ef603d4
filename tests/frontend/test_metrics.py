"""The Prometheus page, scraped over HTTP and parsed with prometheus_client's own parser: vLLM's
names, types and buckets under `raypaged_`, values that move exactly as requests run, and the
paging-waste gauges (allocated but unfilled slots under one block per running request)."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raypaged.client import Client, RequestError
from raypaged.frontend.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import cpu_server
from tests.support.hf_oracle import random_prompts

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16

# Family name (counters without _total, as the parser reports them) -> type.
EXPECTED = {
    "raypaged_num_requests_running": "gauge",
    "raypaged_num_requests_waiting": "gauge",
    "raypaged_kv_cache_usage_perc": "gauge",
    "raypaged_prefix_cache_queries": "counter",
    "raypaged_prefix_cache_hits": "counter",
    "raypaged_num_preemptions": "counter",
    "raypaged_prompt_tokens": "counter",
    "raypaged_generation_tokens": "counter",
    "raypaged_request_success": "counter",
    "raypaged_time_to_first_token_seconds": "histogram",
    "raypaged_inter_token_latency_seconds": "histogram",
    "raypaged_e2e_request_latency_seconds": "histogram",
    "raypaged_request_queue_time_seconds": "histogram",
    "raypaged_request_prompt_tokens": "histogram",
    "raypaged_request_generation_tokens": "histogram",
    "raypaged_kv_cache_allocated_slots": "gauge",
    "raypaged_kv_cache_filled_slots": "gauge",
    "raypaged_kv_cache_unfilled_slots": "gauge",
    "raypaged_kv_cache_shared_saved_slots": "gauge",
}


@pytest.fixture(scope="module")
def server():
    with cpu_server(str(checkpoint_dir("llama")), num_gpu_blocks_override=64,
                    max_num_seqs=8) as running:
        yield running


def scrape(server) -> tuple[dict, dict]:
    """(families by name, sample values by (sample name, sorted labels without model/engine))."""
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    values = {}
    for family in families.values():
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                  if k not in ("model_name", "engine")))
            values[(sample.name, labels)] = sample.value
    return families, values


def value(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(server, condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        families, values = scrape(server)
        if condition(values):
            return values
        assert time.monotonic() < deadline, "metrics did not reach the expected values"
        time.sleep(0.05)


def test_names_types_and_buckets(server):
    families, values = scrape(server)
    for name, kind in EXPECTED.items():
        assert name in families, name
        assert families[name].type == kind, name
    assert not [f for f in families if not f.startswith("raypaged_")]
    assert value(values, "raypaged_kv_cache_blocks") == server.num_blocks

    def bounds(name):
        return sorted(float(dict(labels)["le"]) for (sample, labels) in values
                      if sample == f"{name}_bucket" and dict(labels)["le"] != "+Inf")

    assert bounds("raypaged_time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert bounds("raypaged_inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert bounds("raypaged_e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert bounds("raypaged_request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200]  # max_model_len 256


def test_request_metrics_move_exactly(server):
    _, before = scrape(server)
    lengths, max_tokens = [5, 7, 9], [4, 5, 6]
    with Client(server.address) as c:
        for prompt, m in zip(random_prompts(lengths, 320, seed=21), max_tokens):
            c.generate(prompt, max_tokens=m, temperature=0.0, ignore_eos=True)
    after = wait_for(server, lambda v: value(v, "raypaged_prefix_cache_queries_total")
                     >= value(before, "raypaged_prefix_cache_queries_total") + sum(lengths))

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("raypaged_prompt_tokens_total") == sum(lengths)
    assert delta("raypaged_generation_tokens_total") == sum(max_tokens)
    assert delta("raypaged_request_success_total", finished_reason="length") == 3
    assert delta("raypaged_request_success_total", finished_reason="stop") == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"raypaged_{histogram}_count") == 3, histogram
    assert delta("raypaged_inter_token_latency_seconds_count") == sum(m - 1 for m in max_tokens)
    assert delta("raypaged_request_prompt_tokens_sum") == sum(lengths)
    assert delta("raypaged_request_generation_tokens_sum") == sum(max_tokens)
    assert delta("raypaged_e2e_request_latency_seconds_sum") > 0
    assert delta("raypaged_request_params_n_count") == 3


def test_running_gauges_and_paging_waste(server):
    """While requests stream: running counts, KV usage, and unfilled slots under one block per
    running sequence (the paging claim); n = 2 shares its prompt's blocks (saved slots > 0)."""
    prompt = random_prompts([37], 320, seed=22)[0]
    _, before = scrape(server)
    with Client(server.address) as c:
        single = c.stream(prompt, max_tokens=200, temperature=0.0, ignore_eos=True)
        pair = c.stream(prompt[::-1], max_tokens=200, n=2, temperature=1.0, seed=5, ignore_eos=True)
        next(single), next(pair)
        during = wait_for(server, lambda v: value(v, "raypaged_num_requests_running") == 3
                          and value(v, "raypaged_kv_cache_shared_saved_slots") > 0)
        allocated = value(during, "raypaged_kv_cache_allocated_slots")
        filled = value(during, "raypaged_kv_cache_filled_slots")
        unfilled = value(during, "raypaged_kv_cache_unfilled_slots")
        assert 0 < filled <= allocated and unfilled == allocated - filled
        assert unfilled < 3 * BLOCK_SIZE  # at most one partly filled block per sequence
        usage = value(during, "raypaged_kv_cache_usage_perc")
        assert usage == pytest.approx(allocated / BLOCK_SIZE / server.num_blocks)
        single.close(), pair.close()
    after = wait_for(server, lambda v: value(v, "raypaged_num_requests_running") == 0
                     and value(v, "raypaged_kv_cache_usage_perc") == 0)
    assert value(after, "raypaged_kv_cache_allocated_slots") == 0
    aborted = ("raypaged_request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) - before.get(aborted, 0) == 3  # every cancelled sample counted


def test_prefix_cache_hits(server):
    prompt = random_prompts([40], 320, seed=23)[0]
    _, before = scrape(server)
    with Client(server.address) as c:
        for _ in range(2):
            c.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
    base = value(before, "raypaged_prefix_cache_hits_total")
    after = wait_for(server, lambda v: value(v, "raypaged_prefix_cache_hits_total") > base)
    # The second request finds the first's two full blocks.
    assert value(after, "raypaged_prefix_cache_hits_total") - base == 2 * BLOCK_SIZE


def test_errors_counted_by_code(server):
    _, before = scrape(server)
    with Client(server.address) as c:
        with pytest.raises(RequestError):
            c.generate("hello", max_tokens=0)
    _, after = scrape(server)
    name, code = "raypaged_request_errors_total", grpc.StatusCode.INVALID_ARGUMENT.name
    assert value(after, name, code=code) - value(before, name, code=code) == 1


def test_idle_and_slow_clients_do_not_block_scrapes(server):
    """Issue 24: one TCP connection that sent nothing blocked every scrape (the endpoint served
    one connection at a time). Idle ones, one trickling a request in, and one that sent half a
    request and went quiet: scrapes go on meanwhile."""
    import socket

    address = ("127.0.0.1", server.server.metrics_port)
    idle = [socket.create_connection(address, timeout=30) for _ in range(8)]
    slow = socket.create_connection(address, timeout=30)
    half = socket.create_connection(address, timeout=30)
    try:
        half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        for byte in b"GET /metr":
            slow.sendall(bytes([byte]))
            families, _ = scrape(server)  # each within its own 10 s timeout
            assert "raypaged_num_requests_running" in families
        slow.sendall(b"ics HTTP/1.0\r\n\r\n")  # the slow one is answered in the end, too
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.0 200") and b"raypaged_num_requests_running" in answer
    finally:
        for sock in [*idle, slow, half]:
            sock.close()
