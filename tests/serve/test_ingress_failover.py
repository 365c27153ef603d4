"""The Serve app's ingress holds the client's stream; an engine replica that dies under it costs
the client nothing (serve/engine_pool.py), and the ingress places every request, HTTP too, by
the prefix the engine replicas hold (serve/prefix_request_router.py).

On tests/serve/conftest.py's instance (an ingress, two engine replicas). A fault test waits for
Serve to replace the replica it killed, and leaves both pools whole.

- A streamed chat completion over HTTP whose engine replica's actor is killed mid-stream, and a
  seeded sampled gRPC stream whose replica's engine actor is killed mid-stream: each gives the
  text, tokens and finish reason of its fault-free run (greedy: transformers' tokens), and the
  ingress counts the resumption (the kill really fell mid-stream).
- HTTP requests sharing a prefix land on the engine replica holding it.
- A seeded n = 2 gRPC stream whose engine replica's actor is killed mid-stream: each sample's
  tokens are those of its fault-free run (its open samples resume on the other replica as
  engine calls of their own, serve/call_identity.py).
- A replica whose engine actor was killed while idle takes no new call: the ingress holds it out
  of routing from its routing stats (serve/replica_quarantine.py), so new calls resume nowhere
  and give their fault-free tokens; once Serve has replaced it, both replicas take calls again.
- Bad input is a 400 / INVALID_ARGUMENT and reaches no engine.
- Nothing leaks: after each fault every engine pool is whole and the ingress holds no stream
  (and the package's instance checks, as it shuts down, that no actor and no placement group is
  left).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
import requests

from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.proto.v1 import raypaged_pb2_grpc as pb_grpc
from raypaged.serve.route_hint import RouteHint
from tests.serve.serve_harness import (
    APP,
    engine_handle,
    engine_replicas,
    engine_stats,
    engines_idle,
    ingress_stats,
)
from tests.support.hf_oracle import hf_greedy

pytestmark = pytest.mark.integration

MAX_TOKENS = 200
KILL_AFTER = 4  # messages the client has read when the engine is killed
METADATA = (("application", APP),)


def _streaming_replica() -> str:
    """The engine replica running a request now."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for replica in engine_replicas():
            if engine_stats(replica)["num_running"] > 0:
                return replica
    raise AssertionError("no engine replica runs the stream")


