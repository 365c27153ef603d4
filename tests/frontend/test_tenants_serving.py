"""Tenants on a real server, over gRPC and the OpenAI HTTP door of the same process.

One engine with max_num_seqs = 1 and the priority policy, one keys file of seven tenants. What
is checked is decided by counts and by the engine's queue, never by timing: prefix-cache hits
(usage's cached tokens) stay within a tenant; limits whose buckets cannot refill within any
test's run refuse with 429 / RESOURCE_EXHAUSTED, a Retry-After and a message naming the limit;
max_concurrent refuses while a long stream is held; and with the one running slot held, a
waiting queue of two tenants' requests is served in their keys' priority order, not arrival
order. After each test the pool is whole and nothing is left counted in flight.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from raypaged.client import Client, RequestError
from raypaged.frontend.keys_file import parse_keys
from raypaged.frontend.server import ServerConfig
from raypaged.serve.openai_api import OpenAIFrontDoor
from raypaged.serve.standalone_http import HTTPServer, build_http_app
from tests.support.checkpoints import roomy_llama
from tests.support.frontend_harness import ServerThread, init_ray
from tests.support.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.integration

VOCAB = 320
BLOCK = 16
LONG = 4000  # a held stream: thousands of steps, far longer than any test takes to decide
KEYS = {name: f"sk-{name}-of-the-tenant-test" for name in
        ("alpha", "beta", "paced", "thrifty", "single", "urgent", "bulk")}
KEYS_FILE = {"keys": {
    KEYS["alpha"]: {"name": "alpha"},
    KEYS["beta"]: {"name": "beta"},
    # Refilled at one request per 1,000 s / one token per 10 s: never within a test.
    KEYS["paced"]: {"name": "paced", "requests_per_second": 0.001, "burst": 2},
    KEYS["thrifty"]: {"name": "thrifty", "tokens_per_minute": 6},
    KEYS["single"]: {"name": "single", "max_concurrent": 1},
    KEYS["urgent"]: {"name": "urgent", "priority": -5},
    KEYS["bulk"]: {"name": "bulk", "priority": 5},
}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(roomy_llama(tmp_path_factory.mktemp("tenants") / "llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    import ray

    from raypaged.config import EngineConfig

    init_ray()
    running = ServerThread(
        EngineConfig(model=model_dir, device="cpu", num_gpu_blocks_override=640, block_size=BLOCK,
                     max_num_seqs=1, scheduling_policy="priority"),
        ServerConfig(port=0, metrics_port=0, stats_interval_s=0.1, tenants=parse_keys(json.dumps(KEYS_FILE))))

    async def start_http() -> HTTPServer:
        server = running.server
        front = OpenAIFrontDoor(server.service, server.metrics, tenants=server.tenants)
        http = HTTPServer(build_http_app(front), "127.0.0.1", 0)
        await http.start()
        return http

    running.http = running.call(start_http())
    try:
        yield running
    finally:
        running.call(running.http.stop())
        running.stop()
        ray.shutdown()


@pytest.fixture
def clients(server) -> Iterator[dict[str, Client]]:
    made = {name: Client(server.address, auth_token=key) for name, key in KEYS.items()}
    try:
        yield made
    finally:
        for client in made.values():
            client.close()
        assert_nothing_left(server)


def api(server, key: str) -> openai.OpenAI:
    # No retries: every answer is the server's own (the client retries 429 by itself).
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http.port}/v1", api_key=key,
                         max_retries=0, timeout=120)


def complete(server, tenant: str, prompt: list[int], **kwargs):
    return api(server, KEYS[tenant]).completions.create(model="llama", prompt=prompt, temperature=0.0,
                                                        extra_body={"ignore_eos": True}, **kwargs)


def greedy(**kwargs) -> dict:
    return dict(temperature=0.0, ignore_eos=True, **kwargs)


def metric(server, name: str, **labels: str) -> float:
    metrics = server.server.metrics
    value = metrics.registry.get_sample_value(name, {"model_name": metrics._values[0], "engine": "0", **labels})
    return value or 0.0


def assert_nothing_left(server) -> None:
    """The pool whole, no stream in flight, no tenant counting one (a cancelled stream's
    handler gives its place back just after the engine freed its blocks: waited for)."""
    server.wait_pool_whole(timeout=30)
    service = server.server.service

    def in_flight() -> dict[str, int]:
        counts = {t.name: service.tenants.limiter(t).in_flight for t in server.server.tenants.tenants}
        return {name: n for name, n in counts.items() if n} | ({"streams": service.num_in_flight}
                                                               if service.num_in_flight else {})

    deadline = time.monotonic() + 30
    while in_flight():
        assert time.monotonic() < deadline, f"still counted in flight: {in_flight()}"
        time.sleep(0.02)


def test_unknown_or_missing_keys_are_refused(server):
    for client in (Client(server.address), Client(server.address, auth_token="sk-not-a-key-of-this-server")):
        with client, pytest.raises(RequestError) as error:
            client.generate([1, 2, 3], max_tokens=1)
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(openai.AuthenticationError) as refused:
        api(server, "sk-not-a-key-of-this-server").completions.create(model="llama", prompt=[1], max_tokens=1)
    assert refused.value.status_code == 401
    assert Client(server.address).health() == "SERVING"  # probes need no key


def test_tenants_never_share_prefix_cache_hits(server, clients, model_dir):
    """The same prompt: a hit within a tenant (over either door), never across tenants, not even
    for a client that sends another tenant's salt as its own."""
    prompt = random_prompts([2 * BLOCK + 8], VOCAB, seed=301)[0]
    full_blocks = 2 * BLOCK

    def grpc_cached(tenant: str, **kwargs) -> int:
        result = clients[tenant].generate(prompt, max_tokens=2, **greedy(), **kwargs)
        assert result.outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 2)
        assert result.usage is not None
        return result.usage.cached_tokens

    def http_cached(tenant: str) -> int:
        usage = complete(server, tenant, prompt, max_tokens=2).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    assert grpc_cached("alpha") == 0
    assert grpc_cached("alpha") == full_blocks
    assert http_cached("alpha") == full_blocks  # one tenant is one tenant on both doors
    assert http_cached("beta") == 0
    assert grpc_cached("beta") == full_blocks
    # A client's own salt divides its tenant's cache; another tenant's salt opens nothing.
    assert grpc_cached("beta", cache_salt="tenant:alpha") == 0
    assert grpc_cached("alpha", cache_salt="tenant:alpha") == 0
    assert grpc_cached("alpha", cache_salt="tenant:alpha") == full_blocks
    assert grpc_cached("urgent") == 0


