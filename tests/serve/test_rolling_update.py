"""A rolling update of the Serve app under a live stream: `serve.run` of the app with new engine
arguments replaces every replica while greedy gRPC streams are open, and the client sees each
stream whole — the tokens, text and finish of the same request before the update — with Serve
giving the old replicas `graceful_shutdown_timeout_s` to finish it (or the ingress carrying it
to a new replica, as when one dies). After the update the new replicas serve the same tokens and
every pool is whole.

On tests/serve/conftest.py's Serve instance, as an app of its own ("roll"), deleted at the end.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from ray import serve

from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.proto.v1 import raypaged_pb2_grpc as pb_grpc
from raypaged.serve import build_app
from tests.serve.serve_harness import ENGINE_ARGS, engine_replicas, engines_satisfy, idle_and_whole

pytestmark = pytest.mark.integration

APP = "roll"
PARAMS = pb.SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
PROMPTS = ("The block table maps", "def attention(query, key")


def _stream(server, prompt: str) -> tuple[list[int], str, int]:
    tokens, text, finish = [], "", pb.FINISH_REASON_UNSPECIFIED
    with grpc.insecure_channel(f"127.0.0.1:{server['grpc']}") as channel:
        stub = pb_grpc.RaypagedServiceStub(channel)
        request = pb.GenerateRequest(prompt=prompt, sampling_params=PARAMS)
        for response in stub.Generate(request, metadata=(("application", APP),), timeout=240):
            for delta in response.outputs:
                tokens += delta.token_ids
                text += delta.text
                finish = delta.finish_reason or finish
    return tokens, text, finish


def test_a_rolling_update_keeps_every_stream_in_flight_whole(server):
    """Streams run back to back, one per prompt at a time, for as long as the update takes, so
    that some are in flight on each old replica as Serve stops it."""
    args = {"model": server["model"], "num_replicas": 2, **ENGINE_ARGS}
    serve.run(build_app(args), name=APP, route_prefix="/roll")
    try:
        engines_satisfy(idle_and_whole, app=APP)
        before = set(engine_replicas(APP))
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            references = list(pool.map(lambda p: _stream(server, p), PROMPTS))
            assert all(len(r[0]) == PARAMS.max_tokens and r[2] == pb.FINISH_REASON_LENGTH for r in references)
            failures: list[BaseException] = []

            def update() -> None:  # serve.run blocks until the new replicas run
                try:
                    serve.run(build_app({**args, "max_num_seqs": ENGINE_ARGS["max_num_seqs"] - 2}),
                              name=APP, route_prefix="/roll")
                except BaseException as e:  # noqa: BLE001 - reported below
                    failures.append(e)

            updater = threading.Thread(target=update)
            updater.start()
            rounds = 0
            deadline = time.monotonic() + 300  # a liveness bound, not a timing claim
            while updater.is_alive():
                assert time.monotonic() < deadline, "the update never finished"
                assert list(pool.map(lambda p: _stream(server, p), PROMPTS)) == references
                rounds += 1
        assert failures == [] and rounds >= 1
        reports = engines_satisfy(idle_and_whole, app=APP)
        assert before.isdisjoint(reports), (before, sorted(reports))  # every replica was replaced
        assert [_stream(server, p) for p in PROMPTS] == references  # the new ones serve the same tokens
    finally:
        serve.delete(APP)
