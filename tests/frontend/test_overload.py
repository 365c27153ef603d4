"""Overload and timeouts on a real server, over gRPC and the OpenAI HTTP door of the same process.

The engine is held busy on purpose: two long "blocker" streams fill its max_num_seqs = 2, so
every request admitted after them waits in the engine's queue until they are let go. What is
shed is then decided by counts alone (the front door's waiting requests and prompt tokens, the
engine's KV usage), never by timing: a burst is answered 429 / RESOURCE_EXHAUSTED with a
Retry-After for all but the bound, the admitted ones complete with transformers' greedy tokens
once the blockers go, the shed are counted in the metrics, and nothing is left behind. A request
past its timeout (X-Request-Timeout, or the server's request_timeout_s) is aborted in the engine
— its place in the queue freed while the blockers go on — and answered 504 / DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import grpc
import openai
import pytest

from raypaged.client import Client, RequestError
from raypaged.frontend.load_shedding import OverloadPolicy
from raypaged.frontend.server import ServerConfig
from raypaged.serve.openai_api import OpenAIFrontDoor
from raypaged.serve.standalone_http import HTTPServer, build_http_app
from tests.support.checkpoints import roomy_llama
from tests.support.frontend_harness import ServerThread, init_ray
from tests.support.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.integration

MAX_WAITING = 3
MAX_WAITING_TOKENS = 100
# The blockers' length: thousands of engine steps, far longer than any test takes to decide
# (a few seconds of waits at most), on any machine. The checkpoint is the llama one with room
# for them (max_position_embeddings raised; same weights).
BLOCKER_TOKENS = 4000
RUNNING_TOKENS = 240  # a stream checked to its end against transformers
VOCAB = 320


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(roomy_llama(tmp_path_factory.mktemp("overload") / "llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    import ray

    from raypaged.config import EngineConfig

    init_ray()
    policy = OverloadPolicy(max_waiting_requests=MAX_WAITING, max_waiting_tokens=MAX_WAITING_TOKENS)
    running = ServerThread(
        EngineConfig(model=model_dir, device="cpu", num_gpu_blocks_override=640, max_num_seqs=2),
        ServerConfig(port=0, metrics_port=0, stats_interval_s=0.1, overload=policy))

    async def start_http() -> HTTPServer:
        front = OpenAIFrontDoor(running.server.service, running.server.metrics)
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
def client(server):
    with Client(server.address) as c:
        yield c


def api(server) -> openai.OpenAI:
    # The openai client retries 429 and 5xx by itself: here every answer is the server's own.
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http.port}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def greedy(**kwargs) -> dict:
    return dict(temperature=0.0, ignore_eos=True, **kwargs)


def shed_count(server, reason: str) -> float:
    metrics = server.server.metrics
    value = metrics.registry.get_sample_value(
        "raypaged_requests_shed_total", {"model_name": metrics._values[0], "engine": "0", "reason": reason})
    return value or 0.0


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@contextmanager
def engine_held(server, client: Client) -> Iterator[list[list[int]]]:
    """Two long streams running (max_num_seqs = 2): what is admitted meanwhile waits. Yields
    their prompts; afterwards they are cancelled (aborted) and the pool must come back whole."""
    prompts = random_prompts([8, 8], VOCAB, seed=101)
    streams = [client.stream(p, max_tokens=BLOCKER_TOKENS, **greedy()) for p in prompts]
    for stream in streams:
        next(stream)  # running: its first token is out
    try:
        yield prompts
        stats = server.stats()
        assert stats.num_running == 2, "the blockers finished before the test was decided"
    finally:
        for stream in streams:
            stream.close()


def shedder(server):
    return server.server.service.shedder


def assert_nothing_left(server) -> None:
    server.wait_pool_whole(timeout=30)
    wait_for(lambda: server.server.service.num_in_flight == 0, "no stream in flight")
    assert (shedder(server).num_waiting, shedder(server).num_waiting_tokens) == (0, 0)


def test_grpc_burst_is_shed_past_the_waiting_bound(server, client, model_dir):
    before = shed_count(server, "waiting_requests")
    prompts = random_prompts([6] * 8, VOCAB, seed=102)
    with ThreadPoolExecutor(len(prompts)) as pool:
        with engine_held(server, client):
            futures = [pool.submit(client.generate, p, max_tokens=5, **greedy()) for p in prompts]
            # The shed are answered at once; the admitted wait behind the blockers.
            wait_for(lambda: sum(f.done() for f in futures) == len(prompts) - MAX_WAITING, "the shed answers")
            # The admitted reach the engine's queue a moment after the door counts them.
            wait_for(lambda: server.stats().num_waiting == MAX_WAITING, "the admitted in the engine's queue")
            assert sum(f.done() for f in futures) == len(prompts) - MAX_WAITING  # none of them answered
            refused = [f.exception() for f in futures if f.done()]
        done = [(p, f.result(timeout=120)) for p, f in zip(prompts, futures) if f.exception() is None]
    assert len(refused) == len(prompts) - MAX_WAITING and len(done) == MAX_WAITING
    for error in refused:
        assert isinstance(error, RequestError) and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in error.message and error.retry_after_s is not None and error.retry_after_s >= 1
    for prompt, result in done:
        assert result.outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 5)
    assert shed_count(server, "waiting_requests") - before == len(refused)
    assert_nothing_left(server)


def test_http_burst_is_shed_with_429_and_retry_after(server, client, model_dir):
    before = shed_count(server, "waiting_requests")
    prompts = random_prompts([6] * 6, VOCAB, seed=103)

    def complete(prompt: list[int]) -> Any:
        return api(server).completions.create(model="llama", prompt=prompt, max_tokens=5, temperature=0.0,
                                              extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(prompts)) as pool:
        with engine_held(server, client):
            futures: list[Future] = [pool.submit(complete, p) for p in prompts]
            wait_for(lambda: sum(f.done() for f in futures) == len(prompts) - MAX_WAITING, "the 429s")
            refused = [f.exception() for f in futures if f.done()]
        done = [(p, f.result(timeout=120)) for p, f in zip(prompts, futures) if f.exception() is None]
    assert len(refused) == len(prompts) - MAX_WAITING and len(done) == MAX_WAITING
    for error in refused:
        assert isinstance(error, openai.RateLimitError), error
        assert int(error.response.headers["retry-after"]) >= 1
        assert error.body["type"] == "rate_limit_error" and "overloaded" in error.body["message"]
    for prompt, response in done:
        expected = server.tokenizer.decode(hf_greedy(model_dir, tuple(prompt), 5), skip_special_tokens=True)
        assert response.choices[0].text == expected
    assert shed_count(server, "waiting_requests") - before == len(refused)
    assert_nothing_left(server)


def test_waiting_prompt_tokens_and_kv_pressure_shed(server, client):
    service = server.server.service
    before_tokens, before_kv = shed_count(server, "waiting_tokens"), shed_count(server, "kv_cache")
    long_prompts = random_prompts([45, 45, 45], VOCAB, seed=104)
    with ThreadPoolExecutor(4) as pool:
        with engine_held(server, client):
            admitted = []
            for i, prompt in enumerate(long_prompts[:2]):  # 45, then 90 prompt tokens waiting
                admitted.append(pool.submit(client.generate, prompt, max_tokens=2, **greedy()))
                wait_for(lambda i=i: shedder(server).num_waiting == i + 1, "the admission")
            with pytest.raises(RequestError) as tokens:  # 135 > 100: shed, though 2 < 3 wait
                client.generate(long_prompts[2], max_tokens=2, **greedy())
            assert tokens.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "prompt tokens are waiting" in tokens.value.message
            # KV pressure: the blockers hold some of the pool and requests wait.
            policy = service.shedder.policy
            usage = server.engine.load.kv_usage
            assert usage > 0
            service.shedder.policy = dataclasses.replace(policy, shed_kv_usage=usage)
            try:
                with pytest.raises(RequestError) as kv:
                    client.generate([5, 6, 7], max_tokens=2, **greedy())
            finally:
                service.shedder.policy = policy
            assert kv.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV cache" in kv.value.message
        for future in admitted:
            assert len(future.result(timeout=120).outputs[0].token_ids) == 2
    assert shed_count(server, "waiting_tokens") - before_tokens == 1
    assert shed_count(server, "kv_cache") - before_kv == 1
    assert_nothing_left(server)


def test_timeouts_abort_the_request_while_others_go_on(server, client, model_dir):
    service = server.server.service
    with engine_held(server, client) as blockers:
        for stream in (False, True):  # it waits behind the blockers, then its time is up
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as error:
                api(server).completions.create(model="llama", prompt=[5, 6, 7], max_tokens=4, stream=stream,
                                               extra_headers={"X-Request-Timeout": "0.5"})
            assert error.value.status_code == 504 and "0.5 s timeout" in error.value.message
            assert time.monotonic() - started >= 0.5
            wait_for(lambda: server.stats().num_waiting == 0, "the timed-out request to leave the queue")
        # The server's own default, over gRPC (the client sets no deadline).
        policy = service.shedder.policy
        service.shedder.policy = dataclasses.replace(policy, request_timeout_s=0.5)
        try:
            with pytest.raises(RequestError) as timed_out:
                client.generate([5, 6, 7], max_tokens=4, **greedy())
        finally:
            service.shedder.policy = policy
        assert timed_out.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: server.stats().num_waiting == 0, "the timed-out request to leave the queue")
        assert server.stats().num_running == 2  # the blockers go on
        # A request with room to finish inside its timeout is not touched by it.
        prompt = blockers[0]
    assert_nothing_left(server)
    response = api(server).completions.create(model="llama", prompt=prompt, max_tokens=6, temperature=0.0,
                                              extra_body={"ignore_eos": True},
                                              extra_headers={"X-Request-Timeout": "300"})
    assert response.choices[0].text == server.tokenizer.decode(hf_greedy(model_dir, tuple(prompt), 6),
                                                                      skip_special_tokens=True)
    assert_nothing_left(server)


def test_a_running_stream_past_its_timeout_ends_with_an_error_and_frees_its_blocks(server, client, model_dir):
    """A streamed request running beside another, past its X-Request-Timeout: it ends with a
    timeout error (an error event after its first chunks; a 504 should no chunk come in time),
    is aborted in the engine, and the other one goes on to its full, correct output. The
    timeout is short against the request's length: 4,000 tokens in 0.3 s would take an engine
    step of 75 us at two requests, far faster than this engine's host work a step on any
    machine; a loaded machine only makes the timeout come sooner."""
    other_prompt = random_prompts([8], VOCAB, seed=105)[0]
    other = client.stream(other_prompt, max_tokens=RUNNING_TOKENS, **greedy())
    other_tokens = list(next(other).outputs[0].token_ids)
    chunks, error = [], None
    try:
        with api(server).completions.create(model="llama", prompt=[5, 6, 7], max_tokens=BLOCKER_TOKENS,
                                            stream=True, extra_body={"ignore_eos": True},
                                            extra_headers={"X-Request-Timeout": "0.3"}) as stream:
            chunks.extend(stream)
    except openai.APIError as e:
        error = e
    assert error is not None and "0.3 s timeout" in error.message, (error, len(chunks))
    assert len(chunks) < BLOCKER_TOKENS
    assert isinstance(error, openai.APIStatusError) == (not chunks)  # 504 only before any chunk
    for chunk in other:  # the other request was never touched
        other_tokens += chunk.outputs[0].token_ids
    assert other_tokens == hf_greedy(model_dir, tuple(other_prompt), RUNNING_TOKENS)
    assert_nothing_left(server)
