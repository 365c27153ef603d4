"""Fuzzing the gRPC API of a live server (tiny checkpoint, CPU).

- Generated GenerateRequest messages (hypothesis, every field from valid through absurd): each
  gets INVALID_ARGUMENT exactly when an oracle written from the API's documented limits says the
  request is invalid, and otherwise a well-formed stream (or, when the test leaves early, a
  cancel); never INTERNAL, UNKNOWN or a hang.
- Malformed bytes on the wire: random payloads sent as the request message of each method, and
  garbage on a raw TCP connection (not even HTTP/2).
- Oversized messages (RESOURCE_EXHAUSTED) and a million prompt ids (refused at once).

The oracle and the generated requests: tests/support/generate_requests.py.

Throughout: the server stays SERVING; at the end the engine is alive and the pool whole. The
engine schedules asynchronously (the default, spelled out: cancels and aborts land while a step
is in flight).
CI runs a few hundred cases; `-m slow` runs 1,000 generated requests and 1,000 byte strings.
"""

from __future__ import annotations

import random
import socket
import time
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from raypaged.client import Client
from raypaged.proto.v1 import raypaged_pb2 as pb
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import ServerThread, cpu_server
from tests.support.generate_requests import MAX_MODEL_LEN, VOCAB, expected_refusal, generate_requests

pytestmark = pytest.mark.integration

NAME = "llama"
GENERATE = "/raypaged.v1.RaypagedService/Generate"
METHODS = {GENERATE: pb.GenerateRequest, "/raypaged.v1.RaypagedService/Abort": pb.AbortRequest,
           "/raypaged.v1.RaypagedService/GetModelInfo": pb.GetModelInfoRequest}
# What a fuzzed call may end with. INTERNAL / UNKNOWN (a crash inside), UNAVAILABLE (the engine
# died) and DEADLINE_EXCEEDED (a hang) may not.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.CANCELLED}
CASES: Counter = Counter()  # fuzz cases tried, reported at the end of the module


FUZZ = settings(deadline=None, database=None, derandomize=True, max_examples=150,
                suppress_health_check=list(HealthCheck))
FUZZ_FULL = settings(FUZZ, derandomize=False, max_examples=1000)


@pytest.fixture(scope="module")
def server():
    with cpu_server(str(checkpoint_dir(NAME)), num_gpu_blocks_override=64, max_num_seqs=4,
                    async_scheduling=True) as running:
        assert running.engine.model_info["max_model_len"] == MAX_MODEL_LEN
        assert running.engine.model_info["vocab_size"] == VOCAB
        yield running
        assert running.engine.is_alive
        running.wait_pool_whole()
    print(f"\nfuzz cases tried: {dict(CASES)}")


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as channel:
        yield channel


def call_generate(channel: grpc.Channel, payload: bytes, max_messages: int) -> tuple[grpc.StatusCode, str, list]:
    """Raw bytes as the request; at most max_messages responses read, then the call is cancelled."""
    call = channel.unary_stream(GENERATE, response_deserializer=pb.GenerateResponse.FromString)(
        payload, timeout=60)
    responses = []
    try:
        for response in call:
            responses.append(response)
            if len(responses) >= max_messages:
                call.cancel()
                return grpc.StatusCode.CANCELLED, "", responses
    except grpc.RpcError as e:
        return e.code(), e.details() or "", responses
    return grpc.StatusCode.OK, "", responses


def check_served(m: pb.GenerateRequest, responses: list[pb.GenerateResponse], complete: bool) -> None:
    n = m.sampling_params.n if m.sampling_params.HasField("n") else 1
    tokens: Counter = Counter()
    finished = set()
    for response in responses:
        for delta in response.outputs:
            assert 0 <= delta.index < n and delta.index not in finished
            assert all(0 <= t < VOCAB for t in delta.token_ids)
            if m.sampling_params.HasField("logprobs"):
                assert len(delta.logprobs) == len(delta.token_ids)
            tokens[delta.index] += len(delta.token_ids)
            if delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finished.add(delta.index)
    if complete:
        assert finished == set(range(n))
        assert responses[-1].HasField("usage")
        assert responses[-1].usage.completion_tokens == sum(tokens.values())
        if m.sampling_params.HasField("max_tokens"):
            assert max(tokens.values()) <= m.sampling_params.max_tokens


