"""The engine actor dies mid-stream and nothing is lost (frontend/replay.py), seen from real gRPC
clients of a live server whose supervisor brings a new engine.

- Several streams at once — greedy, seeded sampled with logprobs, n = 2 seeded, one whose stop
  string begins before the fault and ends after it, and a greedy one over the OpenAI HTTP door
  (`raypaged serve`'s, over the same service) — are in flight when the engine actor is
  SIGKILLed: each gives exactly the tokens and text of a fault-free run (greedy: transformers'
  output), no token lost or repeated; a request sent during the outage waits and is served by
  the new engine; the new engine's pool is whole afterwards and only it is left.
- An engine that never comes back (every restart fails; the actor `ray.kill`ed): the stream in
  flight and a request sent meanwhile end with UNAVAILABLE within the recovery bound, never a
  hang; once restarts work again the server serves correctly.

One server for the module; the tests run in order and each leaves it SERVING with a whole pool.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import grpc
import openai
import pytest
import ray

from raypaged.client import Client, RequestError
from raypaged.config import EngineConfig
from raypaged.core.structured_output import StructuredOutput
from raypaged.frontend.server import ServerConfig
from raypaged.frontend.supervisor import RestartPolicy
from raypaged.serve.openai_api import OpenAIFrontDoor
from raypaged.serve.standalone_http import HTTPServer, build_http_app
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import ServerThread, init_ray
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of
from tests.support.ray_state import alive_actors, live_placement_groups
from tests.support.streams import Stream

pytestmark = pytest.mark.integration

NAME = "llama"
MAX_TOKENS = 160
KILL_AFTER = 8  # tokens every stream has before the engine is killed
RECOVERY_S = 60.0


@pytest.fixture(scope="module")
def server():
    init_ray()
    running = ServerThread(
        EngineConfig(model=str(checkpoint_dir(NAME)), device="cpu", block_size=8,
                     num_gpu_blocks_override=160, max_num_seqs=8),
        ServerConfig(port=0, stats_interval_s=0.1,
                     restart_policy=RestartPolicy(initial_backoff_s=0.2, max_backoff_s=0.5,
                                                  recovery_timeout_s=RECOVERY_S)),
        restart_engine=True)
    front = OpenAIFrontDoor(running.server.service, running.server.metrics)

    async def start() -> HTTPServer:
        http = HTTPServer(build_http_app(front), "127.0.0.1", 0)
        await http.start()
        return http

    http = running.call(start())
    running.http_url = f"http://127.0.0.1:{http.port}/v1"
    try:
        yield running
    finally:
        running.call(http.stop())
        running.stop()
        ray.shutdown()


class HTTPStream:
    """One streamed greedy OpenAI completion in a thread: its text and finish."""

    def __init__(self, server: ServerThread, prompt: list[int]) -> None:
        self.text = ""
        self.num_chunks = 0
        self.finish: str | None = None
        self.error: Exception | None = None
        api = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=300)
        self._thread = threading.Thread(target=self._run, args=(api, server.server.service.model_name, prompt),
                                        daemon=True)
        self._thread.start()

    def _run(self, api: openai.OpenAI, model: str, prompt: list[int]) -> None:
        try:
            for chunk in api.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0.0, stream=True,
                                                extra_body={"ignore_eos": True}):
                for choice in chunk.choices:
                    self.text += choice.text
                    self.num_chunks += 1
                    self.finish = choice.finish_reason or self.finish
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def join(self, timeout_s: float = 180.0) -> HTTPStream:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the HTTP stream hangs"
        return self


def requests_of(prompts: list[list[int]], stop: str) -> list[tuple[list[int], dict]]:
    common = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        (prompts[0], dict(temperature=0.0, **common)),
        (prompts[1], dict(temperature=1.0, top_p=0.95, seed=2024, logprobs=2, **common)),
        (prompts[2], dict(n=2, temperature=0.9, seed=7, frequency_penalty=0.5, **common)),
        (prompts[0], dict(temperature=0.0, stop=[stop], **common)),
    ]


def kill_engine_process(server: ServerThread) -> None:
    pid = ray.get(server.engine.actor.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)


def wait_replaced(server: ServerThread, old_engine, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.engine is old_engine or not server.engine.is_alive:
        assert time.monotonic() < deadline, "the engine never came back"
        time.sleep(0.05)


def assert_only_one_engine_left() -> None:
    names = Counter(a["ActorClassName"] for a in alive_actors())
    assert names["EngineActor"] == 1, names
    assert len(live_placement_groups()) == 0


def test_streams_go_on_on_the_new_engine_as_if_nothing_happened(server):
    prompts = random_prompts([7, 12, 9], vocab_of(NAME), seed=71)
    greedy = hf_greedy(checkpoint_dir(NAME), tuple(prompts[0]), MAX_TOKENS)
    # A stop string from text 3..75 tokens into the greedy output: it begins before the fault
    # (KILL_AFTER tokens in, or a few more) and ends well after it.
    with Client(server.address) as client:
        text = client.generate(prompts[0], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True).outputs[0].text
        stop = client.generate(prompts[0] + greedy[:3], temperature=0.0, max_tokens=72,
                               ignore_eos=True).outputs[0].text
    assert stop and stop in text
    requests = requests_of(prompts, stop)
    reference = [Stream(server.address, p, **params) for p, params in requests]
    for stream in reference:
        stream.join()
    assert reference[0].tokens == [greedy]
    assert reference[3].text[0] == text[:text.index(stop)] and reference[3].finish == ["stop"]
    server.wait_pool_whole()

    old_engine = server.engine
    replayed = server.server.replay.num_replayed
    streams = [Stream(server.address, p, **params) for p, params in requests]
    http = HTTPStream(server, prompts[0])
    for stream in streams:
        stream.wait_tokens(KILL_AFTER)
    assert http.num_chunks < MAX_TOKENS - 20
    kill_engine_process(server)
    at_kill = [min(len(t) for t in s.tokens) for s in streams]
    late = Stream(server.address, prompts[1], temperature=0.0, max_tokens=12, ignore_eos=True)
    for stream in [*streams, late]:
        stream.join()
    for i, (stream, want) in enumerate(zip(streams, reference)):
        assert stream.error is None, (i, stream.error)
        assert stream.tokens == want.tokens, i  # none lost, none repeated, none changed
        assert stream.text == want.text, i
        assert stream.finish == want.finish, i
        # The same top tokens; values within float noise (recomputed by a prefill, not decodes).
        for got, ref in zip(stream.logprobs, want.logprobs):
            assert len(got) == len(ref) and all(
                g.keys() == r.keys() and all(abs(g[t] - r[t]) < 1e-3 for t in g) for g, r in zip(got, ref)), i
    assert max(at_kill) < MAX_TOKENS - 20, at_kill  # the engine died mid-stream, not after it
    http.join()
    assert http.error is None and http.text == text and http.finish == "length"
    assert server.engine is not old_engine
    assert server.server.replay.num_replayed >= replayed + 4  # the stop stream may finish first
    metric = server.server.metrics.registry.get_sample_value(
        "raypaged_streams_replayed_total", {"model_name": server.server.service.model_name, "engine": "0"})
    assert metric == server.server.replay.num_replayed
    assert late.error is None and late.tokens == [hf_greedy(checkpoint_dir(NAME), tuple(prompts[1]), 12)]
    server.wait_pool_whole()
    assert_only_one_engine_left()


@pytest.mark.slow
def test_grammar_and_logit_bias_streams_go_on_after_the_engine_actor_is_ray_killed(server):
    """The engine's side of a resumed request: a grammar's matcher advanced over the tokens
    already streamed (a regex whose allowed tokens depend on the position), and a logit_bias."""
    prompts = random_prompts([6, 10], vocab_of(NAME), seed=73)
    greedy = hf_greedy(checkpoint_dir(NAME), tuple(prompts[1]), 4)
    requests = [
        (prompts[0], dict(temperature=0.8, seed=5, max_tokens=120,
                          structured_output=StructuredOutput(regex="(a[b-e]{3}x[a-e]{2}y){60}"))),
        (prompts[1], dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logit_bias={greedy[1]: -100.0, greedy[3]: -100.0, 7: 2.0})),
    ]
    reference = [Stream(server.address, p, **params) for p, params in requests]
    for stream in reference:
        stream.join()
    assert reference[0].error is None and reference[1].error is None
    old_engine = server.engine
    streams = [Stream(server.address, p, **params) for p, params in requests]
    for stream in streams:
        stream.wait_tokens(KILL_AFTER)
    ray.kill(old_engine.actor, no_restart=True)
    at_kill = [len(s.tokens[0]) for s in streams]
    for stream, want in zip(streams, reference):
        stream.join()
        assert stream.error is None, stream.error
        assert (stream.tokens, stream.text, stream.finish) == (want.tokens, want.text, want.finish)
    assert max(at_kill) < 100, at_kill
    assert server.engine is not old_engine
    server.wait_pool_whole()
    assert_only_one_engine_left()


def test_an_engine_that_never_comes_back_ends_the_streams_unavailable_within_the_bound(server):
    supervisor, replay = server.server.supervisor, server.server.replay
    factory, old_engine = supervisor.factory, server.engine

    async def failing_factory():
        raise RuntimeError("injected: no engine can start")

    bound = 1.5
    supervisor.factory, replay.recovery_timeout_s = failing_factory, bound
    try:
        stream = Stream(server.address, [5, 6, 7, 8], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        stream.wait_tokens(2)
        killed_at = time.monotonic()
        ray.kill(old_engine.actor, no_restart=True)
        time.sleep(0.3)
        with Client(server.address) as client, pytest.raises(RequestError) as refused:
            client.generate([5, 6, 7], max_tokens=2, timeout=30)  # during the outage: waits, then refused
        stream.join()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "did not come back within 1.5 s" in refused.value.message, refused.value.message
        assert stream.error is not None and stream.error.code == grpc.StatusCode.UNAVAILABLE
        assert "did not come back" in stream.error.message
        assert bound - 0.2 < stream.ended_at - killed_at < bound + 5
        with Client(server.address) as client, pytest.raises(RequestError) as refused:
            client.generate([5, 6, 7], max_tokens=2, timeout=30)  # past the bound: at once
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        supervisor.factory, replay.recovery_timeout_s = factory, RECOVERY_S
    wait_replaced(server, old_engine)
    prompt = random_prompts([9], vocab_of(NAME), seed=72)[0]
    with Client(server.address) as client:
        result = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=60)
    assert result.outputs[0].token_ids == hf_greedy(checkpoint_dir(NAME), tuple(prompt), 12)
    server.wait_pool_whole()
    assert_only_one_engine_left()
