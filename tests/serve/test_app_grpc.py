"""The Serve app's raypaged.v1 gRPC surface, live (tests/serve/conftest.py's instance): a grpc
stub through Serve's gRPC proxy to the ingress."""

from __future__ import annotations

import time

import grpc
import pytest

from raypaged.proto.v1 import raypaged_pb2 as pb
from tests.serve.serve_harness import APP, MAX_TOKENS, PROMPTS, engines_idle
from tests.support.serve_grpc import grpc_stub

pytestmark = pytest.mark.integration


APP_METADATA = (("application", APP),)  # which Serve application the proxy routes to


def test_grpc_through_serve_proxy(server, oracle):
    stub, channel = grpc_stub(server)
    with channel:
        token_ids, text, usage = [], "", None
        request = pb.GenerateRequest(prompt=PROMPTS[2], sampling_params=pb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        for response in stub.Generate(request, metadata=APP_METADATA, timeout=60):
            for delta in response.outputs:
                token_ids.extend(delta.token_ids)
                text += delta.text
            if response.HasField("usage"):
                usage = response.usage
        assert token_ids == oracle["outputs"][2].token_ids and text == oracle["outputs"][2].text
        assert usage.completion_tokens == MAX_TOKENS
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=APP_METADATA, timeout=30)
        assert info.name == "llama" and info.num_blocks == 64
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(pb.GenerateRequest(prompt=""), metadata=APP_METADATA, timeout=30))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "empty" in raised.value.details()


def test_grpc_requests_sharing_a_prefix_go_to_the_replica_holding_it(server):
    """Serve's request router (serve/prefix_request_router.py) reads the GenerateRequest: once a
    replica's routing stats report the prefix, the later requests with it all land there."""
    stub, channel = grpc_stub(server)
    shared = list(range(3, 3 + 48))  # three blocks of 16
    before = {r["replica"]: r["prefix_cache_hits"] for r in engines_idle().values()}
    params = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with channel:
        for i in range(4):
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=shared + [60 + i], sampling_params=params),
                               metadata=APP_METADATA, timeout=60))
            time.sleep(1.5)  # the replicas' routing stats are polled every second
    after = engines_idle()
    gained = sorted(after[r]["prefix_cache_hits"] - before.get(r, 0) for r in after)
    assert gained == [0, 3 * 48], gained  # the 2nd to 4th requests hit, all on one replica


MALFORMED = [b"\x12\x04\xff\xfe\xc0\xaf", b"\xff" * 16, b"\x12\x7fabc",
             b"\x0a\x03\xed\xa0\x80"]  # the last: request_id holding a surrogate's UTF-8-like bytes


def test_malformed_bytes_through_serve_proxy_are_invalid_argument(server):
    """Issue 24: Serve's gRPC ingress answered UNKNOWN (an unexpected DecodeError) to bytes that
    do not parse, where `raypaged launch` answers INVALID_ARGUMENT; every method, both doors."""
    _, channel = grpc_stub(server)
    with channel:
        generate = channel.unary_stream("/raypaged.v1.RaypagedService/Generate")
        abort = channel.unary_unary("/raypaged.v1.RaypagedService/Abort")
        model_info = channel.unary_unary("/raypaged.v1.RaypagedService/GetModelInfo")
        # (An AbortRequest skips the unknown field 2, a GetModelInfoRequest every field: those
        # bytes parse for them.)
        for call, cases in ((lambda d: list(generate(d, metadata=APP_METADATA, timeout=30)), MALFORMED),
                            (lambda d: abort(d, metadata=APP_METADATA, timeout=30), MALFORMED[1:]),
                            (lambda d: model_info(d, metadata=APP_METADATA, timeout=30), MALFORMED[1:3])):
            for data in cases:
                with pytest.raises(grpc.RpcError) as raised:
                    call(data)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (data, raised.value)
                assert "not a valid message" in raised.value.details()
    engines_idle()