def fuzz_one(server: ServerThread, channel: grpc.Channel, m: pb.GenerateRequest, payload: bytes | None = None) -> None:
    refusal = expected_refusal(m, server.tokenizer)
    # Short requests run to their end and are checked whole; long ones are left after 2 messages.
    sp = m.sampling_params
    short = (sp.max_tokens if sp.HasField("max_tokens") else 16) <= 16 and (sp.n if sp.HasField("n") else 1) <= 2
    code, details, responses = call_generate(channel, payload or m.SerializeToString(), 10**6 if short else 2)
    assert code in ALLOWED, (code, details)
    if refusal is not None:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (refusal, code, details)
        assert details and "Traceback" not in details
        CASES["generated: refused"] += 1
    else:
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED), (code, details)
        check_served(m, responses, complete=code == grpc.StatusCode.OK)
        CASES["generated: served"] += 1
    with Client(server.address) as client:
        assert client.health() == "SERVING"
    wait_no_stream_in_flight(server)


def wait_no_stream_in_flight(server: ServerThread, timeout_s: float = 10.0) -> None:
    """A cancelled call ends on the server a moment later; the next case may reuse its id."""
    deadline = time.monotonic() + timeout_s
    while server.server.service.num_in_flight:
        assert time.monotonic() < deadline, "a stream is still in flight on the server"
        time.sleep(0.002)


def tiny_top_p(top_p: float) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling_params=pb.SamplingParams(
        max_tokens=4, temperature=1.0, top_p=top_p))


@FUZZ
@given(generate_requests())
# Found by this test: a top_p that is 0 in float32 (valid: > 0) killed the engine's sampler.
@example(tiny_top_p(1e-50))
@example(tiny_top_p(5e-324))
def test_fuzz_generate_requests(server, channel, message):
    fuzz_one(server, channel, message)


@pytest.mark.slow
@FUZZ_FULL
@given(generate_requests())
def test_fuzz_generate_requests_full(server, channel, message):
    fuzz_one(server, channel, message)


def test_request_id_reused_right_after_a_cancel(server, channel):
    """Found by the fuzzer: a cancelled request's abort records, still on their way, ended the
    next request with the same id at once (it then ran on in the engine for no one, holding the
    id). Each request now streams in full."""
    from tests.support.hf_oracle import hf_greedy

    message = pb.GenerateRequest(request_id="reused", prompt_token_ids=[5, 6, 7, 8],
                                 sampling_params=pb.SamplingParams(n=3, max_tokens=12, temperature=0.0))
    message.sampling_params.ignore_eos = True
    expected = hf_greedy(checkpoint_dir(NAME), (5, 6, 7, 8), 12)
    for _ in range(4):
        code, _, _ = call_generate(channel, message.SerializeToString(), 1)
        assert code == grpc.StatusCode.CANCELLED
        wait_no_stream_in_flight(server)  # the cancel reached the server: the id is free again
        code, details, responses = call_generate(channel, message.SerializeToString(), 10**6)
        assert code == grpc.StatusCode.OK, details
        for index in range(3):
            tokens = [t for r in responses for d in r.outputs if d.index == index for t in d.token_ids]
            assert tokens == expected  # greedy: every sample alike
    server.wait_pool_whole()


def test_calls_cancelled_as_they_start_leave_nothing_running(server, channel):
    """Calls cancelled at once or within a few ms, while their requests are on their way to the
    engine: each is aborted there (no request runs on for no one, holding blocks)."""
    message = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling_params=pb.SamplingParams(
        max_tokens=200, temperature=0.0))
    message.sampling_params.ignore_eos = True
    payload = message.SerializeToString()
    for i in range(30):
        call = channel.unary_stream(GENERATE)(payload, timeout=60)
        time.sleep(0.001 * (i % 10))
        call.cancel()
    wait_no_stream_in_flight(server)
    # An orphan would run its 200 tokens for seconds; aborted requests are gone within a step.
    server.wait_until(lambda s: s.num_running == 0 and s.num_waiting == 0, timeout=1.5,
                      what="every cancelled request to leave the engine")
    server.wait_pool_whole()


# ---- malformed bytes ---------------------------------------------------------------------------