def test_rate_limits_refuse_with_retry_after_and_name_the_limit(server, clients):
    before = metric(server, "raypaged_tenant_requests_refused_total", tenant="paced", reason="requests_per_second")
    for _ in range(2):  # the burst
        assert len(clients["paced"].generate([5, 6, 7], max_tokens=1, **greedy()).outputs[0].token_ids) == 1
    with pytest.raises(RequestError) as error:
        clients["paced"].generate([5, 6, 7], max_tokens=1, **greedy())
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'paced' is over its rate limit of 0.001 requests per second" in error.value.message
    assert error.value.retry_after_s is not None and error.value.retry_after_s > 900
    with pytest.raises(openai.RateLimitError) as limited:  # the same bucket behind both doors
        complete(server, "paced", [5, 6, 7], max_tokens=1)
    assert int(limited.value.response.headers["retry-after"]) > 900
    assert "requests per second" in limited.value.body["message"]
    assert metric(server, "raypaged_tenant_requests_refused_total", tenant="paced",
                  reason="requests_per_second") - before == 2
    # Tokens: 4 prompt + 2 samples of 4 generated, of a bucket of 6 refilled at 0.1 a second: in
    # debt. n = 2 is one request (max_concurrent) whose every sample's tokens are charged.
    result = clients["thrifty"].generate([5, 6, 7, 8], max_tokens=4, n=2, **greedy())
    assert [len(o.token_ids) for o in result.outputs] == [4, 4]
    with pytest.raises(RequestError) as tokens:
        clients["thrifty"].generate([5, 6, 7, 8], max_tokens=1, **greedy())
    assert tokens.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 6 tokens per minute" in tokens.value.message
    with pytest.raises(openai.RateLimitError):
        complete(server, "thrifty", [5], max_tokens=1)
    assert metric(server, "raypaged_tenant_generation_tokens_total", tenant="thrifty") == 8
    assert metric(server, "raypaged_tenant_prompt_tokens_total", tenant="thrifty") == 4
    # Others are not touched by these tenants' limits.
    assert len(clients["alpha"].generate([5, 6, 7], max_tokens=1, **greedy()).outputs[0].token_ids) == 1