def _chat_stream(server, on_chunk=None) -> tuple[str, str | None]:
    body = {"model": "llama", "messages": [{"role": "user", "content": "The block table maps"}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    text, finish, seen = "", None, 0
    with requests.post(f"{server['base']}/v1/chat/completions", json=body, stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if not line or line == b"data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix(b"data: "))
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
            seen += 1
            if on_chunk is not None and seen == KILL_AFTER:
                on_chunk()
    return text, finish


def _kill_replica() -> None:
    replica = _streaming_replica()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#raypaged_engine#{replica}", namespace="serve"),
             no_restart=True)


def _kill_engine_actor() -> None:
    replica = _streaming_replica()
    ray.kill(engine_handle().engine_actor.remote(route=RouteHint(pin=replica)).result(timeout_s=30),
             no_restart=True)


def _grpc_stream(server, params: pb.SamplingParams, on_message=None,
                 prompt: str = "Pack my box with") -> tuple[list[int], str, int]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server['grpc']}")
    tokens, text, finish = [], "", pb.FINISH_REASON_UNSPECIFIED
    with channel:
        stub = pb_grpc.RaypagedServiceStub(channel)
        request = pb.GenerateRequest(prompt=prompt, sampling_params=params)
        for i, response in enumerate(stub.Generate(request, metadata=METADATA, timeout=120)):
            for delta in response.outputs:
                tokens += delta.token_ids
                text += delta.text
                finish = delta.finish_reason or finish
            if on_message is not None and i + 1 == KILL_AFTER:
                on_message()
    return tokens, text, finish


def _grpc_samples(server, params: pb.SamplingParams, on_message=None) -> dict[int, tuple[list[int], int]]:
    """Each sample's tokens and finish reason of one gRPC stream."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server['grpc']}")
    samples: dict[int, tuple[list[int], int]] = {}
    with channel:
        stub = pb_grpc.RaypagedServiceStub(channel)
        request = pb.GenerateRequest(prompt="Pack my box with", sampling_params=params)
        for i, response in enumerate(stub.Generate(request, metadata=METADATA, timeout=120)):
            for delta in response.outputs:
                tokens, finish = samples.get(delta.index, ([], pb.FINISH_REASON_UNSPECIFIED))
                samples[delta.index] = (tokens + list(delta.token_ids), delta.finish_reason or finish)
            if on_message is not None and i + 1 == KILL_AFTER:
                on_message()
    return samples


def test_http_requests_sharing_a_prefix_go_to_the_replica_holding_it(server):
    """The ingress tokenized the body before an engine was chosen: its handle's router places
    the OpenAI request by prefix (Serve's HTTP proxy alone could place it by load only)."""
    before = {r: s["prefix_cache_hits"] for r, s in engines_idle().items()}
    shared = list(range(100, 100 + 48))  # three blocks of 16 no other test of the package sends
    for i in range(4):
        body = {"model": "llama", "prompt": shared + [60 + i], "max_tokens": 2, "temperature": 0.0}
        assert requests.post(f"{server['base']}/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(0.5 if i else 1.5)  # the replicas' routing stats are polled every second
    after = engines_idle()
    gained = sorted(after[r]["prefix_cache_hits"] - before[r] for r in after)
    assert gained == [0, 3 * 48], gained


def test_bad_input_is_refused_at_the_ingress(server):
    base = f"{server['base']}/v1"
    for body, needle in (({"model": "llama", "prompt": "x", "temperature": -1}, "temperature"),
                         ({"model": "llama", "prompt": [5, 10**6]}, "not a token id"),
                         ({"model": "llama", "messages": []}, "messages")):
        route = "chat/completions" if "messages" in body else "completions"
        response = requests.post(f"{base}/{route}", json=body, timeout=30)
        assert response.status_code == 400 and needle in response.text, response.text
    channel = grpc.insecure_channel(f"127.0.0.1:{server['grpc']}")
    with channel, pytest.raises(grpc.RpcError) as raised:
        list(pb_grpc.RaypagedServiceStub(channel).Generate(pb.GenerateRequest(prompt=""), metadata=METADATA,
                                                           timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in raised.value.details()
    engines_idle()


def test_http_chat_stream_goes_on_when_its_engine_replica_dies(server):
    reference = _chat_stream(server)
    assert reference[1] == "length"
    resumed = ingress_stats()["resumed"]
    assert _chat_stream(server, on_chunk=_kill_replica) == reference
    assert ingress_stats()["resumed"] == resumed + 1  # the kill fell mid-stream
    engines_idle()  # Serve replaced the replica; both pools whole


def test_grpc_parallel_samples_go_on_when_their_engine_replica_dies(server):
    """n = 2, seeded: the replica's actor dies with both samples open; each resumes on the
    other replica as a call of its own and streams the tokens of the fault-free run."""
    params = pb.SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
    reference = _grpc_samples(server, params)
    assert sorted(reference) == [0, 1]
    assert all(len(tokens) == MAX_TOKENS and finish == pb.FINISH_REASON_LENGTH
               for tokens, finish in reference.values())
    assert reference[0][0] != reference[1][0]  # two samples, not one twice
    resumed = ingress_stats()["resumed"]
    assert _grpc_samples(server, params, on_message=_kill_replica) == reference
    assert ingress_stats()["resumed"] == resumed + 1  # the kill fell mid-stream
    engines_idle()  # Serve replaced the replica; both pools whole


GREEDY = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True)


def _survives_engine_actor_kill(server, params: pb.SamplingParams) -> None:
    reference = _grpc_stream(server, params)
    assert reference[2] == pb.FINISH_REASON_LENGTH and len(reference[0]) == MAX_TOKENS
    resumed = ingress_stats()["resumed"]
    assert _grpc_stream(server, params, on_message=_kill_engine_actor) == reference
    assert ingress_stats()["resumed"] == resumed + 1  # the kill fell mid-stream
    engines_idle()  # the replica whose engine died was replaced; both pools whole


def test_grpc_seeded_stream_goes_on_when_its_engine_actor_dies(server):
    """The same tokens and text as without the fault: the seeded sampler's draws follow the
    output positions, not the engine that makes them. The greedy reference is transformers'."""
    from transformers import AutoTokenizer

    prompt = tuple(AutoTokenizer.from_pretrained(server["model"]).encode("Pack my box with"))
    assert _grpc_stream(server, GREEDY)[0] == hf_greedy(server["model"], prompt, MAX_TOKENS)
    _survives_engine_actor_kill(server, SEEDED)


@pytest.mark.slow
def test_grpc_greedy_stream_goes_on_when_its_engine_actor_dies(server):
    _survives_engine_actor_kill(server, GREEDY)


NEW_CALLS = ("The block table maps", "def attention(query, key", "Pack my box with", "A paged pool of",
             "Serve replaces a replica", "Tokens stream back")


def _all_greedy(server, prompts: tuple[str, ...]) -> list[tuple[list[int], str, int]]:
    """The prompts' greedy streams, all at once (the router sees them in flight together)."""
    params = pb.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _grpc_stream(server, params, prompt=p), prompts))


def _until(condition, what: str, bound_s: float = 120.0) -> None:
    deadline = time.monotonic() + bound_s  # a liveness bound, not a timing claim
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_new_calls_avoid_a_replica_whose_engine_died_until_serve_replaces_it(server):
    victim = sorted(engines_idle())[0]
    reference = _all_greedy(server, NEW_CALLS)
    ray.kill(engine_handle().engine_actor.remote(route=RouteHint(pin=victim)).result(timeout_s=30),
             no_restart=True)
    # Its next routing stats report the dead engine; the ingress holds it out before any call.
    _until(lambda: victim in ingress_stats()["held_out"], f"the ingress never held {victim} out of routing")
    resumed = ingress_stats()["resumed"]
    assert _all_greedy(server, NEW_CALLS) == reference
    assert ingress_stats()["resumed"] == resumed  # no new call went to the dead replica
    # Serve replaces it (its health check fails); the replacement is a new id, the hold goes.
    _until(lambda: victim not in engine_replicas(), f"Serve never replaced {victim}")
    before = {r: s["num_streams"] for r, s in engines_idle().items()}
    _until(lambda: ingress_stats()["held_out"] == [], "the hold outlived the replica")
    assert _all_greedy(server, NEW_CALLS) == reference
    after = {r: engine_stats(r)["num_streams"] for r in before}
    assert all(after[r] > before[r] for r in before), (before, after)  # both take calls again
    engines_idle()