def send_bytes(server: ServerThread, channel: grpc.Channel, method: str, payload: bytes) -> None:
    try:
        parsed = METHODS[method].FromString(payload)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        parsed = None
    if method == GENERATE and parsed is not None:  # bytes that happen to be a request
        fuzz_one(server, channel, parsed, payload)
        return
    if method == GENERATE:
        code, details, _ = call_generate(channel, payload, 10**6)
    else:
        try:
            channel.unary_unary(method)(payload, timeout=30)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
    if parsed is None:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, code, details)
        assert "not a valid message" in details
    else:  # Abort of an id nobody streams: NOT_FOUND; model info: OK
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND), (method, code, details)
    CASES["malformed bytes"] += 1


CRAFTED = [
    b"\xff", b"\x0a", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x03\xff\xfe\xfd",  # truncated, bad varint, bad UTF-8
    b"\x1a\x05\x80\x80\x80\x80\x80", b"\x22\x80\x80\x80\x80\x10", b"\x0b\x0c", b"\x0f",  # groups, wire type 7
    b"\x22\x02\x08\xff", b"\x22\x04\x65\xff\xff\xff",  # sampling params cut inside
    b"\x0a\x03\xed\xa0\x80", b"\x12\x03\xed\xb0\x80",  # a lone surrogate, UTF-8 style: not UTF-8
]


@pytest.mark.parametrize("method", list(METHODS))
def test_crafted_malformed_bytes(server, channel, method):
    for payload in CRAFTED:
        send_bytes(server, channel, method, payload)


@FUZZ
@given(st.sampled_from(list(METHODS)), st.binary(max_size=300))
def test_fuzz_random_bytes(server, channel, method, payload):
    send_bytes(server, channel, method, payload)


@pytest.mark.slow
@FUZZ_FULL
@given(st.sampled_from(list(METHODS)), st.binary(max_size=2000))
def test_fuzz_random_bytes_full(server, channel, method, payload):
    send_bytes(server, channel, method, payload)


def test_malformed_bytes_to_health_are_invalid_argument(server, channel):
    """Every service of this server, not only raypaged.v1's: health checks refuse bytes that do
    not parse with INVALID_ARGUMENT too (they got UNKNOWN: an unexpected DecodeError)."""
    for payload in (b"\xff" * 16, b"\x12\x7fabc", b"\x0a\x03\xed\xa0\x80"):
        with pytest.raises(grpc.RpcError) as raised:
            channel.unary_unary("/grpc.health.v1.Health/Check")(payload, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (payload, raised.value)
        with pytest.raises(grpc.RpcError) as raised:
            list(channel.unary_stream("/grpc.health.v1.Health/Watch")(payload, timeout=30))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (payload, raised.value)
    with Client(server.address) as client:
        assert client.health() == "SERVING"


def test_garbage_on_a_raw_tcp_connection(server):
    """Not even HTTP/2: bytes straight onto the socket, a bad preface, half a frame. The server
    drops the connection; other clients never notice."""
    host, port = server.address.rsplit(":", 1)
    rng = random.Random(7)
    garbage = [bytes(rng.randrange(256) for _ in range(size)) for size in (1, 64, 4096, 65536)]
    garbage += [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 9,
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00"]
    for payload in garbage:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):  # until the server closes
                    pass
            except OSError:  # reset, broken pipe, or already closed (ENOTCONN): all are drops
                pass
        CASES["raw TCP garbage"] += 1
    with Client(server.address) as client:
        assert client.health() == "SERVING"
        assert client.generate([5, 6, 7], max_tokens=3, temperature=0.0).outputs[0].finish_reason


def test_message_size_limits(server, channel):
    # Over the 4 MiB bound: refused by gRPC itself before any parsing.
    code, details, _ = call_generate(channel, pb.GenerateRequest(prompt="x" * (5 * 2**20)).SerializeToString(), 1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    # Under it, a million prompt ids: refused at once, on the length, before looking at each id.
    started = time.monotonic()
    m = pb.GenerateRequest()
    m.prompt_token_ids.extend([7] * 1_000_000)
    code, details, _ = call_generate(channel, m.SerializeToString(), 1)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "1000000 tokens" in details
    assert time.monotonic() - started < 5
    CASES["oversized"] += 2
    with Client(server.address) as client:
        assert client.health() == "SERVING"