def test_max_concurrent_refuses_while_a_stream_is_held(server, clients, model_dir):
    held = clients["single"].stream([9, 10, 11], max_tokens=LONG, request_id="held-by-single", **greedy())
    next(held)  # running
    try:
        # Another tenant cannot abort it: to beta it does not exist.
        with pytest.raises(RequestError) as foreign:
            clients["beta"].abort("held-by-single")
        assert foreign.value.code == grpc.StatusCode.NOT_FOUND
        assert next(held).outputs[0].finish_reason is None  # still streaming
        with pytest.raises(RequestError) as error:
            clients["single"].generate([5, 6, 7], max_tokens=1, **greedy())
        assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent 1" in error.value.message
        with pytest.raises(openai.RateLimitError) as limited:
            complete(server, "single", [5, 6, 7], max_tokens=1)
        assert limited.value.response.headers["retry-after"] == "1"
        assert metric(server, "raypaged_tenant_requests_in_flight", tenant="single") == 1
    finally:
        held.close()  # cancelled: aborted in the engine, its place given back
    server.wait_pool_whole(timeout=30)
    prompt = [5, 6, 7]
    result = clients["single"].generate(prompt, max_tokens=3, **greedy())
    assert result.outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 3)
    assert metric(server, "raypaged_tenant_requests_in_flight", tenant="single") == 0


def test_priority_orders_the_waiting_queue(server, clients, model_dir):
    """The one running slot is held by an urgent stream; a bulk request (asking for priority
    -100, which its key's 5 overrides) arrives, then another urgent one. When the slot frees,
    the later urgent request runs and bulk still waits: under arrival order it would have run
    (and finished) first. Nobody is preempted."""
    preemptions = server.stats().num_preemptions
    bulk_prompt, urgent_prompt = random_prompts([6, 6], VOCAB, seed=302)
    blocker = clients["urgent"].stream([9, 10, 11], max_tokens=LONG, **greedy())
    next(blocker)
    with ThreadPoolExecutor(2) as pool:
        try:
            bulk = pool.submit(clients["bulk"].generate, bulk_prompt, max_tokens=4, priority=-100, **greedy())
            server.wait_until(lambda s: s.num_waiting == 1, 30, "bulk to wait")
            urgent_stream = clients["urgent"].stream(urgent_prompt, max_tokens=LONG, **greedy())
            urgent_first = pool.submit(next, urgent_stream)
            server.wait_until(lambda s: s.num_waiting == 2, 30, "urgent to wait behind the blocker")
        finally:
            blocker.close()
        try:
            first = urgent_first.result(timeout=120)  # the later urgent request got the slot
            assert first.outputs[0].token_ids == hf_greedy(model_dir, tuple(urgent_prompt), 1)
            stats = server.stats()
            assert not bulk.done() and (stats.num_waiting, stats.num_running) == (1, 1)
        finally:
            urgent_stream.close()
        result = bulk.result(timeout=120)
    assert result.outputs[0].token_ids == hf_greedy(model_dir, tuple(bulk_prompt), 4)
    assert server.stats().num_preemptions == preemptions


def test_a_malformed_keys_file_stops_the_command_at_start(tmp_path):
    """Before Ray or the model: exit 2, the file's line and field in the message. (launch and
    serve share this path, commands/launch.py run_server: one of them is run.)"""
    bad = tmp_path / "keys.yaml"
    bad.write_text(f"keys:\n  {KEYS['alpha']}:\n    name: alpha\n    max_concurrent: many\n")
    result = subprocess.run([sys.executable, "-m", "raypaged.cli", "serve", "--api-keys-file", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"raypaged serve: {bad} line 4: max_concurrent: must be an integer, got 'many'" in result.stderr
    assert KEYS["alpha"] not in result.stderr and "Traceback" not in result.stderr
